"""The dump's files under stress: a full disk, non-UTF-8 names, hand-edited bookkeeping, two writers in one folder."""

from __future__ import annotations

import csv
import dataclasses
import errno
import json
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.dump import dump_features, list_images, read_manifest
from featurehooks.dump import store as store_module
from featurehooks.dump.store import CorruptDumpError, DumpLockedError, DumpStore, NoSpaceError
from featurehooks.errors import FeatureHooksError

from dump_helpers import mark_unfinished, scribble
from helpers import REPO, tiny_extractor

CROP = 16
BATCH = 4
ROWS = 12
BIG = 128  # rows of a dump of ~400 KB: more than the room left on the small filesystem, less than all of it


def rows(count: int = ROWS) -> torch.Tensor:
    """``count`` seeded images in [0, 1]."""
    return torch.rand(count, 3, CROP, CROP, generator=torch.Generator().manual_seed(count))


def dump(source: Any, out: Path, **kwargs: Any) -> Any:
    """dump_features with the test settings: small chunks, no workers, no progress bar; the extractor's two taps
    take 1568 + 1600 bytes per row in float32."""
    options = {"batch_size": BATCH, "num_workers": 0, "progress": False, "resize_size": CROP, "crop_size": CROP}
    return dump_features(tiny_extractor(), source, out, **{**options, **kwargs})


def same_files(a: Path, b: Path) -> None:
    """Both folders hold the same file names with the same bytes (hidden files included)."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``reference(n)``: an uninterrupted dump of ``rows(n)`` on the ordinary disk, made once per ``n``."""
    made: dict[int, Path] = {}

    def get(count: int) -> Path:
        if count not in made:
            made[count] = tmp_path_factory.mktemp(f"reference{count}")
            dump(rows(count), made[count])
        return made[count]

    return get


# -- 1. a full disk ------------------------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only), unmounted after the test."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill ``folder``'s filesystem until ``leave`` bytes (or less) are free; returns the filler file."""
    filler = folder / "filler"
    block = b"\xff" * 4096
    with open(filler, "wb") as handle:
        try:
            while shutil.disk_usage(folder).free > leave:
                handle.write(block)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def no_temporaries(out: Path) -> None:
    """No array files and no temporary files were left behind."""
    assert not [p.name for p in out.iterdir() if p.suffix == ".npy" or ".tmp-" in p.name]


def test_a_dump_that_does_not_fit_fails_before_any_row_then_resumes_identical(
    small_fs: Path, reference: Callable[[int], Path]
) -> None:
    filler = fill(small_fs, leave=256 * 1024)
    out = small_fs / "out"
    with pytest.raises(NoSpaceError) as caught:
        dump(rows(BIG), out)
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    message = str(caught.value)
    assert str(out) in message and "bytes needed" in message and "available" in message
    assert "\n" not in message
    no_temporaries(out)
    assert read_manifest(out).status == "running"
    filler.unlink()
    assert dump(rows(BIG), out, resume=True).manifest.status == "complete"
    same_files(out, reference(BIG))


class FillsTheDisk(torch.utils.data.Dataset):
    """``rows(ROWS)``, and when item ``at`` is read, the output's filesystem is filled to the last byte."""

    def __init__(self, folder: Path, at: int) -> None:
        self.items, self.folder, self.at = rows(), folder, at

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.at:
            fill(self.folder)
        return self.items[index]


@pytest.mark.parametrize(("at", "failing"), [(1, "commit rows 0:4"), (ROWS - 1, "write index.csv")])
def test_a_disk_filled_mid_dump_is_a_clean_error_and_resume_is_identical(
    small_fs: Path, reference: Callable[[int], Path], at: int, failing: str
) -> None:
    out = small_fs / "out"
    with pytest.raises(NoSpaceError, match=re.escape(f"{out} to {failing}")):
        dump(FillsTheDisk(small_fs, at), out)
    assert read_manifest(out).status == "running"  # never a corrupt or premature "complete"
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    (small_fs / "filler").unlink()
    assert dump(rows(), out, resume=True).manifest.status == "complete"
    same_files(out, reference(ROWS))


def refuse_fallocate(code: int) -> Callable[[int, int, int], None]:
    """A posix_fallocate that always fails with ``code``."""

    def fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(code, os.strerror(code))

    return fallocate


