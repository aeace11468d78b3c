"""CKA (``featurehooks.metrics.cka``) against the formulas of its papers, written here in float64 numpy: Kornblith et
al. 2019 (linear and RBF kernels, the biased HSIC), Song et al. 2012's unbiased HSIC, and Nguyen, Raghu, Kornblith
2021's minibatch estimator; its invariances; the streaming memory; rows matched by id between dumps; the command."""

from __future__ import annotations

import re
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks import FeatureExtractor, dump_features
from featurehooks.cli import main
from featurehooks.errors import InvalidValueError, LayerNotFoundError
from featurehooks.metrics import MinibatchCKA, cka, cka_matrix, cka_matrix_from_dumps
from featurehooks.metrics.cka import Kernel

from helpers import tiny_extractor

TOLERANCE = 1e-6


# -- the formulas, as the papers write them ---------------------------------------------------------------------
def linear_gram(x: np.ndarray) -> np.ndarray:
    return x @ x.T


def rbf_gram(x: np.ndarray, threshold: float) -> np.ndarray:
    """Kornblith et al.'s RBF kernel: bandwidth ``threshold`` times the median distance of all pairs (diagonal too)."""
    squared = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=-1)
    return np.exp(-squared / (2 * threshold**2 * np.median(squared)))


def biased_hsic(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741 - the papers' names
    """tr(K H L H) / (n - 1)² (Kornblith et al. 2019), H the centering matrix."""
    n = len(k)
    h = np.eye(n) - np.ones((n, n)) / n
    return float(np.trace(k @ h @ l @ h)) / (n - 1) ** 2


def unbiased_hsic(k: np.ndarray, l: np.ndarray) -> float:  # noqa: E741
    """HSIC_1 (Song et al. 2012, as Nguyen et al. 2021 write it): K, L with zero diagonals."""
    n = len(k)
    k, l = k - np.diag(np.diag(k)), l - np.diag(np.diag(l))  # noqa: E741
    one = np.ones(n)
    value = (
        np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2)) - 2 / (n - 2) * (one @ k @ l @ one)
    )
    return float(value) / (n * (n - 3))


def reference_cka(k: np.ndarray, l: np.ndarray, hsic: Callable[[np.ndarray, np.ndarray], float]) -> float:  # noqa: E741
    return hsic(k, l) / np.sqrt(hsic(k, k) * hsic(l, l))


def reference_minibatch_cka(x: np.ndarray, y: np.ndarray, minibatches: list[slice]) -> float:
    """Nguyen et al. 2021: the unbiased HSIC of the linear kernels summed over minibatches, normalized."""
    cross = sum(unbiased_hsic(linear_gram(x[rows]), linear_gram(y[rows])) for rows in minibatches)
    self_x = sum(unbiased_hsic(linear_gram(x[rows]), linear_gram(x[rows])) for rows in minibatches)
    self_y = sum(unbiased_hsic(linear_gram(y[rows]), linear_gram(y[rows])) for rows in minibatches)
    return cross / np.sqrt(self_x * self_y)


