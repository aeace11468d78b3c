"""The ``.npz`` files of statistics, manifolds and FID: written atomically, read without trusting a byte of them.

An archive is uncompressed ``np.savez`` output with a ``meta`` member, a JSON string. Reading checks before it
allocates: each member's ``.npy`` header first (``member_header``: its declared size against the bytes stored for
it, no Python objects), then its data (``read_member``, never a pickle); ``meta`` is bounded in size and nesting
before it is parsed (``read_meta``).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .._atomic import write_atomic
from ..errors import InvalidValueError

__all__ = ["check_real", "json_depth", "member_header", "open_npz", "read_member", "read_meta", "write_npz"]

_MAX_META_BYTES = 1 << 20  # meta is a short JSON text (format, counts, sampling state, origin)
_MAX_META_DEPTH = 32  # nesting of meta's lists and objects (what statistics save is 4 deep)
_MAX_DEFLATE_RATIO = 1100  # deflate cannot expand data more than ~1032 times: a member declaring more lies
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')

Header = tuple[tuple[int, ...], np.dtype]


def write_npz(path: str | os.PathLike[str], meta: dict[str, Any], **arrays: np.ndarray) -> Path:
    """Write ``arrays`` and ``meta`` (a JSON string member) to an uncompressed ``.npz`` at exactly ``path``,
    atomically: the file format of statistics and manifolds."""
    buffer = io.BytesIO()
    members: dict[str, Any] = {**arrays, "meta": np.array(json.dumps(meta))}
    np.savez(buffer, **members)
    target = Path(path)
    write_atomic(target, buffer.getvalue())
    return target


def open_npz(where: str) -> zipfile.ZipFile:
    """The archive ``where`` opened for reading (use it in ``with``), refused unless it is a zip file."""
    if not zipfile.is_zipfile(where):
        raise InvalidValueError("it is not an .npz archive (a pickle, a single .npy array, or a damaged file)")
    return zipfile.ZipFile(where)


def read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """The checked member ``info`` as an array (never a pickle)."""
    with archive.open(info) as handle:
        return np.lib.format.read_array(handle, allow_pickle=False)


def member_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, archive_size: int) -> Header:
    """``(shape, dtype)`` from the ``.npy`` header of ``info``, once its sizes are known to be consistent."""
    name = info.filename
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size or info.compress_size > archive_size:
            raise InvalidValueError(f"its {name} declares {info.file_size:,} bytes but stores {info.compress_size:,}")
    elif info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 4096:
        raise InvalidValueError(
            f"its {name} declares {info.file_size:,} bytes, more than {info.compress_size:,} compressed bytes can hold"
        )
    with archive.open(info) as handle:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
        else:
            raise InvalidValueError(f"its {name} is an .npy of version {version}, not 1.0 or 2.0")
        header_size = handle.tell()
    if dtype.hasobject:
        raise InvalidValueError(f"its {name} holds Python objects (a pickle), which are never read")
    declared = header_size + math.prod(shape) * dtype.itemsize
    if declared != info.file_size:
        raise InvalidValueError(
            f"its {name} declares shape {shape} of {dtype} ({declared:,} bytes) in a member of {info.file_size:,}"
        )
    return tuple(shape), dtype


def check_real(name: str, dtype: np.dtype) -> None:
    """Refuse a member ``name`` whose header declares anything but real numbers (floats or integers)."""
    if dtype.kind not in "fiu":
        raise InvalidValueError(f"its {name} holds {dtype}, not real numbers")


def read_meta(archive: zipfile.ZipFile, info: zipfile.ZipInfo, header: Header, expected: str) -> dict[str, Any]:
    """``meta`` parsed, its size and nesting bounded before parsing, its ``format`` checked to be ``expected``."""
    shape, dtype = header
    if shape != () or dtype.kind != "U":
        raise InvalidValueError("its meta is not a JSON string")
    if info.file_size > _MAX_META_BYTES:
        raise InvalidValueError(f"its meta is {info.file_size:,} bytes, more than {_MAX_META_BYTES:,}")
    text = str(read_member(archive, info)[()])
    depth = json_depth(text)
    if depth > _MAX_META_DEPTH:
        raise InvalidValueError(f"its meta nests {depth} levels deep, more than {_MAX_META_DEPTH}")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise InvalidValueError(f"its meta is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != expected:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InvalidValueError(f"format {found!r}, expected {expected!r}")
    return meta


def json_depth(text: str) -> int:
    """How deep the lists and objects of JSON ``text`` nest (strings, whose brackets do not count, skipped)."""
    depth = deepest = 0
    for char in _JSON_STRING.sub('""', text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
