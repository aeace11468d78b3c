"""Rows of ``.npy`` and ``.npz`` arrays of images: ``uint8`` pixels, (N, H, W, C) or (N, C, H, W), C 1 or 3.

The ADM convention (guided-diffusion's samples, EDM's reference batches) is an ``.npz`` whose ``arr_0`` holds the
images; another array of it is named by its key (``samples.npz/images``). Nothing is ever unpickled: an array's
header is read (``numpy.lib.format``, a literal) and an array of Python objects refused from it. A row is read
alone: a ``.npy``, or an ``.npz`` member stored without compression (``np.savez``), through a read-only memory map;
a compressed member (``np.savez_compressed``) through one stream a process, which inflates forward to each row
asked for (decoding workers ask for rising rows) and starts over only for an earlier one.

The layout is read from the shape: channels last when the last axis is 1 or 3 and the second is not, first when
the second is and the last is not; both or neither is refused. Rows come out as ``read_image`` returns a file's
pixels ((3, H, W) ``uint8``, a view of (H, W, 3); one channel repeated to three, as for a grayscale PNG), so the
same ``ImageTransform`` gives them the same pixels as the same images saved as PNG files.
"""

from __future__ import annotations

import struct
import zipfile
from typing import BinaryIO, cast

import numpy as np
import torch
from numpy.lib import format as npy_format
from torch import Tensor

from .. import images
from ..errors import InputNotFoundError, InvalidTypeError, InvalidValueError
from .archives import open_zip

__all__ = ["NpyArray", "NpzArrays", "DEFAULT_KEY"]

DEFAULT_KEY = "arr_0"  # what np.savez names its first positional array
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # a ZIP member's local file header (zipfile's structFileHeader)
_LOCAL_SIGNATURE = b"PK\003\004"


