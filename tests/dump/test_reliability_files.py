"""Files featurehooks creates never follow planted links; statistics files are checked before they are read (#19)."""

from __future__ import annotations

import io
import json
import os
import stat
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from featurehooks import _atomic
from featurehooks._atomic import write_atomic
from featurehooks.dump.manifest import InputsRecord, Manifest, Settings
from featurehooks.dump.store import DumpLockedError, DumpStore
from featurehooks.errors import InvalidValueError
from featurehooks.metrics.frechet import frechet_distance
from featurehooks.metrics.statistics import FeatureStatistics

needs_links = pytest.mark.skipif(not hasattr(os, "symlink") or os.name == "nt", reason="POSIX links")


# -- item 8: symlinks -------------------------------------------------------------------------------------
@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_bytes(b"precious bytes\n")
    return path


@needs_links
def test_a_symlink_planted_at_the_lock_is_neither_followed_nor_truncated(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(victim)
    store = DumpStore(out)
    with pytest.raises(DumpLockedError, match="symbolic link"):
        store.lock()
    assert victim.read_bytes() == b"precious bytes\n"
    assert (out / ".lock").is_symlink()  # left for the user to look at


@needs_links
def test_a_hard_link_planted_at_the_lock_is_not_truncated(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    os.link(victim, out / ".lock")
    with pytest.raises(DumpLockedError, match="hard link"):
        DumpStore(out).lock()
    assert victim.read_bytes() == b"precious bytes\n"


@needs_links
def test_a_symlink_at_the_old_predictable_temporary_name_is_not_followed(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("manifest.json", "conv.npy"):
        (out / f".{name}.tmp-{os.getpid()}").symlink_to(victim)
    write_atomic(out / "manifest.json", '{"a": 1}\n')
    DumpStore(out).create_arrays({"conv": [2, 3]}, "float32")
    assert victim.read_bytes() == b"precious bytes\n"
    assert (out / "manifest.json").read_text() == '{"a": 1}\n'
    assert np.load(out / "conv.npy").shape == (2, 3)
    leftovers = sorted(p.name for p in out.iterdir() if ".tmp-" in p.name)
    assert leftovers == sorted(f".{name}.tmp-{os.getpid()}" for name in ("conv.npy", "manifest.json"))


def test_temporary_names_are_unpredictable_and_files_keep_the_usual_mode(tmp_path: Path) -> None:
    _, first = _atomic.temporary(tmp_path / "x")
    _, second = _atomic.temporary(tmp_path / "x")
    assert first != second and first.name.startswith(".x.tmp-") and second.name.startswith(".x.tmp-")
    write_atomic(tmp_path / "index.csv", "row,valid,path\n")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "index.csv").stat().st_mode) == 0o666 & ~umask


def test_a_growing_file_is_whole_or_absent_and_refuses_late_writes(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), _atomic.growing_atomic(tmp_path / "scores.csv") as write:
        write("a,1\n")
        raise RuntimeError("the run failed")
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary left
    with _atomic.growing_atomic(tmp_path / "scores.csv") as write:
        write("a,1\n")
        write(b"b,2\n")
    assert (tmp_path / "scores.csv").read_text() == "a,1\nb,2\n"
    with pytest.raises(ValueError, match="write after its block ended"):
        write("c,3\n")  # its descriptor may belong to another file by now


@needs_links
def test_a_symlink_planted_at_a_journal_is_not_followed(tmp_path: Path, victim: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    store = DumpStore(out)
    inputs = InputsRecord("files", 2, "0" * 64)
    settings = Settings("net", None, None, {"conv": (2, 3)}, "float32", None, {}, inputs)
    store.write_manifest(Manifest(settings, chunk_size=2, versions={}))
    store.reset_journal()
    (store.journal_dir / "rank-0.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        store.open_journal(0)
    assert victim.read_bytes() == b"precious bytes\n"


# -- item 9: statistics files ------------------------------------------------------------------------------
def _saved(tmp_path: Path) -> dict[str, np.ndarray]:
    path = tmp_path / "good.npz"
    FeatureStatistics().update(np.random.default_rng(0).normal(size=(10, 3))).save(path)
    with np.load(path) as data:
        return dict(data)


def _npz(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)
    return path


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _lying_npy(shape: tuple[int, ...], dtype: str = "<f8") -> bytes:
    """An ``.npy`` header declaring ``shape`` followed by a few bytes only."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue() + b"\0" * 64


def _meta(arrays: dict[str, np.ndarray], **changes: object) -> bytes:
    meta = json.loads(str(arrays["meta"]))
    meta.update(changes)
    return _npy(np.array(json.dumps(meta)))


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
@pytest.mark.parametrize("meta_dim", [3, 8192])
def test_a_small_file_declaring_a_huge_array_is_refused_without_allocating_it(
    tmp_path: Path, compression: int, meta_dim: int
) -> None:
    arrays = _saved(tmp_path)
    members = {name: _npy(value) for name, value in arrays.items()}
    members["sigma"] = _lying_npy((8192, 8192))  # 512 MiB declared, 64 bytes stored
    members["meta"] = _meta(arrays, dim=meta_dim)
    if meta_dim != 3:
        members["mu"] = _npy(np.zeros(meta_dim))
        members["features"] = _npy(np.zeros((0, meta_dim), dtype=np.float32))
    path = _npz(tmp_path / "bomb.npz", members, compression)
    assert path.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InvalidValueError, match="not a featurehooks statistics file") as caught:
            FeatureStatistics.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak:,} bytes allocated before refusing"
    assert "\n" not in str(caught.value) and "(8192, 8192)" in str(caught.value)


def test_a_member_declaring_more_bytes_than_compression_can_hold_is_refused(tmp_path: Path) -> None:
    arrays = _saved(tmp_path)
    path = _npz(tmp_path / "ok.npz", {name: _npy(value) for name, value in arrays.items()}, zipfile.ZIP_DEFLATED)
    assert FeatureStatistics.load(path).count == 10  # compressed archives (np.savez_compressed) still load
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo("sigma.npy")
    start = 0  # find sigma.npy's central directory entry, whose uncompressed size zipfile trusts
    while True:
        entry = data.find(b"PK\x01\x02", start)
        assert entry >= 0
        name_length = int.from_bytes(data[entry + 28 : entry + 30], "little")
        if data[entry + 46 : entry + 46 + name_length] == b"sigma.npy":
            break
        start = entry + 4
    assert int.from_bytes(data[entry + 24 : entry + 28], "little") == info.file_size
    data[entry + 24 : entry + 28] = (0xFFFFFFF0).to_bytes(4, "little")  # now claiming 4 GiB
    path.write_bytes(bytes(data))
    with pytest.raises(InvalidValueError, match="compressed bytes can hold"):
        FeatureStatistics.load(path)


def test_a_huge_count_is_refused_when_loading(tmp_path: Path) -> None:
    arrays = _saved(tmp_path)
    members = {name: _npy(value) for name, value in arrays.items()}
    members["meta"] = _meta(arrays, count=10**30)
    path = _npz(tmp_path / "count.npz", members)
    with pytest.raises(InvalidValueError, match=r"count 10{30} is out of range"):
        frechet_distance(FeatureStatistics.load(path), FeatureStatistics.load(path))


def test_a_deeply_nested_meta_is_refused_clearly(tmp_path: Path) -> None:
    arrays = _saved(tmp_path)
    members = {name: _npy(value) for name, value in arrays.items()}
    meta = str(arrays["meta"])
    deep = "[" * 100_000 + "]" * 100_000
    members["meta"] = _npy(np.array(meta[:-1] + ', "extra": ' + deep + "}"))
    path = _npz(tmp_path / "deep.npz", members)
    with pytest.raises(InvalidValueError, match="meta nests 100001 levels deep, more than 32"):
        FeatureStatistics.load(path)
    members["meta"] = _meta(arrays, note="[" * 100_000)
    path = _npz(tmp_path / "strings.npz", members)
    assert FeatureStatistics.load(path).count == 10  # brackets inside strings are not nesting


def test_a_huge_meta_and_object_arrays_are_refused_before_reading(tmp_path: Path) -> None:
    arrays = _saved(tmp_path)
    members = {name: _npy(value) for name, value in arrays.items()}
    members["meta"] = _meta(arrays, note="x" * (1 << 20))
    with pytest.raises(InvalidValueError, match="its meta is .* bytes, more than"):
        FeatureStatistics.load(_npz(tmp_path / "big.npz", members))
    members = {name: _npy(value) for name, value in arrays.items()}
    members["mu"] = _lying_npy((3,), "|O")
    with pytest.raises(InvalidValueError, match="Python objects"):
        FeatureStatistics.load(_npz(tmp_path / "objects.npz", members))