def test_no_space_for_the_arrays_injected_then_resume(
    tmp_path: Path, reference: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(os, "posix_fallocate", refuse_fallocate(errno.ENOSPC), raising=False)
    with pytest.raises(NoSpaceError, match="bytes needed") as caught:
        dump(rows(), out)
    assert caught.value.errno == errno.ENOSPC and str(out) in str(caught.value)
    no_temporaries(out)
    monkeypatch.undo()
    dump(rows(), out, resume=True)
    same_files(out, reference(ROWS))


def test_without_fallocate_the_free_space_is_checked(
    tmp_path: Path, reference: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "posix_fallocate", refuse_fallocate(errno.EOPNOTSUPP), raising=False)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=1000))
    with pytest.raises(NoSpaceError, match="1,000 available"):
        dump(rows(), tmp_path / "out")
    monkeypatch.setattr(shutil, "disk_usage", real)
    dump(rows(), tmp_path / "out", resume=True)
    same_files(tmp_path / "out", reference(ROWS))


def test_a_failed_manifest_write_leaves_the_old_manifest_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    dump(rows(), out)
    before = (out / "manifest.json").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    store = DumpStore(out)
    running = dataclasses.replace(store.read_manifest(), status="running")
    with pytest.raises(NoSpaceError, match="manifest.json"):
        store.write_manifest(running)
    assert (out / "manifest.json").read_bytes() == before
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]


# -- 2. file names that are not UTF-8 ------------------------------------------------------------------------
def test_file_names_that_are_not_utf8_round_trip(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    raw = os.fsencode(folder) + b"/caf\xe9.png"
    try:
        Image.new("RGB", (CROP, CROP), (200, 10, 10)).save(os.fsdecode(raw))
    except (OSError, UnicodeError) as exc:
        pytest.skip(f"this filesystem refuses non-UTF-8 names: {exc}")
    Image.new("RGB", (CROP, CROP), (10, 200, 10)).save(folder / "plain.png")
    out = tmp_path / "out"
    assert dump(folder, out).manifest.status == "complete"
    index = (out / "index.csv").read_bytes()
    assert raw in index  # the name's own bytes, not a replacement character
    listed = [line.split(",", 2)[2] for line in index.decode("utf-8", "surrogateescape").splitlines()[1:]]
    assert listed == list_images(folder)
    mark_unfinished(out, [(0, 0, 2)]).close_arrays()
    assert dump(folder, out, resume=True).manifest.status == "complete"
    assert (out / "index.csv").read_bytes() == index


def test_names_with_commas_quotes_and_line_breaks_parse_back_from_the_index(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for name in ("a,b.png", 'say "hi".png', "line\rbreak.png", "line\nfeed.png", "plain.png"):
        Image.new("RGB", (CROP, CROP)).save(folder / name)
    dump(folder, tmp_path / "out")
    with open(tmp_path / "out" / "index.csv", newline="", encoding="utf-8") as handle:
        table = list(csv.reader(handle))
    assert table[0] == ["row", "valid", "path"]
    assert [path for _, _, path in table[1:]] == list_images(folder)


# -- 5. hand-edited bookkeeping ------------------------------------------------------------------------------
def unfinished(tmp_path: Path, committed: tuple[int, ...] = (0,)) -> Path:
    """A dump of ``rows()`` that looks killed after ``committed`` chunks, its other rows never computed (zeros)."""
    out = tmp_path / "out"
    dump(rows(), out)
    store = mark_unfinished(out, [(c, c * BATCH, (c + 1) * BATCH) for c in committed])
    for chunk in set(range(ROWS // BATCH)) - set(committed):
        scribble(store, chunk * BATCH, (chunk + 1) * BATCH, 0.0)
    store.close_arrays()
    return out


def edit_manifest(out: Path, **fields: Any) -> None:
    """Rewrite ``manifest.json`` as a person with an editor would."""
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, **fields}, indent=1))


@pytest.mark.parametrize("chunk_size", [0, -4, "4", 2.5, True, None, 8])
def test_an_edited_chunk_size_is_refused(tmp_path: Path, chunk_size: Any) -> None:
    out = unfinished(tmp_path, committed=(0, 1))
    edit_manifest(out, chunk_size=chunk_size)
    with pytest.raises(CorruptDumpError, match="overwrite") as caught:
        dump(rows(), out, resume=True)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FeatureHooksError)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "done"},
        {"layers": ["relu1"]},
        {"shapes": {"relu1": [ROWS + 1, 8, 7, 7], "conv2": [ROWS, 16, 5, 5]}},
        {"files": {"relu1": "../relu1.npy", "conv2": "conv2.npy"}},
        {"dtype": "float64"},
        {"inputs": {"kind": "dataset", "count": 0}},
    ],
    ids=["status", "layers", "shapes", "files", "dtype", "count"],
)
def test_manifest_fields_are_checked_when_read(tmp_path: Path, fields: dict[str, Any]) -> None:
    out = unfinished(tmp_path)
    edit_manifest(out, **fields)
    with pytest.raises(CorruptDumpError, match=f"{next(iter(fields))}.*overwrite"):
        read_manifest(out)
    assert dump(rows(), out, overwrite=True).manifest.status == "complete"