class _Images:
    """One array of images: its shape checked from the header, each row as a (3, H, W) ``uint8`` tensor."""

    def __init__(self, where: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        if dtype.hasobject:
            raise InvalidTypeError(f"{where} holds Python objects (a pickle); it is refused, never unpickled")
        if dtype != np.uint8:
            raise InvalidTypeError(f"{where} holds {dtype}; images must be uint8 pixels (0..255)")
        if len(shape) != 4:
            raise InvalidValueError(f"{where} has shape {shape}; images must be (N, H, W, C) or (N, C, H, W)")
        last, second = shape[3] in (1, 3), shape[1] in (1, 3)
        if last == second:
            which = "could be" if last else "has neither"
            raise InvalidValueError(
                f"{where} has shape {shape}, which {which} (N, H, W, C) or (N, C, H, W) with C 1 or 3; "
                "save it as (N, H, W, C)"
            )
        self.channels_last = last
        self.count = shape[0]
        self.height, self.width = (shape[1], shape[2]) if last else (shape[2], shape[3])
        if self.height * self.width > images.MAX_DECODED_PIXELS:
            raise InvalidValueError(
                f"{where} holds images of {self.width}x{self.height} pixels, over MAX_DECODED_PIXELS = "
                f"{images.MAX_DECODED_PIXELS} (featurehooks.images)"
            )
        self.shape = shape
        self.where = where

    def names(self, index: str | None) -> list[str]:
        if self.count == 0:
            raise InputNotFoundError(f"no images in {self.where} (0 rows)")
        if index is None:
            return [str(row) for row in range(self.count)]
        return [str(self.row_number(index))]

    def row_number(self, index: str) -> int:
        """The row a name's index says: its decimal number, written as ``str(row)`` writes it."""
        if not index.isdigit() or str(int(index)) != index or int(index) >= self.count:
            raise InputNotFoundError(f"no row {index!r} in {self.where} (rows 0..{self.count - 1})")
        return int(index)

    def pixels(self, row: np.ndarray) -> Tensor:
        """(3, H, W) ``uint8``, a view of a fresh (H, W, 3) array, from one row as stored."""
        hwc = row if self.channels_last else row.transpose(1, 2, 0)
        fresh = np.repeat(hwc, 3, axis=2) if hwc.shape[2] == 1 else np.array(hwc, order="C")  # off the map
        return torch.from_numpy(fresh).permute(2, 0, 1)

    def size(self) -> tuple[int, int]:
        return self.height, self.width


def _header(handle: BinaryIO, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) from an ``.npy`` header: a literal, never unpickled."""
    try:
        version = npy_format.read_magic(handle)
        if version == (1, 0):
            return npy_format.read_array_header_1_0(handle)
        if version == (2, 0):
            return npy_format.read_array_header_2_0(handle)
    except ValueError as exc:
        raise InvalidValueError(f"{where} is not a NumPy array file ({exc})") from None
    raise InvalidValueError(f"{where} is a NumPy array file of version {version}; versions 1.0 and 2.0 are read")


class NpyArray:
    """The images of the ``.npy`` file ``path``, memory-mapped read-only; a row's name is its number."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as handle:
            shape, _, dtype = _header(handle, path)
        self._images = _Images(path, shape, dtype)  # refuses objects before np.load could see them
        self._array = np.load(path, mmap_mode="r", allow_pickle=False)

    def names(self, inner: str | None) -> list[str]:
        return self._images.names(inner)

    def read(self, inner: str) -> Tensor:
        return self._images.pixels(self._array[self._images.row_number(inner)])

    def size(self, inner: str) -> tuple[int, int]:
        self._images.row_number(inner)
        return self._images.size()

    def close(self) -> None:
        mapped = getattr(self._array, "_mmap", None)
        del self._array
        if mapped is not None:
            mapped.close()


class _Member:
    """One array of an ``.npz``: memory-mapped when stored, else read through one inflating stream."""

    def __init__(self, path: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, key: str) -> None:
        where = f"array {key!r} of {path}"
        if info.flag_bits & 0x1:
            raise InvalidValueError(f"{where} is encrypted")
        self._archive, self._info = archive, info
        with archive.open(info) as handle:
            shape, fortran, dtype = _header(handle, where)  # type: ignore[arg-type]
            offset = handle.tell()  # the header's length: pixels start here within the member
        self.images = _Images(where, shape, dtype)
        self._row_bytes = int(np.prod(shape[1:]))
        self._offset = offset
        self._map: np.ndarray | None = None
        self._stream: BinaryIO | None = None
        if info.compress_type == zipfile.ZIP_STORED:
            start = _data_start(path, info) + offset
            self._map = np.memmap(
                path, dtype=np.uint8, mode="r", offset=start, shape=shape, order="F" if fortran else "C"
            )
        elif fortran:
            raise InvalidValueError(
                f"{where} is compressed and in Fortran order, so a row cannot be read alone; save it C-ordered"
            )

    def read(self, row: int) -> Tensor:
        if self._map is not None:
            return self.images.pixels(self._map[row])
        stream = self._stream
        if stream is None:
            stream = cast(BinaryIO, self._archive.open(self._info))
            self._stream = stream
        stream.seek(self._offset + row * self._row_bytes)  # forward: inflates on; backward: starts over
        data = stream.read(self._row_bytes)
        if len(data) != self._row_bytes:
            raise InvalidValueError(f"{self.images.where} is cut short at row {row}")
        return self.images.pixels(np.frombuffer(data, np.uint8).reshape(self.images.shape[1:]))

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        mapped = getattr(self._map, "_mmap", None)
        self._map = None
        if mapped is not None:
            mapped.close()


def _data_start(path: str, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes begin in the file: after its local header, whose name and extra field may
    differ in length from the central directory's."""
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(handle.read(_LOCAL_HEADER.size))
    if fields[0] != _LOCAL_SIGNATURE:
        raise InvalidValueError(f"{path}: member {info.filename!r} has no local header where its directory says")
    return info.header_offset + _LOCAL_HEADER.size + fields[10] + fields[11]


class NpzArrays:
    """The image arrays of the ``.npz`` file ``path``: a row's name is ``<key>/<row>`` (``arr_0/17``), a source
    names a key (``x.npz/images``) or none for ``arr_0``. Arrays are opened when first named."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = open_zip(path, "an .npz file")
        arrays = (info for info in self._zip.infolist() if info.filename.endswith(".npy"))
        self._keys = {info.filename[: -len(".npy")]: info for info in arrays}
        self._open: dict[str, _Member] = {}

    def names(self, inner: str | None) -> list[str]:
        if inner is None or inner in self._keys:
            key = DEFAULT_KEY if inner is None else inner
            return [f"{key}/{row}" for row in self._member(key).images.names(None)]
        key, row = self._split(inner)
        return [f"{key}/{row}" for row in self._member(key).images.names(row)]

    def read(self, inner: str) -> Tensor:
        key, row = self._split(inner)
        member = self._member(key)
        return member.read(member.images.row_number(row))

    def size(self, inner: str) -> tuple[int, int]:
        key, row = self._split(inner)
        member = self._member(key)
        member.images.row_number(row)
        return member.images.size()

    def close(self) -> None:
        for member in self._open.values():
            member.close()
        self._zip.close()

    def _split(self, inner: str) -> tuple[str, str]:
        key, _, row = inner.rpartition("/")
        if not key:
            self._member(inner)  # raises, naming the arrays there are
        return key, row

    def _member(self, key: str) -> _Member:
        if key not in self._open:
            info = self._keys.get(key)
            if info is None:
                held = ", ".join(sorted(self._keys)) or "none"
                raise InputNotFoundError(
                    f"no array {key!r} in {self.path} (its arrays: {held}); name one as {self.path}/<key>"
                )
            self._open[key] = _Member(self.path, self._zip, info, key)
        return self._open[key]
