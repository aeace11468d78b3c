"""The ``.npz`` files of statistics, manifolds and FID: written atomically, read without trusting a byte of them.

An archive is uncompressed ``np.savez`` output with a ``meta`` member, a JSON string. ``read_npz`` is the one
reader of every such file featurehooks loads (statistics, pytorch-fid's and TTUR's mu/sigma, manifolds), and
it checks before it allocates: each member's ``.npy`` header first (``member_header``: its declared size against
the bytes stored for it, no Python objects), ``meta`` bounded in size and nesting before it is parsed
(``read_meta``), the shapes against what the caller expects, and the bytes the arrays unpack to against a budget
and against the file's own size (real features and covariances barely compress: an archive that unpacks to
many times its size holds zeros, or lies); only then the data (``read_member``, never a pickle). Every failure
is one ``InvalidValueError`` naming the file.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._atomic import write_atomic
from ..errors import InputNotFoundError, InvalidValueError

__all__ = ["Check", "Header", "Mismatch", "read_npz", "write_npz"]

_MAX_META_BYTES = 1 << 20  # meta is a short JSON text (format, counts, sampling state, origin)
_MAX_META_DEPTH = 32  # nesting of meta's lists and objects (what statistics save is 4 deep)
_MAX_DEFLATE_RATIO = 1100  # deflate cannot expand data more than ~1032 times: a member declaring more lies
_MAX_BYTES = 1 << 33  # what one file may unpack to: 8 GiB (a 2048-feature covariance is 32 MiB)
_FREE_BYTES = 1 << 24  # what any file may unpack to, however small (a constant covariance compresses 1000x)
_MAX_INFLATION = 16  # beyond that, what a file may unpack to per byte it holds (real numbers barely compress)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_CORRUPT = (  # what numpy, zipfile and zlib raise on a damaged or hostile archive
    ValueError,
    OSError,
    KeyError,
    TypeError,
    EOFError,
    OverflowError,
    RecursionError,
    MemoryError,
    NotImplementedError,
    zipfile.BadZipFile,
    zlib.error,
)

Header = tuple[tuple[int, ...], np.dtype]
Check = Callable[[dict[str, Header], dict[str, Any] | None], None]


class Mismatch(Exception):
    """A well-formed file that is not what the caller expects (another dimension): ``read_npz`` says so after the
    file's name, not as a damaged file."""


def write_npz(path: str | os.PathLike[str], meta: dict[str, Any], **arrays: np.ndarray) -> Path:
    """Write ``arrays`` and ``meta`` (a JSON string member) to an uncompressed ``.npz`` at exactly ``path``,
    atomically: the file format of statistics and manifolds."""
    buffer = io.BytesIO()
    members: dict[str, Any] = {**arrays, "meta": np.array(json.dumps(meta))}
    np.savez(buffer, **members)
    target = Path(path)
    write_atomic(target, buffer.getvalue())
    return target


def read_npz(
    path: str | os.PathLike[str],
    what: str,
    arrays: Sequence[str],
    *,
    meta_format: str | tuple[str, ...] | None = None,
    exact: bool = False,
    check: Check | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """The members ``arrays`` of the ``.npz`` at ``path`` and its parsed ``meta``, each checked before it is read.

    Args:
        path: the file.
        what: what it should be, for messages (``"featurehooks statistics file"``).
        arrays: the array members to read (``"mu"`` for ``mu.npy``); each must hold real numbers.
        meta_format: the ``format`` a ``meta`` member must name (or one of them, a tuple); ``None``: no meta is read.
        exact: refuse members other than ``arrays`` and ``meta``.
        check: called with every read member's ``(shape, dtype)`` and the meta before any data is read: raises
            ``InvalidValueError`` for a file that is no ``what``, ``Mismatch`` for one the caller did not expect.

    Raises:
        InputNotFoundError: no such file.
        InvalidValueError: anything else, in one line naming the file.
    """
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise InputNotFoundError(f"no {what} {where}")
    try:
        return _read(where, arrays, meta_format, exact, check)
    except Mismatch as exc:
        raise InvalidValueError(f"{where} {exc}") from None
    except InvalidValueError as exc:
        raise InvalidValueError(f"{where} is not a {what}: {exc}") from None
    except _CORRUPT as exc:
        raise InvalidValueError(f"{where} is not a {what} ({str(exc).strip()[:200]})") from None


def _read(
    where: str, arrays: Sequence[str], meta_format: str | tuple[str, ...] | None, exact: bool, check: Check | None
) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    names = [*arrays, "meta"] if meta_format is not None else list(arrays)
    with open_npz(where) as archive:
        members = {info.filename: info for info in archive.infolist()}
        found = sorted(name.removesuffix(".npy") for name in members)
        if exact and set(found) != set(names):
            raise InvalidValueError(f"it holds {found}, not {sorted(names)}")
        missing = sorted(name for name in names if f"{name}.npy" not in members)
        if missing:
            plural = "s" if len(missing) > 1 else ""
            raise InvalidValueError(f"no {', '.join(missing)} array{plural} (found {', '.join(found) or 'none'})")
        size = os.path.getsize(where)
        headers = {name: member_header(archive, members[f"{name}.npy"], size) for name in names}
        meta = read_meta(archive, members["meta.npy"], headers["meta"], meta_format) if meta_format else None
        if check is not None:
            check({name: headers[name] for name in arrays}, meta)
        _check_budget(sum(members[f"{name}.npy"].file_size for name in arrays), size)
        for name in arrays:
            check_real(name, headers[name][1])
        return {name: read_member(archive, members[f"{name}.npy"]) for name in arrays}, meta


def _check_budget(unpacked: int, size: int) -> None:
    """Refuse an archive whose members unpack to more than the budget, or to many times the file's own size."""
    if unpacked > _MAX_BYTES:
        raise InvalidValueError(f"its arrays unpack to {unpacked:,} bytes, more than {_MAX_BYTES:,} (8 GiB)")
    allowed = max(_FREE_BYTES, _MAX_INFLATION * size)
    if unpacked > allowed:
        raise InvalidValueError(
            f"its arrays unpack to {unpacked:,} bytes from a file of {size:,}: more than {_MAX_INFLATION} times its "
            "size, which features and covariances never compress to (a compressed archive of zeros?)"
        )


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


def read_meta(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, header: Header, expected: str | tuple[str, ...]
) -> dict[str, Any]:
    """``meta`` parsed, its size and nesting bounded before parsing, its ``format`` checked to be ``expected`` (or
    one of them)."""
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
    formats = (expected,) if isinstance(expected, str) else expected
    found = meta.get("format") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or found not in formats:
        raise InvalidValueError(f"format {found!r}, expected {' or '.join(map(repr, formats))}")
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