def related(n: int, widths: tuple[int, int], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two representations of ``n`` rows that share part of their signal."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, widths[0]))
    y = np.tanh(x @ rng.normal(size=(widths[0], widths[1]))) + 0.5 * rng.normal(size=(n, widths[1]))
    return x, y


# -- cka: one pair of matrices in memory ------------------------------------------------------------------------
@pytest.mark.parametrize("n, widths", [(60, (8, 5)), (12, (30, 50))], ids=["features-fewer-than-rows", "more"])
def test_linear_cka_equals_kornblith(n: int, widths: tuple[int, int]) -> None:
    x, y = related(n, widths)
    expected = reference_cka(linear_gram(x), linear_gram(y), biased_hsic)
    assert abs(cka(x, y) - expected) < TOLERANCE
    assert 0.1 < expected < 0.99  # a pair that could fail
    maps = torch.from_numpy(y).float().reshape(n, widths[1], 1, 1)  # maps of a tensor, flattened per row
    assert abs(cka(torch.from_numpy(x), maps) - expected) < TOLERANCE


@pytest.mark.parametrize("sigma", [0.2, 0.5, 1.0])
def test_rbf_cka_equals_kornblith(sigma: float) -> None:
    x, y = related(40, (6, 9), seed=1)
    expected = reference_cka(rbf_gram(x, sigma), rbf_gram(y, sigma), biased_hsic)
    assert abs(cka(x, y, kernel="rbf", sigma=sigma) - expected) < TOLERANCE
    assert abs(cka(x, y, kernel="rbf", sigma=sigma) - cka(x, y)) > 1e-3  # not the linear number


@pytest.mark.parametrize("kernel", ["linear", "rbf"])
def test_unbiased_cka_equals_song(kernel: Kernel) -> None:
    x, y = related(30, (7, 4), seed=2)
    gram = linear_gram if kernel == "linear" else lambda z: rbf_gram(z, 0.8)
    expected = reference_cka(gram(x), gram(y), unbiased_hsic)
    assert abs(cka(x, y, kernel=kernel, sigma=0.8, unbiased=True) - expected) < TOLERANCE


@pytest.mark.parametrize("kernel", ["linear", "rbf"])
def test_cka_is_invariant_to_rotations_and_scale(kernel: Kernel) -> None:
    x, y = related(50, (10, 6), seed=3)
    rotation, _ = np.linalg.qr(np.random.default_rng(4).normal(size=(10, 10)))
    for unbiased in (False, True):
        before = cka(x, y, kernel=kernel, unbiased=unbiased)
        after = cka(7.5 * x @ rotation, y, kernel=kernel, unbiased=unbiased)
        assert abs(before - after) < 1e-9
        assert abs(cka(x, x, kernel=kernel, unbiased=unbiased) - 1) < 1e-12
    assert abs(cka(x, x @ np.diag(np.arange(1.0, 11.0)), kernel=kernel) - 1) > 1e-3  # not any invertible map


def test_cka_refuses_what_it_cannot_compare() -> None:
    x = np.zeros((10, 3))
    with pytest.raises(InvalidValueError, match="10 rows, b 9"):
        cka(x, x[:9])
    with pytest.raises(InvalidValueError, match="did you mean 'rbf'"):
        cka(x, x, kernel="rbg")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="sigma must be a positive"):
        cka(x, x, kernel="rbf", sigma=0)
    with pytest.raises(InvalidValueError, match="NaN or infinite"):
        cka(x, np.full((10, 2), np.nan))
    assert np.isnan(cka(x, np.random.default_rng(0).normal(size=(10, 2))))  # a constant representation


# -- MinibatchCKA: the streaming estimator ----------------------------------------------------------------------
@pytest.mark.parametrize("count", [96, 98, 103], ids=["whole-minibatches", "2-left-joins-the-last", "7-left"])
def test_minibatch_cka_equals_nguyen(count: int) -> None:
    size = 32
    xs = related(count, (12, 5), seed=5)
    ys = related(count, (12, 20), seed=6)
    layers_a = {"x0": xs[0], "x1": xs[1]}
    layers_b = {"y0": ys[0].astype(np.float32), "y1": ys[1], "x1": xs[1]}  # float32 arrays and tensors are taken too
    accumulator = MinibatchCKA(list(layers_a), list(layers_b), minibatch_size=size)
    cuts = [0, 7, 20, 21, 60, 77, count]  # batches of any size: the estimator cuts its own minibatches
    for start, stop in zip(cuts, cuts[1:]):
        accumulator.update(
            {name: torch.from_numpy(value[start:stop]) for name, value in layers_a.items()},
            {name: value[start:stop] for name, value in layers_b.items()},
        )
    whole, left = divmod(count, size)
    starts = list(range(0, whole * size, size))
    minibatches = [slice(start, start + size) for start in starts]
    if left >= 4:
        minibatches.append(slice(whole * size, count))
    else:  # fewer than 4 left over join the last minibatch
        minibatches[-1] = slice(starts[-1], count)
    matrix = accumulator.compute()
    assert matrix.count == count and matrix.values.shape == (2, 3)
    for i, a in enumerate(layers_a.values()):
        for j, b in enumerate(layers_b.values()):
            expected = reference_minibatch_cka(a, b.astype(np.float64), minibatches)
            assert abs(matrix.values[i, j] - expected) < TOLERANCE
    assert abs(matrix.value("x1", "x1") - 1) < 1e-12


