"""Fréchet distance, KID and the streaming feature statistics under them, against oracles.

Oracles: pytorch-fid's ``calculate_frechet_distance`` (scipy ``sqrtm``) where the covariances are
full rank; for singular ones (fewer vectors than dimensions) the trace of the square root computed
in the small space of the vectors (the nuclear norm of ``A Bᵀ``); a plain unbiased MMD² for KID;
``np.mean``/``np.cov`` for the statistics; features pooled by hand and a dump for the image pipeline.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pytorch_fid.fid_score import calculate_frechet_distance

from featurehooks import FeatureExtractor, InvalidValueError, LayerNotFoundError, dump_features
from featurehooks._layout import pool_positions
from featurehooks.images import read_image, transform_for
from featurehooks.metrics.collect import feature_statistics, feature_statistics_by_layer, statistics_from_dump
from featurehooks.metrics.frechet import frechet_distance, kernel_inception_distance
from featurehooks.metrics.statistics import FeatureOrigin, FeatureStatistics

RESIZE, CROP = 72, 64
# pytorch-fid 0.3 passes scipy's deprecated sqrtm(disp=False)
pytestmark = pytest.mark.filterwarnings("ignore:The `disp` argument is deprecated:DeprecationWarning")


def sample(rng: np.random.Generator, count: int, dim: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
    """Correlated Gaussian features: a random linear map of white noise."""
    mixing = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    return (rng.normal(size=(count, dim)) @ mixing) * scale + shift


def pytorch_fid(a: np.ndarray, b: np.ndarray) -> float:
    with contextlib.redirect_stdout(io.StringIO()):  # it prints when it adds eps to the diagonals
        return float(calculate_frechet_distance(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False)))


def frechet_in_sample_space(a: np.ndarray, b: np.ndarray) -> float:
    """tr((Σa Σb)^½) is the sum of the singular values of A Bᵀ (Σ = AᵀA): exact for any rank."""
    centered_a = (a - a.mean(0)) / np.sqrt(len(a) - 1)
    centered_b = (b - b.mean(0)) / np.sqrt(len(b) - 1)
    cross = np.linalg.svd(centered_a @ centered_b.T, compute_uv=False).sum()
    diff = a.mean(0) - b.mean(0)
    return float(diff @ diff + (centered_a**2).sum() + (centered_b**2).sum() - 2 * cross)


# -- Fréchet distance ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("count_a", "count_b", "dim", "scale", "shift"),
    [(400, 400, 16, 1.0, 0.5), (300, 500, 32, 1.7, 0.0), (2000, 1500, 64, 0.3, -2.0), (150, 150, 100, 1.0, 0.1)],
)
def test_frechet_equals_pytorch_fid_for_full_rank_covariances(
    count_a: int, count_b: int, dim: int, scale: float, shift: float
) -> None:
    rng = np.random.default_rng(count_a + dim)
    a, b = sample(rng, count_a, dim), sample(rng, count_b, dim, scale, shift)
    expected = pytorch_fid(a, b)
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-6)
    assert frechet_distance(torch.from_numpy(a).float(), torch.from_numpy(b).float()) == pytest.approx(
        pytorch_fid(a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)), rel=1e-6
    )


@pytest.mark.parametrize(("count", "dim"), [(40, 64), (12, 150), (64, 64)])
def test_singular_covariances_are_exact(count: int, dim: int) -> None:
    """With N <= D the covariances have rank N - 1 < D; the distance is still defined and computed exactly.

    pytorch-fid's scipy sqrtm is ill-conditioned there (it adds 1e-6 to the diagonals when it fails), so
    it is only close; the oracle is the same trace computed in the N-dimensional space of the vectors.
    """
    rng = np.random.default_rng(dim)
    a, b = sample(rng, count, dim), sample(rng, count + 3, dim, 1.2, 0.3)
    with pytest.warns(UserWarning, match=f"covariance is singular .* use at least {dim + 1} vectors") as caught:
        value = frechet_distance(a, b)
    assert {Path(w.filename).name for w in caught} == {Path(__file__).name}  # the warning names the caller's line
    assert value == pytest.approx(frechet_in_sample_space(a, b), rel=1e-10)
    assert value == pytest.approx(pytorch_fid(a, b), rel=1e-4)


def test_frechet_is_zero_for_identical_sets_and_symmetric() -> None:
    rng = np.random.default_rng(1)
    a, b = sample(rng, 300, 24), sample(rng, 200, 24, 2.0, 1.0)
    scale = np.trace(np.cov(a, rowvar=False))
    assert frechet_distance(a, a) <= 1e-12 * scale
    assert frechet_distance(a, a.copy()[::-1]) <= 1e-12 * scale  # the same set in another order
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-12)
    assert frechet_distance(a, b) > 1


def test_frechet_takes_statistics_features_and_moment_pairs_alike() -> None:
    rng = np.random.default_rng(2)
    a, b = sample(rng, 120, 12), sample(rng, 90, 12, 1.5)
    stats = FeatureStatistics().update(a)
    pair = (b.mean(0), np.cov(b, rowvar=False))
    expected = frechet_distance(a, b)
    for left in (a, torch.from_numpy(a), stats, (stats.mean, stats.covariance)):
        assert frechet_distance(left, pair) == pytest.approx(expected, rel=1e-12)


def test_frechet_refuses_what_it_cannot_compare() -> None:
    rng = np.random.default_rng(3)
    a = sample(rng, 50, 8)
    with pytest.raises(InvalidValueError, match="8 features per vector and b 9"):
        frechet_distance(a, sample(rng, 50, 9))
    with pytest.raises(InvalidValueError, match="1 feature vectors; a covariance needs 2"):
        frechet_distance(a, a[:1])
    nan = a.copy()
    nan[3, 2] = np.nan
    with pytest.raises(InvalidValueError, match="NaN or infinite values in 1 of 50"):
        frechet_distance(a, nan)
    with pytest.raises(InvalidValueError, match="not symmetric"):
        frechet_distance(a, (np.zeros(8), np.triu(np.ones((8, 8)))))
    with pytest.raises(InvalidValueError, match=r"needs a \(8, 8\) covariance"):
        frechet_distance(a, (np.zeros(8), np.eye(7)))
    with pytest.raises(TypeError, match="FeatureStatistics, \\(N, D\\) features"):
        frechet_distance(a, "features.npz")


# -- KID -----------------------------------------------------------------------------------------------
def plain_unbiased_mmd2(x: np.ndarray, y: np.ndarray) -> float:
    """MMD² with k(u, v) = (u·v / D + 1)³, every pair written out, diagonals of k(x, x) and k(y, y) left out."""
    dim = x.shape[1]

    def kernel(u: np.ndarray, v: np.ndarray) -> float:
        return (u @ v / dim + 1) ** 3

    m, n = len(x), len(y)
    within_x = sum(kernel(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    within_y = sum(kernel(y[i], y[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    across = sum(kernel(x[i], y[j]) for i in range(m) for j in range(n)) / (m * n)
    return within_x + within_y - 2 * across


def test_kid_equals_a_plain_unbiased_mmd_on_full_sets() -> None:
    rng = np.random.default_rng(4)
    x, y = sample(rng, 40, 10), sample(rng, 40, 10, 1.3, 0.4)
    mean, std = kernel_inception_distance(x, y, subsets=1, subset_size=40)
    assert mean == pytest.approx(plain_unbiased_mmd2(x, y), rel=1e-10)
    assert std == 0.0
    assert kernel_inception_distance(x, y, subsets=7, subset_size=40) == (mean, 0.0)  # every subset: the whole set
    assert kernel_inception_distance(torch.from_numpy(x).float(), y, subset_size=40)[0] == pytest.approx(mean, rel=1e-5)


def test_kid_subsets_are_seeded_and_average_the_plain_estimate() -> None:
    rng = np.random.default_rng(5)
    x, y = sample(rng, 60, 6), sample(rng, 50, 6, 1.5, 0.5)
    mean, std = kernel_inception_distance(x, y, subsets=3, subset_size=20, seed=7)
    assert (mean, std) == kernel_inception_distance(x, y, subsets=3, subset_size=20, seed=7)
    assert (mean, std) != kernel_inception_distance(x, y, subsets=3, subset_size=20, seed=8)
    generator = torch.Generator().manual_seed(7)
    plain = []
    for _ in range(3):
        rows_x = torch.randperm(60, generator=generator)[:20].numpy()
        rows_y = torch.randperm(50, generator=generator)[:20].numpy()
        plain.append(plain_unbiased_mmd2(x[rows_x], y[rows_y]))
    assert mean == pytest.approx(np.mean(plain), rel=1e-10)
    assert std == pytest.approx(np.std(plain), rel=1e-8)


def test_kid_is_near_zero_for_one_distribution() -> None:
    generator = torch.Generator().manual_seed(6)
    x, y = torch.randn(600, 32, generator=generator), torch.randn(600, 32, generator=generator)
    shifted = torch.randn(600, 32, generator=generator) * 1.1 + 0.1
    same, same_std = kernel_inception_distance(x, y, subsets=10, subset_size=300)
    different, _ = kernel_inception_distance(x, shifted, subsets=10, subset_size=300)
    assert abs(same) < 3 * same_std + 1e-3
    assert abs(same) < different / 10


def test_kid_takes_statistics_that_kept_features() -> None:
    rng = np.random.default_rng(8)
    x, y = sample(rng, 30, 5), sample(rng, 30, 5, 2.0)
    kept = FeatureStatistics(keep=100).update(x)
    assert kernel_inception_distance(kept, y, subset_size=30)[0] == pytest.approx(
        kernel_inception_distance(x.astype(np.float32), y, subset_size=30)[0], rel=1e-12
    )
    with pytest.raises(InvalidValueError, match="kept no feature vectors"):
        kernel_inception_distance(FeatureStatistics().update(x), y)
    with pytest.raises(InvalidValueError, match="at least 2 feature vectors"):
        kernel_inception_distance(x[:1], y)
    with pytest.raises(InvalidValueError, match="subset_size must be an int >= 2"):
        kernel_inception_distance(x, y, subset_size=1)


# -- streaming statistics ------------------------------------------------------------------------------
def test_streaming_equals_batch_statistics() -> None:
    rng = np.random.default_rng(9)
    data = sample(rng, 1000, 20, 3.0, 5.0)
    streamed = FeatureStatistics()
    start = 0
    while start < len(data):
        step = int(rng.integers(0, 17))  # empty batches too
        streamed.update(data[start : start + step])
        start += step
    halves = FeatureStatistics().update(data[:377]).merge(FeatureStatistics().update(torch.from_numpy(data[377:])))
    for stats in (streamed, halves):
        assert stats.count == 1000 and stats.dim == 20
        np.testing.assert_allclose(stats.mean.numpy(), data.mean(0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(stats.covariance.numpy(), np.cov(data, rowvar=False), rtol=1e-10, atol=1e-12)
        assert torch.equal(stats.covariance, stats.covariance.T)


def test_float32_features_accumulate_in_float64() -> None:
    """A large common offset: float32 sums of x and x² would lose the variance; centered float64 updates do not."""
    rng = np.random.default_rng(10)
    data = (rng.normal(size=(4000, 8)) + 1e4).astype(np.float32)
    stats = FeatureStatistics()
    for batch in np.array_split(data, 50):
        stats.update(torch.from_numpy(batch))
    assert stats.mean.dtype == stats.covariance.dtype == torch.float64
    exact = data.astype(np.float64)
    np.testing.assert_allclose(stats.mean.numpy(), exact.mean(0), rtol=1e-10)
    np.testing.assert_allclose(stats.covariance.numpy(), np.cov(exact, rowvar=False), rtol=1e-10, atol=1e-10)


def test_statistics_refuse_bad_batches() -> None:
    stats = FeatureStatistics().update(np.zeros((3, 4)))
    with pytest.raises(InvalidValueError, match="5 features per vector, but these statistics have 4"):
        stats.update(np.zeros((2, 5)))
    with pytest.raises(InvalidValueError, match=r"must be \(N, D\)"):
        stats.update(np.zeros(4))
    with pytest.raises(InvalidValueError, match="NaN or infinite"):
        stats.update(torch.tensor([[0.0, float("inf"), 0.0, 0.0]]))
    assert stats.count == 3
    with pytest.raises(InvalidValueError, match="at least 2 feature vectors, got 1"):
        _ = FeatureStatistics().update(np.ones((1, 4))).covariance
    with pytest.raises(InvalidValueError, match="no feature vectors yet"):
        _ = FeatureStatistics(4).mean


def test_reservoir_keeps_a_uniform_seeded_sample() -> None:
    data = np.arange(20, dtype=np.float32)[:, None].repeat(3, axis=1)
    times_kept = np.zeros(20)
    for seed in range(400):
        stats = FeatureStatistics(keep=5, seed=seed)
        for batch in np.array_split(data, 6):
            stats.update(batch)
        kept = stats.features.numpy()[:, 0].astype(int)
        assert len(set(kept)) == 5
        times_kept[kept] += 1
    assert times_kept.min() > 60 and times_kept.max() < 140  # 100 expected for each row
    again = FeatureStatistics(keep=5, seed=3).update(data[:7]).update(data[7:])
    assert torch.equal(again.features, FeatureStatistics(keep=5, seed=3).update(data[:7]).update(data[7:]).features)
    assert FeatureStatistics(keep=50).update(data).features.shape == (20, 3)  # fewer vectors than keep: all


def test_merged_reservoirs_sample_the_union() -> None:
    data = np.arange(100, dtype=np.float32)[:, None]
    from_first = []
    for seed in range(200):
        first = FeatureStatistics(keep=10, seed=seed).update(data[:80])
        merged = first.merge(FeatureStatistics(keep=20, seed=seed + 1000).update(data[80:]))
        kept = merged.features.numpy()[:, 0]
        assert merged.keep == 10 and len(set(kept)) == 10 and set(kept) <= set(range(100))
        from_first.append((kept < 80).sum())
    assert np.mean(from_first) == pytest.approx(8.0, abs=0.5)  # 80 of the 100 vectors came from the first


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    origin = FeatureOrigin("resnet18", "layer4", "avg", "IMAGENET1K_V1", "ab" * 32, {"crop_size": 224})
    stats = FeatureStatistics(keep=16, seed=5, origin=origin).update(sample(rng, 50, 6))
    path = stats.save(tmp_path / "ref.npz")
    with np.load(path, allow_pickle=False) as data:  # pytorch-fid reads mu and sigma
        np.testing.assert_array_equal(data["mu"], stats.mean.numpy())
        np.testing.assert_array_equal(data["sigma"], stats.covariance.numpy())
    loaded = FeatureStatistics.load(path)
    assert (loaded.count, loaded.dim, loaded.keep, loaded.origin) == (50, 6, 16, origin)
    np.testing.assert_array_equal(loaded.mean.numpy(), stats.mean.numpy())
    np.testing.assert_allclose(loaded.covariance.numpy(), stats.covariance.numpy(), rtol=1e-15)
    assert torch.equal(loaded.features, stats.features)
    more = sample(rng, 30, 6)  # the generator's state travels too: loading does not change what is kept next
    assert torch.equal(loaded.update(more).features, stats.update(more).features)


def test_statistics_of_other_features_refuse_to_be_compared(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    reference = FeatureStatistics(origin=FeatureOrigin("resnet18", "layer4", "avg", "IMAGENET1K_V1"))
    reference.update(sample(rng, 40, 6)).save(tmp_path / "ref.npz")
    other = FeatureStatistics(origin=FeatureOrigin("resnet18", "layer3", "max", "IMAGENET1K_V1"))
    other.update(sample(rng, 40, 6))
    loaded = FeatureStatistics.load(tmp_path / "ref.npz")
    with pytest.raises(InvalidValueError, match="layer 'layer4' vs 'layer3'; pool 'avg' vs 'max'"):
        frechet_distance(loaded, other)
    with pytest.raises(InvalidValueError, match="different features"):
        loaded.merge(other)
    anonymous = FeatureStatistics().update(sample(rng, 40, 6))  # raw features: origin unknown, compared freely
    assert frechet_distance(loaded, anonymous) > 0
    same = FeatureStatistics(origin=FeatureOrigin("resnet18", "layer4", "avg", "IMAGENET1K_V1", "cd" * 32))
    with pytest.warns(UserWarning, match="of different bytes"):
        frechet_distance(
            FeatureStatistics(origin=FeatureOrigin("resnet18", "layer4", "avg", "IMAGENET1K_V1", "ab" * 32)).update(
                sample(rng, 40, 6)
            ),
            same.update(sample(rng, 40, 6)),
        )


def test_statistics_of_another_precision_warn_naming_it(tmp_path: Path) -> None:
    """bf16 and float32 statistics of the same backbone: comparable, with one warning that says why they differ
    (not the digest's "different bytes"); the precision survives save and load, and files without it are unknown."""
    rng = np.random.default_rng(13)
    origins = {p: FeatureOrigin("vgg16", "relu3_3", "avg", None, p * 32) for p in ("ab", "cd")}
    bf16 = FeatureStatistics(origin=FeatureOrigin("vgg16", "relu3_3", "avg", None, "ab" * 32, None, "bf16"))
    float32 = FeatureStatistics(origin=FeatureOrigin("vgg16", "relu3_3", "avg", None, "cd" * 32, None, "float32"))
    bf16.update(sample(rng, 40, 6)).save(tmp_path / "bf16.npz")
    float32.update(sample(rng, 40, 6)).save(tmp_path / "float32.npz")
    for name, expected in (("bf16", {"precision": "bf16"}), ("float32", {})):  # float32: files earlier versions read
        origin = json.loads(str(np.load(tmp_path / f"{name}.npz")["meta"]))["origin"]
        assert {key: origin[key] for key in origin if key == "precision"} == expected
    loaded = FeatureStatistics.load(tmp_path / "bf16.npz")
    assert loaded.origin == bf16.origin and loaded.origin is not None and loaded.origin.precision == "bf16"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert frechet_distance(loaded, float32) > 0
    assert [str(w.message) for w in caught if "precision" in str(w.message) or "bytes" in str(w.message)] == [
        "the two statistics were computed in precision 'bf16' and 'float32': their features differ by the rounding "
        "of the lower precision (docs/performance.md#precision)"
    ]
    with pytest.warns(UserWarning, match="precision 'bf16' and 'float32'"):
        mixed = FeatureStatistics.load(tmp_path / "bf16.npz").merge(float32)
    assert mixed.origin is not None and (mixed.origin.precision, mixed.origin.weights_sha256) == (None, None)
    unknown = FeatureStatistics(origin=origins["ab"]).update(sample(rng, 40, 6))  # the digest decides
    with pytest.warns(UserWarning, match="of different bytes"):
        frechet_distance(unknown, FeatureStatistics(origin=origins["cd"]).update(sample(rng, 40, 6)))


def test_load_refuses_pickles_and_foreign_files(tmp_path: Path) -> None:
    pickled = tmp_path / "stats.pkl"
    pickled.write_bytes(pickle.dumps({"mu": np.zeros(3), "sigma": np.eye(3)}))
    with pytest.raises(InvalidValueError, match="not a featurehooks statistics file"):
        FeatureStatistics.load(pickled)
    with_objects = tmp_path / "objects.npz"
    np.savez(
        with_objects, mu=np.zeros(3), sigma=np.eye(3), features=np.zeros((0, 3)), meta=np.array([{}], dtype=object)
    )
    with pytest.raises(InvalidValueError, match="not a featurehooks statistics file"):
        FeatureStatistics.load(with_objects)
    pytorch_fid_file = tmp_path / "fid.npz"
    np.savez(pytorch_fid_file, mu=np.zeros(3), sigma=np.eye(3))
    with pytest.raises(InvalidValueError, match="no features, meta arrays"):
        FeatureStatistics.load(pytorch_fid_file)
    newer = tmp_path / "newer.npz"
    FeatureStatistics().update(np.eye(3)).save(newer)
    with np.load(newer) as data:
        arrays = dict(data)
    arrays["meta"] = np.array(str(arrays["meta"]).replace("statistics/1", "statistics/2"))
    np.savez(newer, **arrays)
    with pytest.raises(InvalidValueError, match="format 'featurehooks.statistics/2'"):
        FeatureStatistics.load(newer)
    with pytest.raises(FileNotFoundError):
        FeatureStatistics.load(tmp_path / "missing.npz")


# -- from images and dumps -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet() -> FeatureExtractor:
    torch.manual_seed(0)
    return FeatureExtractor("resnet18", ["layer3", "layer4"], weights=None)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Nine small PNGs of varying sizes (one in a subfolder) and one file that is not an image."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(13)
    for i in range(9):
        sub = root / ("nested" if i == 4 else "")
        sub.mkdir(exist_ok=True)
        pixels = rng.integers(0, 256, (70 + 3 * i, 90 - 2 * i, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(sub / f"img_{i}.png")
    (root / "broken.png").write_bytes(b"not a png")
    return root


def pooled_by_hand(ext: FeatureExtractor, paths: list[Path], layer: str) -> np.ndarray:
    transform = transform_for(ext.preprocessing, ext.input_range, RESIZE, CROP)
    with torch.no_grad():
        feature = ext(torch.stack([transform(read_image(p)) for p in paths]))[layer]
    return pool_positions(feature, ext.output_layouts[layer], "avg", layer).double().numpy()


def test_feature_statistics_equal_hand_pooled_features_and_a_dump(
    resnet: FeatureExtractor, folder: Path, tmp_path: Path
) -> None:
    options = {"batch_size": 4, "num_workers": 0, "resize_size": RESIZE, "crop_size": CROP}
    with pytest.warns(UserWarning, match=r"1 of 10 inputs could not be read .*broken.png"):
        stats = feature_statistics(resnet, folder, layer="layer4", keep=5, **options)
    images = sorted(p for p in folder.rglob("img_*.png"))
    by_hand = pooled_by_hand(resnet, images, "layer4")
    assert (stats.count, stats.dim) == (9, 512)
    np.testing.assert_allclose(stats.mean.numpy(), by_hand.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.covariance.numpy(), np.cov(by_hand, rowvar=False), rtol=1e-4, atol=1e-7)
    assert stats.origin is not None
    assert (stats.origin.backbone, stats.origin.layer, stats.origin.pool, stats.origin.weights) == (
        "resnet18",
        "layer4",
        "avg",
        None,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = dump_features(resnet, folder, tmp_path / "dump", pool="avg", progress=False, **options)
    assert [entry["row"] for entry in result.skipped] == [0]  # broken.png sorts first
    for dumped in (statistics_from_dump(result, "layer4", keep=5), statistics_from_dump(tmp_path / "dump", "layer4")):
        assert dumped.count == 9 and dumped.origin == stats.origin
        np.testing.assert_allclose(dumped.mean.numpy(), stats.mean.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(dumped.covariance.numpy(), stats.covariance.numpy(), rtol=1e-10, atol=1e-12)
    assert frechet_distance(stats, statistics_from_dump(result, "layer4")) < 1e-9
    kept = stats.features.double().numpy()
    assert all(np.isclose(by_hand, row, rtol=1e-4, atol=1e-6).all(axis=1).any() for row in kept)


def test_several_layers_in_one_pass_and_clear_errors(resnet: FeatureExtractor, folder: Path, tmp_path: Path) -> None:
    images = sorted(p for p in folder.rglob("img_*.png"))[:3]
    options = {"batch_size": 2, "num_workers": 0, "resize_size": RESIZE, "crop_size": CROP}
    both = feature_statistics_by_layer(resnet, images, **options)
    assert list(both) == ["layer3", "layer4"] and both["layer3"].dim == 256 and both["layer3"].count == 3
    np.testing.assert_allclose(
        both["layer3"].mean.numpy(), pooled_by_hand(resnet, images, "layer3").mean(0), rtol=1e-5, atol=1e-6
    )
    prepared = torch.stack(
        [transform_for(resnet.preprocessing, (0.0, 1.0), RESIZE, CROP)(read_image(p)) for p in images]
    )
    from_tensor = feature_statistics(resnet, prepared, layer="layer4", batch_size=2, num_workers=0)
    np.testing.assert_allclose(from_tensor.mean.numpy(), both["layer4"].mean.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidValueError, match="returns 2 outputs"):
        feature_statistics(resnet, images, **options)
    with pytest.raises(LayerNotFoundError, match="did you mean 'layer4'"):
        feature_statistics(resnet, images, layer="layer5", **options)
    with pytest.raises(InvalidValueError, match="not vectors; pool them"):
        feature_statistics(resnet, images, layer="layer4", pool=None, **options)
    result = dump_features(resnet, images, tmp_path / "maps", progress=False, **options)
    with pytest.raises(InvalidValueError, match="not vectors; dump it with pool='avg'"):
        statistics_from_dump(result, "layer4")
    with pytest.raises(LayerNotFoundError, match="no layer 'layer9'"):
        statistics_from_dump(result, "layer9")
    with pytest.raises(FileNotFoundError, match="no featurehooks dump"):
        statistics_from_dump(tmp_path, "layer4")


def test_a_covariance_that_is_not_positive_semi_definite_is_refused() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4))
    mean, cov = x.mean(0), np.cov(x, rowvar=False)
    with pytest.raises(InvalidValueError, match="not positive semi-definite"):
        frechet_distance((mean, -cov), x)
    assert frechet_distance((mean, cov), x) == pytest.approx(0.0, abs=1e-9)


def test_statistics_of_one_image_and_of_another_backbone_name_the_problem() -> None:
    one = FeatureStatistics().update(np.ones((1, 3)))
    with pytest.raises(InvalidValueError, match="b holds 1 feature vector"):
        frechet_distance(np.random.default_rng(0).normal(size=(5, 3)), one)
    a = FeatureStatistics(origin=FeatureOrigin("resnet18", "layer4", "avg", None)).update(np.ones((2, 512)))
    b = FeatureStatistics(origin=FeatureOrigin("resnet50", "layer4", "avg", None)).update(np.ones((2, 2048)))
    with pytest.raises(InvalidValueError, match="'resnet18' vs 'resnet50'"):
        frechet_distance(a, b)
