"""The one reader of every ``.npz`` featurehooks loads (statistics, mu/sigma, manifolds): sizes checked before
anything is unpacked, against what the caller expects, the file's own size and a budget; one error naming the file.

Archives are built member by member here, zeros streamed through deflate, so that a file of a few hundred KB can
declare hundreds of MB without the test allocating them; ``tracemalloc`` shows the reader did not either.
"""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Union

import numpy as np
import pytest
import torch

from featurehooks.errors import InvalidValueError
from featurehooks.metrics import (
    FeatureOrigin,
    FeatureStatistics,
    Manifold,
    _npz,
    load_mu_sigma,
    load_statistics,
    save_statistics,
)
from featurehooks.metrics.prdc import FORMAT as MANIFOLD
from featurehooks.metrics.statistics import FORMAT as STATISTICS
from featurehooks.metrics.statistics import SET_FORMAT as SET

Zeros = tuple[tuple[int, ...], str]  # (shape, dtype) of an array of zeros, streamed
Member = Union[np.ndarray, Zeros, str]  # an array, zeros, or a meta JSON text
_CHUNK = 1 << 20


def _archive(path: Path, members: dict[str, Member]) -> Path:
    """A deflated ``.npz`` of ``members``, zeros written a chunk at a time."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, value in members.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as out:
                if isinstance(value, str):
                    np.lib.format.write_array(out, np.array(value))
                elif isinstance(value, np.ndarray):
                    np.lib.format.write_array(out, value)
                else:
                    shape, dtype = value
                    header = {"descr": dtype, "fortran_order": False, "shape": shape}
                    np.lib.format.write_array_header_1_0(out, header)
                    left = int(np.prod(shape)) * np.dtype(dtype).itemsize
                    while left:
                        out.write(bytes(min(left, _CHUNK)))
                        left -= min(left, _CHUNK)
    return path


@contextmanager
def _peak(limit: int) -> Iterator[None]:
    """Assert that the block allocates at most ``limit`` bytes at its peak."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak:,} bytes allocated"


def _statistics_meta(dim: int, count: int = 10, **changes: Any) -> str:
    meta = {"format": STATISTICS, "count": count, "dim": dim, "keep": 0, "seed": 0, "origin": None, **changes}
    return json.dumps(meta)


def _manifold_meta(count: int, dim: int, **changes: Any) -> str:
    return json.dumps({"format": MANIFOLD, "k": 3, "count": count, "dim": dim, "origin": None, **changes})


def _refused(load: Callable[[], object], path: Path, message: str) -> str:
    """The one-line error ``load`` raises, naming ``path``, allocating almost nothing."""
    with _peak(4 << 20), pytest.raises(InvalidValueError, match=message) as caught:
        load()
    text = str(caught.value)
    assert str(path) in text and "\n" not in text
    return text


# -- mu/sigma: fid X.npz --------------------------------------------------------------------------------------
def test_a_compressed_covariance_of_zeros_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    """32 MiB of zeros deflated to a file of ~33 KB: accepted (and unpacked) before the reader checked the bytes a
    file unpacks to against its own size."""
    path = _archive(tmp_path / "zeros.npz", {"mu": np.zeros(2048), "sigma": ((2048, 2048), "<f8")})
    assert path.stat().st_size < 1 << 17
    _refused(lambda: load_mu_sigma(path), path, "unpack to 33,5.* bytes from a file of")


def test_another_dimension_than_asked_is_refused_before_anything_is_unpacked(tmp_path: Path) -> None:
    path = tmp_path / "stats2048.npz"
    np.savez(path, mu=np.zeros(2048), sigma=np.eye(2048))  # 32 MiB, stored as it is
    text = _refused(lambda: load_mu_sigma(path, dims=64), path, "holds the statistics of 2048 features, not dims=64")
    assert text.endswith("pass dims=2048")
    mu, sigma = load_mu_sigma(path, dims=2048)
    assert tuple(sigma.shape) == (2048, 2048)
    odd = tmp_path / "odd.npz"
    np.savez(odd, mu=np.zeros(5), sigma=np.eye(5))
    with pytest.raises(InvalidValueError, match="not dims=2048: they are not FID statistics"):
        load_mu_sigma(odd, dims=2048)
    with pytest.raises(InvalidValueError, match="dims must be an int >= 1"):
        load_mu_sigma(odd, dims=0)


