"""Rows inside container files, named ``<container>/<inner>``: which container a name is inside, its rows, one row
read, and the containers a process holds open.

Containers are ZIP archives and WebDataset tar shards (``archives``) and ``.npy``/``.npz`` arrays (``arrays``), told
apart by suffix. A row's name says all there is to read it (``/data/x.zip/a/b.png``, ``/data/s.tar/key``,
``/data/x.npy/17``, ``/data/x.npz/arr_0/17``), so decoding workers and torchrun ranks need the names only, and a
list of names given back as a source (as the CLI does) lists the same rows. The container of a name is the shortest
prefix, up to a ``/``, that ends in one of ``CONTAINER_SUFFIXES`` and is a regular file: a file has no children, so
no name is both a file and a row of a container. Everything after that ``/`` is the inner name, as the container
wrote it (a ZIP member ``../x.png`` is row ``/data/x.zip/../x.png``: a name, never a place on disk).

Each process holds up to ``_HELD`` containers open (ZIP directories and tar headers read once), reopening one whose
file changed; a forked decoding worker starts with none, so no two processes share a file offset.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from ..images import image_size, read_image
from .archives import TarShard, ZipArchive
from .arrays import NpyArray, NpzArrays

__all__ = ["CONTAINER_SUFFIXES", "Container", "container_of", "identity_path", "opened", "read_row", "row_size"]


class Container(Protocol):
    """What a container answers: the inner names a source names (``None``: all its rows), a row, its size."""

    path: str

    def names(self, inner: str | None) -> list[str]: ...

    def read(self, inner: str) -> Tensor: ...

    def size(self, inner: str) -> tuple[int, int]: ...

    def close(self) -> None: ...


_OPENERS: dict[str, Callable[[str], Container]] = {
    ".zip": ZipArchive,
    ".tar": TarShard,
    ".npy": NpyArray,
    ".npz": NpzArrays,
}
CONTAINER_SUFFIXES = tuple(_OPENERS)
_HELD = 8
_open: OrderedDict[str, tuple[tuple[int, int, int], Container]] = OrderedDict()


def _forget_inherited() -> None:
    _open.clear()  # the parent's handles: dropped, not closed (closing here would not touch the parent's)


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere workers are spawned, and start with nothing open
    os.register_at_fork(after_in_child=_forget_inherited)


def container_of(name: str, is_file: Callable[[str], bool] = os.path.isfile) -> tuple[str, str | None] | None:
    """``(container, inner)`` of a row name, ``(container, None)`` for a container itself, ``None`` for any other
    path; ``container`` is absolute. ``is_file`` answers whether a path is a regular file (a caching one may be
    passed when many names share few containers)."""
    lower = name.lower()
    cuts = [i for i, char in enumerate(name) if char == "/"] + [len(name)]
    for cut in cuts:
        if cut and lower[:cut].endswith(CONTAINER_SUFFIXES) and is_file(name[:cut]):
            inner = name[cut + 1 :]
            return os.path.abspath(name[:cut]), inner or None
    return None


def opened(path: str) -> Container:
    """The container at ``path`` (absolute), opened once per process and while its file is unchanged."""
    info = os.stat(path)
    stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
    held = _open.pop(path, None)
    if held is not None:
        if held[0] == stamp:
            _open[path] = held
            return held[1]
        held[1].close()
    container = _OPENERS[os.path.splitext(path)[1].lower()](path)
    _open[path] = (stamp, container)
    while len(_open) > _HELD:
        _, (_, oldest) = _open.popitem(last=False)
        oldest.close()
    return container


def read_row(name: str) -> Tensor:
    """The pixels of row ``name``: an image file's (``read_image``), or a container's row, as ``read_image`` gives
    them ((3, H, W), ``uint8`` for 8-bit images)."""
    found = container_of(name)
    if found is None or found[1] is None:
        return read_image(name)
    return opened(found[0]).read(found[1])


def row_size(name: str) -> tuple[int, int]:
    """(H, W) of row ``name`` from a header (no pixel decoded): ``image_size`` of a file, or of a container's row."""
    found = container_of(name)
    if found is None or found[1] is None:
        return image_size(name)
    return opened(found[0]).size(found[1])


def identity_path(name: str, is_file: Callable[[str], bool] = os.path.isfile) -> str:
    """The file whose size and modification time stand for row ``name``: its container, or the file itself."""
    found = container_of(name, is_file)
    return name if found is None else found[0]
