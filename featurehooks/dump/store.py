"""The on-disk layout of a dump: per-layer ``.npy`` files, ``index.csv``, ``manifest.json`` and the journal.

Crash safety rests on five rules:

1. ``manifest.json`` is only ever replaced atomically (write a temporary file, fsync, ``os.replace``)
   and says ``"status": "running"`` before any ``.npy`` file is created; ``"complete"`` is written
   last, once every row is committed. A half-written output is therefore never taken for a complete one.
2. Rows are written in place (``open_memmap``) in fixed chunks; a chunk counts as done only when its
   line in the journal (``.journal/rank-<r>.jsonl``) is fsynced, and that happens after the
   memmap flush. A line that does not parse (the one a kill cut short) is ignored, so a killed run redoes
   at most one chunk per rank. A line that parses must fit the manifest it was written for (its digest,
   its chunk's rows, its rank, its checksum), or the dump is refused: rows never computed are never taken
   for done.
3. Row numbers come from the sorted input list alone, so every run writes the same bytes to the same place.
4. Each ``.npy`` file is built whole under a temporary name, with its disk space reserved
   (``posix_fallocate``), then renamed into place: a full disk is a ``NoSpaceError`` before any row is
   computed, never a SIGBUS in a memory-mapped write, and a kill never leaves a half-made array that looks whole.
5. One dump at a time per folder: ``DumpStore.lock`` (rank 0, for the dump's life) holds an exclusive
   ``flock`` on ``.lock``; a second dump is refused with a ``DumpLockedError`` naming the holder.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import io
import json
import math
import mmap
import os
import shutil
import socket
import stat
import warnings
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib import format as npy
from numpy.lib.format import open_memmap

from .._atomic import fsync_dir, set_mode, space_for, temporary, write_all, write_atomic
from ..errors import CorruptDumpError, DumpLockedError, InvalidValueError, NoSpaceError
from .manifest import INDEX, LABELS, MANIFEST, START_OVER, Manifest, is_count, layer_file_name

try:
    import fcntl
except ImportError:  # Windows: no flock, so a second writer into the same folder is not stopped there
    fcntl = None  # type: ignore[assignment]

__all__ = ["CorruptDumpError", "DumpLockedError", "DumpStore", "NoSpaceError", "read_manifest"]

JOURNAL = ".journal"
LOCK = ".lock"
_LABELS_KEY = "\0labels"  # the key of labels.npy among the open arrays: no layer can have it
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
_LOCK_TRIES = 100
_RECORD = frozenset({"chunk", "rows", "skipped", "rank", "manifest", "crc"})
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a symlink planted where featurehooks opens a file is not followed


def read_manifest(out_dir: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of the dump in ``out_dir`` (a ``Manifest``; ``.to_dict()`` is the JSON of its ``manifest.json``),
    or ``None`` when there is none.

    Raises:
        CorruptDumpError: the file exists but is not a featurehooks manifest, or a field is missing, unknown,
            mistyped or inconsistent (see ``Manifest.from_dict``).

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features, read_manifest
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> out = tempfile.mkdtemp()
        >>> read_manifest(out) is None  # no dump yet
        True
        >>> _ = dump_features(ext, torch.rand(2, 3, 8, 8), out, progress=False)
        >>> manifest = read_manifest(out)
        >>> manifest.status, manifest.num_rows, manifest.settings.shapes
        ('complete', 2, {'0': (2, 4, 6, 6)})
        >>> manifest.to_dict()["shapes"]
        {'0': [2, 4, 6, 6]}
    """
    return Manifest.read(Path(out_dir) / MANIFEST)