# -- statistics --------------------------------------------------------------------------------------------
def test_statistics_whose_covariance_unpacks_to_many_times_the_file_are_refused(tmp_path: Path) -> None:
    """A meta that agrees with the arrays does not make a deflated zero covariance any smaller."""
    members: dict[str, Member] = {
        "mu": np.zeros(2048),
        "sigma": ((2048, 2048), "<f8"),
        "features": np.zeros((0, 2048), dtype=np.float32),
        "meta": _statistics_meta(2048),
    }
    path = _archive(tmp_path / "stats.npz", members)
    _refused(lambda: FeatureStatistics.load(path), path, "not a featurehooks statistics file: its arrays unpack to")
    text = _refused(lambda: FeatureStatistics.load(path, dim=64), path, "2048 features, not dim=64")
    assert "is not a" not in text  # a file of other features, not a damaged one


def test_statistics_of_another_dimension_name_their_features(tmp_path: Path) -> None:
    path = tmp_path / "layer4.npz"
    stats = FeatureStatistics(origin=None).update(np.random.default_rng(0).normal(size=(4, 512)))
    stats.save(path)
    _refused(lambda: FeatureStatistics.load(path, dim=64), path, "holds the statistics of 512 features, not dim=64")
    assert FeatureStatistics.load(path, dim=512).count == 4


# -- named statistics: eval --save-stats --------------------------------------------------------------------------
def test_named_statistics_read_back_as_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    origin = FeatureOrigin("fid_inception", "avgpool", "avg", None, lineage="clean")
    written = {
        "inception": FeatureStatistics(keep=3, origin=origin).update(rng.normal(size=(5, 8))),
        "dinov2": FeatureStatistics().update(rng.normal(size=(4, 6))),
    }
    found = load_statistics(save_statistics(tmp_path / "ref.npz", written))
    assert list(found) == ["inception", "dinov2"]
    for name, stats in written.items():
        assert found[name].count == stats.count and found[name].origin == stats.origin
        torch.testing.assert_close(found[name].covariance, stats.covariance, rtol=0, atol=0)
    np.testing.assert_array_equal(found["inception"].features, written["inception"].features)
    with pytest.raises(InvalidValueError, match="identifiers"):
        save_statistics(tmp_path / "bad.npz", {"a.b": written["dinov2"]})


def test_named_statistics_are_checked_as_one_file_each_before_unpacking(tmp_path: Path) -> None:
    meta = json.loads(_statistics_meta(2048))
    members: dict[str, Member] = {
        "inception.mu": np.zeros(2048),
        "inception.sigma": ((2048, 2048), "<f8"),
        "inception.features": np.zeros((0, 2048), dtype=np.float32),
        "meta": json.dumps({"format": SET, "statistics": {"inception": meta}}),
    }
    path = _archive(tmp_path / "zeros.npz", members)
    _refused(lambda: load_statistics(path), path, "not a featurehooks file of named statistics: its arrays unpack to")
    members["meta"] = json.dumps({"format": SET, "statistics": {"inception": {**meta, "dim": 64}}})
    path = _archive(tmp_path / "shapes.npz", members)
    _refused(lambda: load_statistics(path), path, "do not fit count 10, dim 64")
    members["extra"] = np.zeros(3)
    path = _archive(tmp_path / "extra.npz", members)
    _refused(lambda: load_statistics(path), path, "it holds .*extra")
    single = tmp_path / "single.npz"
    FeatureStatistics().update(np.zeros((3, 4))).save(single)
    _refused(lambda: load_statistics(single), single, "format 'featurehooks.statistics/1', expected")