@pytest.mark.parametrize("fields", [{"skipped": None}, {"num_valid": ROWS + 1}, {"num_rows": 3}])
def test_a_complete_manifest_must_account_for_every_row(tmp_path: Path, fields: dict[str, Any]) -> None:
    out = tmp_path / "out"
    dump(rows(), out)
    edit_manifest(out, **fields)
    with pytest.raises(CorruptDumpError, match=next(iter(fields))):
        dump(rows(), out, resume=True)


def journal_lines(out: Path) -> list[dict[str, Any]]:
    """The records of rank 0's journal."""
    return [json.loads(line) for line in (out / ".journal" / "rank-0.jsonl").read_text().splitlines()]


def write_journal(out: Path, records: list[dict[str, Any]]) -> None:
    """Replace rank 0's journal with ``records``."""
    (out / ".journal" / "rank-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize(
    "edit",
    [
        lambda r: {**r, "chunk": 2},
        lambda r: {**r, "chunk": 2, "rows": [8, 12]},
        lambda r: {**r, "skipped": []},
        lambda r: {**r, "rank": 1},
        lambda r: {k: v for k, v in r.items() if k != "crc"},
    ],
    ids=["chunk", "chunk-and-rows", "skipped", "rank", "checksum"],
)
def test_an_edited_journal_line_is_refused_never_zero_rows_marked_valid(
    tmp_path: Path, edit: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    out = unfinished(tmp_path, committed=())
    store = DumpStore(out)
    store.open_journal(0)
    store.open_arrays(read_manifest(out).settings.layers)
    store.commit(1, 4, 8, [(5, "OSError: unreadable")])
    store.close_journal()
    store.close_arrays()
    write_journal(out, [edit(journal_lines(out)[0])])
    with pytest.raises(CorruptDumpError, match=r"rank-0\.jsonl line 1.*overwrite"):
        dump(rows(), out, resume=True)


@pytest.mark.parametrize(
    "commits",
    [
        [(1, 8, 12, [])],  # rows of chunk 2 under chunk 1
        [(1, 4, 9, [])],  # past the chunk's end
        [(3, 12, 16, [])],  # a chunk past the last row
        [(1, 4, 8, [(9, "x")])],  # a skipped row outside the chunk
        [(1, 4, 8, []), (1, 4, 8, [(5, "OSError")])],  # the same chunk committed twice, differently
    ],
    ids=["rows", "stop", "chunk", "skipped-row", "conflict"],
)
def test_journal_records_must_fit_the_manifest(tmp_path: Path, commits: list[tuple[Any, ...]]) -> None:
    out = unfinished(tmp_path, committed=())
    store = DumpStore(out)
    store.open_journal(0)
    store.open_arrays(read_manifest(out).settings.layers)
    for commit in commits:
        store.commit(*commit)
    store.close_journal()
    with pytest.raises(CorruptDumpError, match="line"):
        store.committed()
    store.close_arrays()


def test_a_chunk_committed_twice_alike_counts_once(tmp_path: Path, reference: Callable[[int], Path]) -> None:
    out = unfinished(tmp_path, committed=(0, 0, 1))
    assert sorted(DumpStore(out).committed()) == [0, 1]
    dump(rows(), out, resume=True)
    same_files(out, reference(ROWS))


def test_a_journal_left_by_another_manifest_is_refused(tmp_path: Path) -> None:
    out = unfinished(tmp_path, committed=(0, 1))
    edit_manifest(out, weights_sha256="0" * 64)  # a new dump killed between its manifest and its journal reset
    with pytest.raises(CorruptDumpError, match="another manifest"):
        DumpStore(out).committed()


def test_leftovers_of_a_killed_array_creation_are_removed(tmp_path: Path, reference: Callable[[int], Path]) -> None:
    out = unfinished(tmp_path)
    (out / "conv2.npy").unlink()  # killed while creating the arrays: only a temporary file was written
    (out / ".conv2.npy.tmp-99999").write_bytes(b"\0" * 4096)
    dump(rows(), out, resume=True)
    same_files(out, reference(ROWS))


# -- 8. two writers, one folder ------------------------------------------------------------------------------
def hold_lock(out: Path, conn: Any) -> None:
    """Child process: take ``out`` for a dump, say so, and keep it until told to let go (or killed)."""
    store = DumpStore(out)
    store.lock()
    conn.send("taken")
    conn.recv()
    store.unlock()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A process holding the lock of ``tmp_path / "out"``, and the pipe that tells it to let go."""
    context = multiprocessing.get_context("fork")
    mine, theirs = context.Pipe()
    process = context.Process(target=hold_lock, args=(tmp_path / "out", theirs))
    process.start()
    try:
        assert mine.poll(30) and mine.recv() == "taken", "the holder never took the lock"
        yield process, mine
    finally:
        if process.is_alive():
            mine.send("let go")
            process.join(30)
        if process.is_alive():
            process.kill()
            process.join()


def test_a_second_writer_gets_one_line_naming_the_first(tmp_path: Path, holder: tuple[Any, Any]) -> None:
    process, conn = holder
    with pytest.raises(DumpLockedError, match=f"pid {process.pid}") as caught:
        DumpStore(tmp_path / "out").lock()
    assert isinstance(caught.value, OSError) and isinstance(caught.value, FeatureHooksError)
    assert "\n" not in str(caught.value) and "resume" not in str(caught.value)
    conn.send("let go")
    process.join(30)
    store = DumpStore(tmp_path / "out")
    store.lock()  # free again once the first is done
    store.unlock()
    assert not (tmp_path / "out" / ".lock").exists()


def test_a_killed_holder_does_not_block(tmp_path: Path, holder: tuple[Any, Any]) -> None:
    process, _ = holder
    os.kill(process.pid, signal.SIGKILL)
    process.join(30)
    assert (tmp_path / "out" / ".lock").exists()  # the stale file stays; the kernel dropped its lock
    store = DumpStore(tmp_path / "out")
    store.lock()
    assert json.loads((tmp_path / "out" / ".lock").read_text())["pid"] == os.getpid()
    store.unlock()


def test_a_filesystem_without_flock_dumps_unguarded_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(store_module.fcntl, "flock", no_locks)
    store = DumpStore(tmp_path / "out")
    with pytest.warns(UserWarning, match="cannot lock"):
        store.lock()
    store.unlock()


SLOW_DUMP = """
import sys, time, torch
sys.path[:0] = {paths!r}
from test_dump_store import dump, rows

class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return {count}
    def __getitem__(self, index):
        time.sleep(0.1)
        return rows()[index]

dump(Slow(), sys.argv[1])
"""


@pytest.mark.slow
def test_a_second_dump_into_a_folder_in_use_gets_one_line_naming_the_first(
    tmp_path: Path, reference: Callable[[int], Path]
) -> None:
    out = tmp_path / "out"
    script = tmp_path / "slow_dump.py"
    script.write_text(SLOW_DUMP.format(paths=[str(Path(__file__).parent), str(REPO / "tests")], count=ROWS))
    first = subprocess.Popen([sys.executable, str(script), str(out)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / "manifest.json").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(DumpLockedError, match=f"pid {first.pid}") as caught:
            dump(rows(), out)
        assert "\n" not in str(caught.value) and "resume" not in str(caught.value)
    finally:
        _, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr[-2000:]
    same_files(out, reference(ROWS))  # the first dump was not disturbed
    assert dump(rows(), out, overwrite=True).manifest.status == "complete"  # and the folder is free again


def test_store_errors_survive_pickling_so_every_rank_raises_the_same() -> None:
    for error in (DumpLockedError("out is being written"), NoSpaceError(errno.ENOSPC, "full"), CorruptDumpError("x")):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)


def test_stored_arrays_have_numpys_own_header(tmp_path: Path) -> None:
    store = DumpStore(tmp_path)
    store.create_arrays({"a": [3, 2, 5]}, "float16")
    np.save(tmp_path / "b.npy", np.zeros((3, 2, 5), dtype=np.float16))
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