def write_npy_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` through ``write_atomic``: plain writes, so a full disk is a ``NoSpaceError``, never a SIGBUS."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    write_atomic(path, buffer.getvalue())


def _digest(manifest: Manifest) -> str:
    """A fingerprint of a manifest's content (not its formatting): journal lines name the manifest they belong to."""
    return hashlib.sha256(json.dumps(manifest.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _checksum(body: Mapping[str, Any]) -> int:
    """CRC-32 of a journal record without its ``crc``: a line edited by hand no longer matches it."""
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` for every line of ``path`` that parses; a line a kill cut short does not."""
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        yield number, record


def _record_problem(record: Any, rank: int, digest: str, chunk_size: int, num_rows: int) -> str | None:
    """Why a parsed journal line of rank ``rank`` cannot be trusted for the manifest ``digest``, or ``None``."""
    if not isinstance(record, dict) or set(record) != _RECORD:
        return f"its fields are not {', '.join(sorted(_RECORD))}"
    if record["crc"] != _checksum({key: value for key, value in record.items() if key != "crc"}):
        return "its checksum does not match its content"
    if record["manifest"] != digest:
        return f"it was written for another manifest than this {MANIFEST}"
    if record["rank"] != rank:
        return f"it names rank {record['rank']!r} in the journal of rank {rank}"
    chunk, last = record["chunk"], -(-num_rows // chunk_size) - 1
    if not is_count(chunk) or chunk > last:
        return f"chunk {chunk!r} is not one of 0..{last}"
    start, stop = chunk * chunk_size, min((chunk + 1) * chunk_size, num_rows)
    if record["rows"] not in ([start, stop], [start, start + chunk_size]):  # the last chunk's end may run past
        return f"rows {record['rows']!r} are not chunk {chunk}'s rows [{start}, {stop}] (chunk_size {chunk_size})"
    if not _skipped_fit(record["skipped"], start, stop):
        return f"skipped {record['skipped']!r} is not a list of distinct [row, reason] in rows [{start}, {stop})"
    return None


def _skipped_of(record: Mapping[str, Any]) -> list[tuple[int, str]]:
    """The ``(row, reason)`` pairs a checked journal record lists as invalid."""
    return [(row, why) for row, why in record["skipped"]]


def _conflict(record: Mapping[str, Any], done: Mapping[int, list[tuple[int, str]]]) -> str | None:
    """Why a checked record contradicts an earlier commit of its chunk (the same commit again is fine), or ``None``."""
    earlier = done.get(record["chunk"])
    if earlier is None or earlier == _skipped_of(record):
        return None
    return f"chunk {record['chunk']} was committed before with other skipped rows"


def _skipped_fit(skipped: Any, start: int, stop: int) -> bool:
    """Whether ``skipped`` lists distinct ``[row, reason]`` pairs with ``start <= row < stop`` and a reason."""
    if not isinstance(skipped, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in skipped):
        return False
    rows = [row for row, _ in skipped]
    fit = all(is_count(row) and start <= row < stop and isinstance(why, str) and why for row, why in skipped)
    return fit and len(set(rows)) == len(rows)


def _npy_header(shape: Sequence[int], dtype: str) -> bytes:
    """The header numpy writes for a C-ordered array of ``shape`` and ``dtype`` (``np.save``, ``open_memmap``)."""
    buffer = io.BytesIO()
    header = {"descr": npy.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    npy.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def _data_bytes(shape: Sequence[int], dtype: str) -> int:
    """Bytes of the values of an array of ``shape`` and ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize


def _reserve(fd: int, size: int) -> bool:
    """Allocate the disk blocks of ``fd``'s first ``size`` bytes now; ``False`` where the OS or filesystem cannot."""
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        return False
    try:
        allocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_FALLOCATE:
            return False
        raise
    return True


def _create_npy(fd: int, header: bytes, size: int) -> int:
    """Make the new file ``fd`` a zero-filled ``.npy`` of ``size`` bytes and close it; returns how many bytes
    are not reserved on disk."""
    try:
        set_mode(fd)
        os.ftruncate(fd, size)
        reserved = _reserve(fd, size)
        write_all(fd, header)
        os.fsync(fd)
    finally:
        os.close(fd)
    return 0 if reserved else size


def _ends_torn(path: Path) -> bool:
    """Whether ``path`` ends in a line a kill cut short (no final newline)."""
    with open(path, "rb") as handle:
        if handle.seek(0, os.SEEK_END) == 0:
            return False
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) != b"\n"