# -- manifolds ---------------------------------------------------------------------------------------------
def test_a_manifold_of_zeros_is_refused_before_it_is_unpacked(tmp_path: Path) -> None:
    """131,072 vectors of zeros in a file of ~33 KB: unpacked to 32 MiB before, with none of the checks."""
    members: dict[str, Member] = {
        "features": ((131_072, 64), "<f4"),
        "radii": ((131_072,), "<f4"),
        "meta": _manifold_meta(131_072, 64),
    }
    path = _archive(tmp_path / "zeros.manifold.npz", members)
    assert path.stat().st_size < 1 << 17
    _refused(lambda: Manifold.load(path), path, "not a featurehooks manifold file: its arrays unpack to")


def test_a_manifold_with_a_deeply_nested_or_huge_meta_is_refused_clearly(tmp_path: Path) -> None:
    """A nested meta raised a bare RecursionError."""
    arrays: dict[str, Member] = {"features": np.zeros((6, 2), np.float32), "radii": np.ones(6, np.float32)}
    deep = _manifold_meta(6, 2)[:-1] + ', "note": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = _archive(tmp_path / "deep.npz", {**arrays, "meta": deep})
    _refused(lambda: Manifold.load(path), path, "its meta nests 100001 levels deep, more than 32")
    path = _archive(tmp_path / "big.npz", {**arrays, "meta": _manifold_meta(6, 2, note="x" * (1 << 20))})
    _refused(lambda: Manifold.load(path), path, "its meta is .* bytes, more than")


def test_a_manifold_whose_arrays_disagree_with_its_meta_or_each_other_is_refused(tmp_path: Path) -> None:
    features, radii = np.zeros((6, 2), np.float32), np.ones(6, np.float32)
    cases: dict[str, tuple[dict[str, Member], str]] = {
        "count": ({"features": features, "radii": radii, "meta": _manifold_meta(7, 2)}, "meta records count and dim"),
        "radii": ({"features": features, "radii": radii[:5], "meta": _manifold_meta(6, 2)}, r"radii of shape \(5,\)"),
        "dtype": ({"features": features, "radii": radii.astype(np.float64), "meta": _manifold_meta(6, 2)}, "radii of"),
        "vectors": ({"features": features[0], "radii": radii, "meta": _manifold_meta(6, 2)}, r"expected \(N, D\)"),
        "extra": ({"features": features, "radii": radii, "meta": _manifold_meta(6, 2), "x": radii}, "it holds"),
    }
    for name, (members, message) in cases.items():
        path = _archive(tmp_path / f"{name}.npz", members)
        _refused(lambda path=path: Manifold.load(path), path, message)  # type: ignore[misc]
    good = _archive(tmp_path / "good.npz", {"features": features, "radii": radii, "meta": _manifold_meta(6, 2)})
    assert Manifold.load(good).count == 6


# -- one reader, one budget ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mu_sigma", "statistics", "manifold"])
def test_every_loader_is_the_one_reader_with_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The budget of the shared reader bounds all three (here lowered to 1 MiB for files of 2 MiB)."""
    rng = np.random.default_rng(0)
    path = tmp_path / f"{kind}.npz"
    if kind == "manifold":
        vectors = torch.from_numpy(rng.normal(size=(8192, 64)).astype(np.float32))
        Manifold(vectors, torch.ones(8192), k=3).save(path)
        load: Callable[[], object] = lambda: Manifold.load(path)  # noqa: E731
    else:
        FeatureStatistics().update(rng.normal(size=(4, 512))).save(path)
        load = (lambda: load_mu_sigma(path)) if kind == "mu_sigma" else (lambda: FeatureStatistics.load(path))
    load()  # within the budget as it is
    monkeypatch.setattr(_npz, "_MAX_BYTES", 1 << 20)
    with pytest.raises(InvalidValueError, match=f"{path} is not a .*: its arrays unpack to .* more than 1,048,576"):
        load()


def test_the_reader_never_unpickles_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "objects.npz"
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"k": 1}], dtype=object), allow_pickle=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name in ("features", "radii", "meta"):
            archive.writestr(f"{name}.npy", buffer.getvalue())
    _refused(lambda: Manifold.load(path), path, "Python objects")
