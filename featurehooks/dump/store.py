"""The on-disk layout of a dump: per-layer ``.npy`` files, ``index.csv``, ``manifest.json`` and the journal.

Crash safety rests on three rules:

1. ``manifest.json`` is only ever replaced atomically (write a temporary file, fsync, ``os.replace``)
   and says ``"status": "running"`` before any ``.npy`` file is created; ``"complete"`` is written
   last, once every row is committed. A half-written output is therefore never taken for a complete one.
2. Rows are written in place (``open_memmap``) in fixed chunks; a chunk counts as done only when its
   line in the journal (``.journal/rank-<r>.jsonl``) is fsynced, and that happens after the
   memmap flush. A torn last journal line is ignored, so a killed run redoes at most one chunk per rank.
3. Row numbers come from the sorted input list alone, so every run writes the same bytes to the same place.
"""

from __future__ import annotations

import csv
import json
import mmap
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.format import open_memmap

__all__ = ["DumpStore", "layer_file_name", "read_manifest"]

MANIFEST = "manifest.json"
INDEX = "index.csv"
JOURNAL = ".journal"
FORMAT = "featurehooks.dump/1"


def layer_file_name(layer: str) -> str:
    """File name of a layer's array: ``relu3_3.npy``, ``layer4.1.npy`` (path separators replaced)."""
    safe = "".join("_" if ch in '/\\:*?"<>|' else ch for ch in layer)
    return f"{safe}.npy"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The manifest of the dump in ``out_dir``, or ``None`` when there is none.

    Raises:
        ValueError: the file exists but is not a featurehooks manifest.
    """
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a readable manifest ({exc}); pass overwrite=True to start over") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not a featurehooks dump manifest; pass overwrite=True to start over")
    return manifest


class DumpStore:
    """Files of one dump in ``out_dir``; every method is safe to call from any rank unless noted."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.root = Path(out_dir)
        self.manifest_path = self.root / MANIFEST
        self.index_path = self.root / INDEX
        self.journal_dir = self.root / JOURNAL
        self._arrays: dict[str, np.memmap] = {}
        self._journal: Any = None

    # -- manifest ---------------------------------------------------------------------------------
    def write_manifest(self, manifest: Mapping[str, Any]) -> None:
        """Atomically replace ``manifest.json`` (rank 0 only)."""
        write_atomic(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=False) + "\n")

    def read_manifest(self) -> dict[str, Any] | None:
        return read_manifest(self.root)

    # -- arrays -----------------------------------------------------------------------------------
    def layer_path(self, layer: str) -> Path:
        return self.root / layer_file_name(layer)

    def create_arrays(self, shapes: Mapping[str, Sequence[int]], dtype: str) -> None:
        """Preallocate every ``<layer>.npy`` (zero-filled, sparse where the filesystem allows); rank 0 only."""
        for layer, shape in shapes.items():
            array = open_memmap(self.layer_path(layer), mode="w+", dtype=np.dtype(dtype), shape=tuple(shape))
            array.flush()
            del array

    def arrays_match(self, shapes: Mapping[str, Sequence[int]], dtype: str) -> bool:
        """Whether every ``.npy`` exists whole with the expected header (a kill during creation fails this)."""
        for layer, shape in shapes.items():
            path = self.layer_path(layer)
            try:
                array = open_memmap(path, mode="r")
            except (OSError, ValueError):
                return False
            expected = array.offset + int(np.prod(shape)) * np.dtype(dtype).itemsize
            ok = tuple(array.shape) == tuple(shape) and array.dtype == np.dtype(dtype)
            del array
            if not ok or path.stat().st_size != expected:
                return False
        return True

    def open_arrays(self, layers: Iterable[str]) -> None:
        """Open every layer file for in-place writes."""
        for layer in layers:
            self._arrays[layer] = open_memmap(self.layer_path(layer), mode="r+")

    def write_rows(self, start: int, values: Mapping[str, np.ndarray]) -> None:
        """Write rows ``start:start+len`` of every layer (not yet durable: see ``commit``)."""
        for layer, value in values.items():
            self._arrays[layer][start : start + len(value)] = value

    def flush(self, start: int, stop: int) -> None:
        """Make rows ``start:stop`` durable, then drop their pages from this process (bounded memory)."""
        for array in self._arrays.values():
            array.flush()
            _drop_pages(array, start, stop)

    def close_arrays(self) -> None:
        for array in self._arrays.values():
            array.flush()
        self._arrays.clear()

    # -- journal ----------------------------------------------------------------------------------
    def reset_journal(self) -> None:
        """Forget every committed chunk (rank 0 only, before the arrays are created)."""
        shutil.rmtree(self.journal_dir, ignore_errors=True)
        self.journal_dir.mkdir(parents=True, exist_ok=True)

    def open_journal(self, rank: int) -> None:
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        path = self.journal_dir / f"rank-{rank}.jsonl"
        torn = path.exists() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
        self._journal = open(path, "a", encoding="utf-8")  # noqa: SIM115
        if torn:  # a kill cut the last line short: end it, so the next record starts on a line of its own
            self._journal.write("\n")

    def commit(self, chunk: int, start: int, stop: int, skipped: Sequence[tuple[int, str]]) -> None:
        """Record chunk ``chunk`` (rows ``start:stop``) as done, after flushing its rows to disk."""
        self.flush(start, stop)
        line = json.dumps({"chunk": chunk, "rows": [start, stop], "skipped": [list(s) for s in skipped]})
        self._journal.write(line + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def committed(self) -> dict[int, list[tuple[int, str]]]:
        """Chunk -> its skipped rows, for every chunk some rank committed (torn lines ignored)."""
        done: dict[int, list[tuple[int, str]]] = {}
        for path in sorted(self.journal_dir.glob("rank-*.jsonl")):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                    done[int(record["chunk"])] = [(int(row), str(reason)) for row, reason in record["skipped"]]
                except (ValueError, KeyError, TypeError):
                    continue  # the line a kill cut short
        return done

    def remove_journal(self) -> None:
        shutil.rmtree(self.journal_dir, ignore_errors=True)

    # -- index ------------------------------------------------------------------------------------
    def write_index(self, names: Sequence[str], invalid: Mapping[int, str]) -> None:
        """``index.csv``: ``row,valid,path`` for every row (rank 0 only)."""
        lines: list[str] = []
        buffer = _Lines(lines)
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["row", "valid", "path"])
        for row, name in enumerate(names):
            writer.writerow([row, 0 if row in invalid else 1, name])
        write_atomic(self.index_path, "".join(lines))

    def remove_outputs(self, layers: Iterable[str]) -> None:
        """Delete what an earlier dump left: arrays of ``layers``, index and journal (rank 0 only)."""
        for layer in layers:
            self.layer_path(layer).unlink(missing_ok=True)
        self.index_path.unlink(missing_ok=True)
        self.remove_journal()


class _Lines:
    """A file-like sink for csv.writer that collects lines in a list."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)


def _drop_pages(array: np.memmap, start: int, stop: int) -> None:
    """Tell the kernel this process is done with rows ``start:stop`` so they leave its resident set."""
    handle = getattr(array, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if handle is None or advice is None or array.shape[0] == 0:
        return
    row_bytes = array.strides[0]
    base = array.offset % mmap.ALLOCATIONGRANULARITY  # numpy maps from the granularity boundary below offset
    begin = base + start * row_bytes
    end = base + stop * row_bytes
    page = mmap.PAGESIZE
    begin = -(-begin // page) * page  # whole pages inside the range only
    end = end // page * page
    if end > begin:
        try:
            handle.madvise(advice, begin, end - begin)
        except (OSError, ValueError):
            pass