def _take_lock(path: Path) -> int:
    """An fd holding an exclusive ``flock`` on the file at ``path`` (never on one its last holder unlinked)."""
    for _ in range(_LOCK_TRIES):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o666)
        except FileNotFoundError:  # a releasing holder removed the folder it had made: make it again
            continue
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise DumpLockedError(
                f"{path} is a symbolic link, not a lock file featurehooks made: it is neither followed nor "
                "written; remove it and run the dump again"
            ) from None
        if not _is_plain_file(fd):
            os.close(fd)
            raise DumpLockedError(
                f"{path} is not a plain file of its own (a hard link to another file, or a device): it is not "
                "written; remove it and run the dump again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise DumpLockedError(
                f"{path.parent} is being written by another dump ({holder}); wait for it to end, or stop it"
            ) from None
        except OSError:
            os.close(fd)
            raise
        if _is_linked(fd, path):
            return fd
        os.close(fd)  # the holder released it between our open and our flock: lock the file there now
    raise DumpLockedError(f"{path.parent} keeps changing hands: other dumps are starting and ending there")


def _is_plain_file(fd: int) -> bool:
    """Whether ``fd`` is a regular file with no other name (so truncating it cannot touch another file)."""
    info = os.fstat(fd)
    return stat.S_ISREG(info.st_mode) and info.st_nlink <= 1


