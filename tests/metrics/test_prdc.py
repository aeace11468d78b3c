"""Precision, recall, density and coverage against the ``prdc`` package (Naeem et al.'s reference code).

Oracle: ``prdc.compute_prdc`` and ``prdc.compute_nearest_neighbour_distances`` (scikit-learn's euclidean
distances) on the same vectors, float32 and float64; blocks of any size give the same numbers; a saved
manifold gives the same numbers as the vectors it was built from; no block is ``N x N``.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from featurehooks import InputNotFoundError, InvalidTypeError, InvalidValueError
from featurehooks.metrics import PRDC, FeatureOrigin, FeatureStatistics, Manifold, precision_recall
from featurehooks.metrics import prdc as ours

# sets this small warn on purpose; the warning has a test of its own
pytestmark = pytest.mark.filterwarnings("ignore:(real|fake) holds .* feature vectors:UserWarning")


def sets(real: int = 300, fake: int = 260, dim: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Correlated Gaussian features; the generated set narrower and shifted, with a few real vectors copied in
    (distances of exactly 0, ties that the comparisons must treat as prdc does)."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    a = rng.normal(size=(real, dim)) @ mixing
    b = 0.7 * rng.normal(size=(fake, dim)) @ mixing + 0.3
    b[:5] = a[:5]
    return a, b


def oracle(real: np.ndarray, fake: np.ndarray, k: int) -> dict[str, float]:
    import prdc  # 2 s with scikit-learn: imported by the tests that use it, not when the suite is collected

    with contextlib.redirect_stdout(io.StringIO()):  # it prints the set sizes
        return {name: float(value) for name, value in prdc.compute_prdc(real, fake, nearest_k=k).items()}


# -- equal to prdc -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_equals_prdc(dtype: type, k: int) -> None:
    real, fake = (x.astype(dtype) for x in sets())
    result = precision_recall(real, fake, k=k)
    expected = oracle(real, fake, k)
    assert isinstance(result, PRDC)
    assert result._asdict() == pytest.approx(expected, abs=1e-6, rel=0)
    assert 0 < result.precision < 1 and 0 < result.recall < 1  # not a degenerate case


def test_equals_prdc_on_tensors_and_features_far_from_the_origin() -> None:
    """A large common offset: |x|² - 2x·y + |y|² cancels, in float32 distances too, exactly as prdc's does."""
    real, fake = (x.astype(np.float32) + 40 for x in sets(seed=1))
    result = precision_recall(torch.from_numpy(real), torch.from_numpy(fake), k=4)
    assert result._asdict() == pytest.approx(oracle(real, fake, 4), abs=1e-6, rel=0)


def test_radii_equal_prdc() -> None:
    from prdc.prdc import compute_nearest_neighbour_distances

    real, _ = sets()
    single = real.astype(np.float32)  # distances rounded to float32 as scikit-learn's: the same floats
    np.testing.assert_array_equal(
        Manifold.from_features(single, k=5).radii.numpy(), compute_nearest_neighbour_distances(single, 5)
    )
    double = Manifold.from_features(real, k=5).radii.numpy()  # float64: products summed in another order
    np.testing.assert_allclose(double, compute_nearest_neighbour_distances(real, 5), rtol=1e-14, atol=0)


def test_identical_sets() -> None:
    real, _ = sets()
    assert precision_recall(real, real.copy(), k=3)._asdict() == pytest.approx(oracle(real, real.copy(), 3), abs=1e-6)
    assert precision_recall(real, real.copy(), k=3)[:2] == (1.0, 1.0)


SCALES = [1e-38, 1e-30, 1e-23, 1e-20, 1e-12, 1.0, 1e12, 1e19, 1e20, 1e30, 1e38]


@pytest.mark.parametrize("scale", SCALES)
def test_float32_features_at_either_end_of_the_range_equal_float64s(scale: float) -> None:
    """Squared distances that float32 cannot hold (overflow from about 1e19, underflow below about 1e-19) are
    taken in float64: before, features of 1e20 failed on radii the user never passed, and those of 1e-23 gave 0."""
    real, fake = sets(real=150, fake=120, dim=8)
    top = max(np.abs(real).max(), np.abs(fake).max())
    single = [(x / top * scale).astype(np.float32) for x in (real, fake)]
    assert all(np.isfinite(x).all() and np.abs(x).max() > 0 for x in single)
    expected = oracle(*(x.astype(np.float64) for x in single), 3)
    result = precision_recall(*single, k=3)
    assert result._asdict() == pytest.approx(expected, abs=1e-12, rel=0)
    assert result.precision > 0.3 and result.recall > 0.3  # not the zeros of underflowed distances
    manifold = Manifold.from_features(single[0], k=3)
    unrounded = scale <= 1e-20 or scale >= 1e20  # squared radii outside float32's normal range
    assert manifold.features.dtype == (torch.float64 if unrounded else torch.float32)
    assert precision_recall(manifold, single[1]) == result