def test_minibatch_cka_is_invariant_to_rotations_and_scale() -> None:
    x, y = related(80, (9, 4), seed=7)
    rotation, _ = np.linalg.qr(np.random.default_rng(8).normal(size=(9, 9)))
    values = []
    for a in (x, 0.1 * x @ rotation):
        accumulator = MinibatchCKA(["a"], ["b"], minibatch_size=16)
        accumulator.update({"a": a}, {"b": y})
        values.append(accumulator.compute().value("a", "b"))
    assert abs(values[0] - values[1]) < 1e-9 and 0.1 < values[0] < 0.99


def _peak_bytes(rows: int, width: int = 256, batch: int = 64) -> int:
    """The peak of memory traced while ``rows`` rows of two layers each side stream through a ``MinibatchCKA``."""
    accumulator = MinibatchCKA(["a", "b"], ["c", "d"], minibatch_size=128)
    rng = np.random.default_rng(0)
    tracemalloc.start()
    try:
        for _ in range(rows // batch):
            features = {name: rng.normal(size=(batch, width)) for name in "abcd"}
            accumulator.update({"a": features["a"], "b": features["b"]}, {"c": features["c"], "d": features["d"]})
            del features
        accumulator.compute()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_minibatch_memory_does_not_grow_with_the_images() -> None:
    few, many = _peak_bytes(640), _peak_bytes(6400)
    assert few > 1_000_000  # it measured the features and the kernel matrices
    assert many < 1.1 * few, (few, many)


def test_minibatch_refuses_batches_of_other_images() -> None:
    accumulator = MinibatchCKA(["a"], ["b"], minibatch_size=4)
    features = np.random.default_rng(0).normal(size=(3, 2))
    with pytest.raises(InvalidValueError, match=r"row 1: 'y.png' in A, 'z.png' in B"):
        accumulator.update(
            {"a": features}, {"b": features}, ids_a=["x.png", "y.png", "w"], ids_b=["x.png", "z.png", "w"]
        )
    with pytest.raises(InvalidValueError, match="same images in every layer"):
        accumulator.update({"a": features}, {"b": features[:2]})
    with pytest.raises(LayerNotFoundError, match="no layer 'b'; did you mean 'bb'"):
        accumulator.update({"a": features}, {"bb": features})
    accumulator.update({"a": features}, {"b": features}, ids_a=["1", "2", "3"], ids_b=["1", "2", "3"])
    with pytest.raises(InvalidValueError, match="at least 4 images, got 3"):
        accumulator.compute()


# -- two extractors over one stream, and their dumps ------------------------------------------------------------
def _extractors() -> tuple[FeatureExtractor, FeatureExtractor]:
    a = tiny_extractor(("relu1", "conv2"))
    torch.manual_seed(1)
    b = tiny_extractor(("conv1", "conv2"), channels=(4, 6), stride=1)
    return a, b


def test_two_extractors_over_one_stream_equal_their_features_and_dumps(tmp_path: Path) -> None:
    a, b = _extractors()
    images = torch.rand(14, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    streamed = cka_matrix(a, b, images, minibatch_size=5, batch_size=4, num_workers=0)
    direct = MinibatchCKA(["relu1", "conv2"], ["conv1", "conv2"], minibatch_size=5)
    with torch.no_grad():
        direct.update(a(images), b(images))
    np.testing.assert_allclose(streamed.values, direct.compute().values, rtol=0, atol=TOLERANCE)
    itself = cka_matrix(a, a, images, minibatch_size=7, num_workers=0)
    np.testing.assert_allclose(np.diagonal(itself.values), 1.0, rtol=0, atol=1e-12)
    for name, extractor in (("a", a), ("b", b)):
        dump_features(extractor, images, tmp_path / name, batch_size=4, num_workers=0)
    dumped = cka_matrix_from_dumps(tmp_path / "a", tmp_path / "b", minibatch_size=5)
    np.testing.assert_allclose(dumped.values, streamed.values, rtol=0, atol=TOLERANCE)
    assert dumped.count == streamed.count == 14 and np.ptp(streamed.values) > 0.05  # four different numbers


def test_each_extractor_sees_the_images_in_its_own_range() -> None:
    a = tiny_extractor(("relu1",))
    b = tiny_extractor(("conv2",), input_range=(-1.0, 1.0))
    images = torch.rand(8, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    streamed = cka_matrix(a, b, images, minibatch_size=4, num_workers=0)
    with torch.no_grad():
        expected = one_cka(a(images)["relu1"], b(images * 2 - 1)["conv2"], 4)
        unscaled = one_cka(a(images)["relu1"], b(images)["conv2"], 4)
    assert abs(streamed.values[0, 0] - expected) < TOLERANCE and abs(expected - unscaled) > 1e-3


def one_cka(x: torch.Tensor, y: torch.Tensor, size: int) -> float:
    accumulator = MinibatchCKA(["x"], ["y"], minibatch_size=size)
    accumulator.update({"x": x}, {"y": y})
    return accumulator.compute().value("x", "y")


@pytest.fixture(scope="module")
def files(png_folder: Callable[..., Path]) -> list[str]:
    return sorted(str(path) for path in png_folder(8, (16, 16)).glob("*.png"))


def _dump(files: list[str], out: Path, second: bool = False) -> Path:
    extractor = _extractors()[1 if second else 0]
    dump_features(extractor, files, out, pool="avg" if second else None, num_workers=0)
    return out


def test_dumps_match_their_rows_by_id(files: list[str], tmp_path: Path) -> None:
    a = _dump(files, tmp_path / "a")
    in_order = cka_matrix_from_dumps(a, _dump(files, tmp_path / "b", second=True), minibatch_size=4)
    shuffled = [files[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]
    matched = cka_matrix_from_dumps(a, _dump(shuffled, tmp_path / "shuffled", second=True), minibatch_size=4)
    np.testing.assert_allclose(matched.values, in_order.values, rtol=0, atol=1e-12)
    unmatched = MinibatchCKA(in_order.layers_a, in_order.layers_b, minibatch_size=4)  # row for row, unmatched
    unmatched.update(
        {layer: np.load(a / f"{layer}.npy") for layer in in_order.layers_a},
        {layer: np.load(tmp_path / "shuffled" / f"{layer}.npy") for layer in in_order.layers_b},
    )
    assert np.abs(unmatched.compute().values - in_order.values).max() > 1e-3  # the matching mattered


def test_dumps_of_other_images_are_refused_naming_them(files: list[str], tmp_path: Path) -> None:
    a = _dump(files, tmp_path / "a")
    missing = _dump(files[:-1], tmp_path / "missing", second=True)
    with pytest.raises(InvalidValueError, match=rf"1 of A not in B \({re.escape(repr(files[-1]))}\)"):
        cka_matrix_from_dumps(a, missing)
    renamed = str(tmp_path / "renamed.png")
    shutil.copy(files[0], renamed)
    other = _dump([renamed, *files[1:]], tmp_path / "other", second=True)
    with pytest.raises(InvalidValueError) as refused:
        cka_matrix_from_dumps(a, other)
    assert f"1 of A not in B ({files[0]!r}) and 1 of B not in A ({renamed!r})" in str(refused.value)


# -- the command ------------------------------------------------------------------------------------------------
def test_cka_command_prints_the_matrix_and_draws_it(
    files: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _dump(files, tmp_path / "a"), _dump(files[::-1], tmp_path / "b", second=True)
    expected = cka_matrix_from_dumps(a, b, minibatch_size=4)
    out = tmp_path / "cka.png"
    assert main(["cka", str(a), str(b), "--out", str(out), "--minibatch-size", "4"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("linear CKA of 8 images (minibatches of 4")
    assert printed[1].split() == ["conv1", "conv2"]
    for line, layer, values in zip(printed[2:4], expected.layers_a, expected.values):
        assert line.split() == [layer, *(f"{value:.4f}" for value in values)]
    assert printed[-1] == f"wrote {out}"
    picture = np.asarray(Image.open(out))
    assert picture.ndim == 3 and picture.shape[0] > 2 * 36 and picture.shape[1] > 2 * 36


def test_cka_command_refuses_dumps_of_other_images(
    files: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _dump(files, tmp_path / "a"), _dump(files[1:], tmp_path / "b", second=True)
    assert main(["cka", str(a), str(b), "--layers-a", "relu1", "--out", str(tmp_path / "cka.png")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"1 of A not in B ({files[0]!r})" in error
    assert not (tmp_path / "cka.png").exists()