def _is_linked(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a releasing holder unlinks it before letting go)."""
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(fd: int) -> str:
    """``pid N on host H`` as the holder of a lock file wrote it, or ``pid unknown`` if it has not yet."""
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(info['pid'])} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


def check_dump_folder(out_dir: str | os.PathLike[str]) -> None:
    """Refuse an ``out_dir`` that is a file or lies under one: a dump is a folder (else ``mkdir`` says only
    ``File exists``)."""
    out = Path(out_dir)
    for path in (out, *out.parents):
        if path.is_dir():
            return
        if os.path.lexists(path):
            where = f"{out} is" if path == out else f"{out}: {path} is"
            raise InvalidValueError(
                f"{where} a file, not a dump folder; name a new folder, or one that holds a dump (finished with "
                "resume=True (--resume), replaced with overwrite=True (--overwrite))"
            )


class DumpStore:
    """Files of one dump in ``out_dir``; every method is safe to call from any rank unless noted."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        check_dump_folder(out_dir)
        self.root = Path(out_dir)
        self.manifest_path = self.root / MANIFEST
        self.index_path = self.root / INDEX
        self.journal_dir = self.root / JOURNAL
        self.lock_path = self.root / LOCK
        self._arrays: dict[str, np.memmap] = {}
        self._journal: int | None = None
        self._journal_tag: tuple[int, str] = (0, "")  # this rank, and the digest of the manifest it commits for
        self._lock: int | None = None
        self._made_root = False  # whether lock() created out_dir, which unlock() then removes if still empty

    # -- lock -------------------------------------------------------------------------------------
    def lock(self) -> None:
        """Take ``out_dir`` (created if needed) for one dump until ``unlock``: rank 0 only, before planning.

        An exclusive ``flock`` on ``.lock``, which names the holder's pid and host. The ranks of one dump do
        not take it (rank 0 holds it for them all); the kernel drops it when its process dies, so a stale
        file never blocks. Where the filesystem has no ``flock``, the dump goes on unguarded, with a warning.

        Raises:
            DumpLockedError: another process holds the folder.
        """
        if self._lock is not None or fcntl is None:
            return
        made = not self.root.exists()
        try:
            fd = _take_lock(self.lock_path)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            warnings.warn(f"cannot lock {self.root} ({exc}): a second dump into it would not be stopped", stacklevel=2)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        self._lock, self._made_root = fd, made

    def unlock(self) -> None:
        """Give the folder back: remove ``.lock`` while still holding it, then release it.

        A folder that ``lock`` created and nothing else was written to goes too: a refused dump leaves no trace.
        """
        if self._lock is None:
            return
        self.lock_path.unlink(missing_ok=True)
        os.close(self._lock)
        self._lock = None
        if self._made_root:
            with contextlib.suppress(OSError):  # not empty: the dump wrote there
                self.root.rmdir()

    # -- manifest ---------------------------------------------------------------------------------
    def write_manifest(self, manifest: Manifest) -> None:
        """Atomically replace ``manifest.json`` (rank 0 only)."""
        write_atomic(self.manifest_path, manifest.to_json())

    def read_manifest(self) -> Manifest | None:
        """The manifest of this dump, or ``None`` when there is none (``CorruptDumpError`` when it is unfit)."""
        return Manifest.read(self.manifest_path)

    def _require_manifest(self) -> Manifest:
        """The manifest, which a journal cannot be read or written without."""
        manifest = self.read_manifest()
        if manifest is None:
            raise CorruptDumpError(f"{self.manifest_path} is missing, so its journal means nothing; {START_OVER}")
        return manifest

    # -- arrays -----------------------------------------------------------------------------------
    def layer_path(self, layer: str) -> Path:
        return self.root / layer_file_name(layer)

    def create_arrays(self, shapes: Mapping[str, Sequence[int]], dtype: str) -> None:
        """Create every ``<layer>.npy`` whole and zero-filled, its disk space reserved up front (rank 0 only).

        Rows are written through memory maps, where a full disk is a SIGBUS that kills the process. The space
        is reserved here (``posix_fallocate``; where the filesystem cannot, the free space is checked instead),
        so a dump that does not fit fails before any row is computed. Files are built under temporary names
        and renamed once whole: a failure leaves none, a kill only temporary files that ``remove_outputs`` deletes.

        Raises:
            NoSpaceError: the arrays do not fit on the output's filesystem.
        """
        headers = {layer: _npy_header(shape, dtype) for layer, shape in shapes.items()}
        sizes = {layer: len(headers[layer]) + _data_bytes(shape, dtype) for layer, shape in shapes.items()}
        temps: dict[str, Path] = {}
        with space_for(self.root, f"create {len(shapes)} array file(s)", sum(sizes.values())):
            try:
                unreserved = 0
                for layer in shapes:
                    fd, temps[layer] = temporary(self.layer_path(layer))
                    unreserved += _create_npy(fd, headers[layer], sizes[layer])
                if unreserved > shutil.disk_usage(self.root).free:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                for layer, temp in temps.items():
                    os.replace(temp, self.layer_path(layer))
            finally:
                for temp in temps.values():
                    temp.unlink(missing_ok=True)
        fsync_dir(self.root)

    def arrays_match(self, shapes: Mapping[str, Sequence[int]], dtype: str) -> bool:
        """Whether every ``.npy`` exists whole, with exactly the header ``create_arrays`` writes (C order)."""
        for layer, shape in shapes.items():
            path = self.layer_path(layer)
            header = _npy_header(shape, dtype)
            try:
                with open(path, "rb") as handle:
                    same = handle.read(len(header)) == header
                size = path.stat().st_size
            except OSError:
                return False
            if not same or size != len(header) + _data_bytes(shape, dtype):
                return False
        return True

    def open_arrays(self, layers: Iterable[str]) -> None:
        """Open every layer file (and ``labels.npy`` when the dump has one) for in-place writes."""
        for layer in layers:
            self._arrays[layer] = open_memmap(self.layer_path(layer), mode="r+")
        if (self.root / LABELS).is_file():
            self._arrays[_LABELS_KEY] = open_memmap(self.root / LABELS, mode="r+")

    def create_labels(self, num_rows: int) -> None:
        """Create ``labels.npy`` filled with -1 (rank 0, with the arrays), by plain writes: every block exists
        before rows are written through its map, so a full disk is an error here, never a SIGBUS later."""
        write_npy_atomic(self.root / LABELS, np.full(num_rows, -1, dtype=np.int64))

    def labels_match(self, num_rows: int) -> bool:
        """Whether ``labels.npy`` exists whole, as ``create_labels`` writes it."""
        try:
            labels = np.load(self.root / LABELS, mmap_mode="r")
        except (OSError, ValueError):
            return False
        return labels.shape == (num_rows,) and labels.dtype == np.int64

    def write_labels(self, start: int, labels: Sequence[int]) -> None:
        """Write labels of rows ``start:start+len`` (made durable with the rows, by ``commit``)."""
        self._arrays[_LABELS_KEY][start : start + len(labels)] = labels

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
        """Forget every committed chunk (rank 0 only, before the arrays are created).

        Fails loudly: a journal left in place would mark chunks of the new dump as done.
        """
        try:
            shutil.rmtree(self.journal_dir)
        except FileNotFoundError:
            pass
        self.journal_dir.mkdir(parents=True, exist_ok=True)

    def open_journal(self, rank: int) -> None:
        """Open rank ``rank``'s journal for appending; its records will name the manifest now on disk."""
        self._journal_tag = (rank, _digest(self._require_manifest()))
        self.journal_dir.mkdir(parents=True, exist_ok=True)
        path = self.journal_dir / f"rank-{rank}.jsonl"
        self._journal = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o666)
        if _ends_torn(path):  # a kill cut the last line short: end it, so the next record starts on a line of its own
            self._append(b"\n", "end a torn journal line")

    def _append(self, data: bytes, what: str) -> None:
        """Append ``data`` to this rank's journal and make it durable."""
        fd = self._journal
        if fd is None:
            raise RuntimeError("open_journal(rank) before committing")
        with space_for(self.root, what, len(data)):
            write_all(fd, data)
            os.fsync(fd)

    def commit(self, chunk: int, start: int, stop: int, skipped: Sequence[tuple[int, str]]) -> None:
        """Record chunk ``chunk`` (rows ``start:stop``) as done, after flushing its rows to disk."""
        self.commit_chunks([(chunk, start, stop, skipped)])

    def commit_chunks(self, chunks: Sequence[tuple[int, int, int, Sequence[tuple[int, str]]]]) -> None:
        """Record several ``(chunk, start, stop, skipped)`` as done: one flush of their rows, one fsynced write."""
        if not chunks:
            return
        self.flush(min(start for _, start, _, _ in chunks), max(stop for _, _, stop, _ in chunks))
        rank, digest = self._journal_tag
        lines = []
        for chunk, start, stop, skipped in chunks:
            body = {
                "chunk": chunk,
                "rows": [start, stop],
                "skipped": [list(pair) for pair in skipped],
                "rank": rank,
                "manifest": digest,
            }
            lines.append(json.dumps({**body, "crc": _checksum(body)}) + "\n")
        rows = f"{chunks[0][1]}:{chunks[-1][2]}"
        self._append("".join(lines).encode(), f"commit rows {rows}")

    def close_journal(self) -> None:
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None

    def committed(self) -> dict[int, list[tuple[int, str]]]:
        """Chunk -> its skipped rows, for every chunk some rank committed (lines a kill cut short ignored).

        Raises:
            CorruptDumpError: a line parses but does not fit ``manifest.json`` (another manifest, a checksum
                that does not match, rows that are not its chunk's, a chunk committed twice differently):
                the dump is refused rather than rows never computed taken for done.
        """
        manifest = self._require_manifest()
        expected = (_digest(manifest), manifest.chunk_size, manifest.num_rows)
        done: dict[int, list[tuple[int, str]]] = {}
        for path in sorted(self.journal_dir.glob("rank-*.jsonl")):
            rank = path.name[len("rank-") : -len(".jsonl")]
            if not rank.isdigit():
                continue  # not a journal this store writes
            for number, record in _records(path):
                problem = _record_problem(record, int(rank), *expected) or _conflict(record, done)
                if problem:
                    raise CorruptDumpError(
                        f"{path} line {number}: {problem}; the journal does not fit {MANIFEST} "
                        f"(edited by hand, or left by another dump): {START_OVER}"
                    )
                done[record["chunk"]] = _skipped_of(record)
        return done

    def remove_journal(self) -> None:
        shutil.rmtree(self.journal_dir, ignore_errors=True)

    # -- index ------------------------------------------------------------------------------------
    def write_index(self, names: Sequence[str], invalid: Mapping[int, str]) -> None:
        """``index.csv``: ``row,valid,path`` for every row (rank 0 only); names not valid UTF-8 keep their bytes."""
        rows = (f"{row},{0 if row in invalid else 1},{_csv_field(name)}\n" for row, name in enumerate(names))
        write_atomic(self.index_path, "row,valid,path\n" + "".join(rows))

    def remove_outputs(self, layers: Iterable[str]) -> None:
        """Delete what an earlier dump left: arrays of ``layers`` and their temporary files, index, journal (rank 0).

        A temporary array a kill left behind holds reserved space, so it goes too.
        """
        for path in [*(self.layer_path(layer) for layer in layers), self.index_path, self.root / LABELS]:
            path.unlink(missing_ok=True)
            for temp in self.root.glob(f".{glob.escape(path.name)}.tmp-*"):
                temp.unlink(missing_ok=True)
        self.remove_journal()


def _csv_field(text: str) -> str:
    """``text`` as one CSV field, quoted when it holds a comma, a quote or a line break.

    ``csv.writer`` leaves a lone ``\\r`` unquoted, which splits the row for every CSV reader.
    """
    if any(ch in text for ch in ',"\r\n'):
        return '"' + text.replace('"', '""') + '"'
    return text


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