def test_float32_features_in_range_keep_the_float32_distances_of_prdc() -> None:
    """Coordinates below 2**-40 in a set of ordinary norms: still float32 distances (equal to prdc on float32)."""
    real, fake = (x.astype(np.float32) for x in sets(seed=2))
    real[:, 0], fake[:, 0] = 1e-30, -3e-25  # tiny coordinates (a GELU's output far below 0)
    assert precision_recall(real, fake, k=3)._asdict() == pytest.approx(oracle(real, fake, 3), abs=1e-6, rel=0)
    assert Manifold.from_features(real, k=3).radii.dtype == torch.float32


def test_float64_features_beyond_its_range_are_a_clear_error() -> None:
    real, fake = sets(real=20, fake=20)
    with pytest.raises(InvalidValueError, match="real: the squared distances between these features overflow"):
        precision_recall(real * 1e200, fake * 1e200, k=3)


# -- streaming -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_blocks_of_any_size_agree(chunk_size: int) -> None:
    real, fake = sets(real=120, fake=90)
    assert precision_recall(real, fake, k=3, chunk_size=chunk_size) == precision_recall(real, fake, k=3)


def test_no_block_is_n_by_n(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes: list[tuple[int, ...]] = []
    original = ours._Side.squared_distances

    def recorded(self: ours._Side, start: int, stop: int, other: ours._Side) -> torch.Tensor:
        block = original(self, start, stop, other)
        shapes.append(tuple(block.shape))
        return block

    monkeypatch.setattr(ours._Side, "squared_distances", recorded)
    monkeypatch.setattr(ours, "BLOCK", 4000)  # the default blocks, scaled down to these sets
    real, fake = sets(real=200, fake=100)
    precision_recall(real, fake, k=3)
    assert shapes and max(rows * columns for rows, columns in shapes) <= 4000
    assert {columns for _, columns in shapes} == {200, 100}  # real/real, fake/fake and real/fake blocks
    shapes.clear()
    precision_recall(real, fake, k=3, chunk_size=8)
    assert max(rows for rows, _ in shapes) == 8


def test_a_manifold_is_reused_and_saved(tmp_path: Path) -> None:
    real, fake = sets()
    expected = precision_recall(real, fake, k=5)
    manifold = Manifold.from_features(real.astype(np.float32), k=5)
    path = manifold.save(tmp_path / "real.manifold.npz")
    loaded = Manifold.load(path)
    assert loaded.k == 5 and loaded.features.dtype == torch.float32 and torch.equal(loaded.radii, manifold.radii)
    float32 = precision_recall(real.astype(np.float32), fake.astype(np.float32), k=5)
    assert precision_recall(loaded, fake.astype(np.float32)) == float32  # k from the manifold
    assert precision_recall(Manifold.from_features(real, k=5), fake) == expected
    assert repr(loaded) == "Manifold(count=300, dim=12, k=5, dtype=float32)"


def test_feature_statistics_take_part_with_their_kept_vectors(tmp_path: Path) -> None:
    real, fake = sets()
    origin = FeatureOrigin("resnet18", "layer4", "avg", None)
    stats = [FeatureStatistics(keep=1000, origin=origin).update(x) for x in (real, fake)]
    expected = oracle(stats[0].features.numpy(), stats[1].features.numpy(), 5)
    assert precision_recall(*stats, k=5)._asdict() == pytest.approx(expected, abs=1e-6, rel=0)
    manifold = Manifold.from_features(stats[0], k=5)
    assert manifold.origin == origin
    assert Manifold.load(manifold.save(tmp_path / "m.npz")).origin == origin
    other = FeatureStatistics(keep=1000, origin=FeatureOrigin("resnet18", "layer3", "avg", None)).update(fake)
    with pytest.raises(InvalidValueError, match="different features .*layer 'layer4' vs 'layer3'"):
        precision_recall(manifold, other)


# -- refusals and warnings -----------------------------------------------------------------------------
def test_statistics_that_kept_no_vectors_are_refused() -> None:
    real, fake = sets()
    with pytest.raises(
        InvalidValueError, match=r"real: these statistics kept no feature vectors \(keep=0\).*compute them with keep=N"
    ):
        precision_recall(FeatureStatistics().update(real), fake)


@pytest.mark.parametrize("k", [0, -1, 2.5, True, "5"])
def test_bad_k(k: object) -> None:
    real, fake = sets(real=20, fake=20)
    with pytest.raises(InvalidValueError, match="k must be an int >= 1"):
        precision_recall(real, fake, k=k)  # type: ignore[arg-type]


def test_k_needs_more_vectors_and_names_the_minimum() -> None:
    real, fake = sets(real=5, fake=40)
    with pytest.raises(InvalidValueError, match=r"real holds 5 feature vectors.*k=5 needs at least k \+ 1 = 6"):
        precision_recall(real, fake, k=5)
    with pytest.raises(InvalidValueError, match=r"fake holds 5 feature vectors.*at least k \+ 1 = 6"):
        precision_recall(fake, real, k=5)
    assert precision_recall(real, fake, k=4).precision >= 0  # k + 1 vectors are enough


def test_mismatches_are_refused() -> None:
    real, fake = sets(real=30, fake=30)
    with pytest.raises(InvalidValueError, match="real has 12 features per vector and fake 11"):
        precision_recall(real, fake[:, :11], k=3)
    with pytest.raises(InvalidValueError, match="real is a manifold of k=3 nearest neighbours, but k=5 was asked"):
        precision_recall(Manifold.from_features(real, k=3), fake, k=5)
    with pytest.raises(InvalidValueError, match="NaN or infinite values in 1 of 30"):
        precision_recall(real, np.where(np.arange(30)[:, None] == 3, np.nan, fake), k=3)
    with pytest.raises(InvalidValueError, match=r"must be \(N, D\) feature vectors, got shape \(30,\)"):
        precision_recall(real, fake[:, 0], k=3)
    with pytest.raises(InvalidTypeError, match="not list"):
        precision_recall(real, fake.tolist(), k=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="chunk_size must be an int >= 1"):
        precision_recall(real, fake, k=3, chunk_size=0)


def test_small_sets_warn_and_name_the_minimum() -> None:
    real, fake = sets(real=200, fake=150)
    with pytest.warns(UserWarning, match="fake holds 150 feature vectors: .* fewer than 1,000") as caught:
        precision_recall(real, fake, k=3)
    assert caught[0].filename == __file__  # it points at the caller
    big = np.random.default_rng(0).normal(size=(1000, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        precision_recall(big, big + 0.1, k=3)


def test_the_callers_features_are_not_changed() -> None:
    real, fake = (torch.from_numpy(x.astype(np.float32)) for x in sets(real=40, fake=40))
    before = real.clone(), fake.clone()
    manifold = Manifold.from_features(real, k=3)
    manifold.features.add_(1)  # the manifold holds its own copy
    precision_recall(real, fake, k=3)
    assert torch.equal(real, before[0]) and torch.equal(fake, before[1])


def test_load_refuses_what_is_no_manifold(tmp_path: Path) -> None:
    with pytest.raises(InputNotFoundError, match="no featurehooks manifold file"):
        Manifold.load(tmp_path / "missing.npz")
    stats = FeatureStatistics(keep=10).update(np.ones((4, 3)))
    with pytest.raises(InvalidValueError, match="is not a featurehooks manifold file: it holds"):
        Manifold.load(stats.save(tmp_path / "stats.npz"))  # statistics are not a manifold
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, features=np.zeros((4, 2)), radii=np.zeros(4), meta=np.array([{"k": 1}], dtype=object))
    with pytest.raises(InvalidValueError, match="is not a featurehooks manifold file"):
        Manifold.load(pickled)
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(InvalidValueError, match="is not a featurehooks manifold file"):
        Manifold.load(tmp_path / "text.npz")
    manifold = Manifold.from_features(np.arange(12.0).reshape(6, 2), k=2)
    broken = tmp_path / "broken.npz"
    np.savez(
        broken,
        features=manifold.features.numpy(),
        radii=manifold.radii.numpy()[:5],
        meta=np.array('{"format": "featurehooks.manifold/1", "k": 2, "origin": null}'),
    )
    with pytest.raises(InvalidValueError, match=r"radii of shape \(5,\): expected \(N, D\) and \(N,\)"):
        Manifold.load(broken)
