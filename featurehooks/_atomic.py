"""Crash-safe writes: a file is replaced atomically (built under a temporary name beside it, fsynced, renamed)
or not at all, and a full disk is a one-line ``NoSpaceError`` naming the bytes at stake.

Dumps (``dump.store``), statistics files and the CLI's score files write through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import NoSpaceError

__all__ = ["fsync_dir", "growing_atomic", "set_mode", "space_for", "temporary", "write_all", "write_atomic"]

_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def fsync_dir(path: Path) -> None:
    """Flush the folder ``path`` itself, so that a rename into it survives a crash (where folders can be opened)."""
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


@contextlib.contextmanager
def space_for(folder: Path, what: str, needed: int) -> Iterator[None]:
    """Turn a full disk (or quota) while doing ``what`` into a one-line ``NoSpaceError`` naming the bytes at stake."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL:
            raise
        free = shutil.disk_usage(folder).free
        raise NoSpaceError(
            errno.ENOSPC,
            f"no space left in {folder} to {what}: {needed:,} bytes needed, {free:,} available; free some space "
            "and run the dump again (resume=True / --resume finishes a started dump)",
        ) from exc


def _umask() -> int:
    """The process umask (read once, at import: reading it means setting it, which is not thread-safe)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_MODE = 0o666 & ~_umask()  # what open(path, "w") gives a new file; mkstemp makes 0600, which other users cannot read


def set_mode(fd: int) -> None:
    """Give a file made by ``mkstemp`` the permissions a plainly created one would have."""
    if hasattr(os, "fchmod"):
        os.fchmod(fd, _MODE)


def temporary(path: Path) -> tuple[int, Path]:
    """A new file ``path`` is built in before it is renamed into place, opened for writing: ``(fd, its path)``.

    Hidden, beside ``path``, with an unpredictable name created exclusively (``tempfile.mkstemp``: ``O_EXCL``,
    mode 0600), so nothing planted there in advance (a symlink to another file) is ever opened or truncated.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    return fd, Path(name)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte of ``data`` is out (a write may be short on a filling disk)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, text: str | bytes) -> None:
    """Replace ``path`` with ``text`` (or bytes) so that readers see the old or the new file, never a mix.

    The text is encoded as UTF-8 with ``surrogateescape``: a file name that is not valid UTF-8 (which Python
    holds as lone surrogates) is written as its own bytes and reads back unchanged with the same handler.
    """
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    with growing_atomic(path, len(data)) as write:
        write(data)


@contextlib.contextmanager
def growing_atomic(path: Path, expected: int = 0) -> Iterator[Callable[[str | bytes], None]]:
    """A ``write(text)`` that appends to a new file renamed onto ``path`` once the block ends without error: a file
    written as it grows (a score per pair) that readers see whole or not at all, and a failed run leaves nothing.
    Text is encoded as ``write_atomic`` encodes it; a full disk is a ``NoSpaceError`` naming the bytes at stake
    (``expected``, where the size is known before the file is made)."""
    with space_for(path.parent, f"write {path.name}", expected):
        fd, tmp = temporary(path)
    written, closed = 0, False

    def write(text: str | bytes) -> None:
        nonlocal written
        if closed:  # its descriptor may be another file's by now
            raise ValueError(f"{path.name}: write after its block ended")
        data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
        with space_for(path.parent, f"write {path.name}", written + len(data)):
            write_all(fd, data)
        written += len(data)

    try:
        try:
            yield write
            set_mode(fd)
            with space_for(path.parent, f"write {path.name}", max(written, expected)):
                os.fsync(fd)
        finally:
            closed = True
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
