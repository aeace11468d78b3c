"""Rows inside ZIP archives and WebDataset tar shards, read in place: nothing is extracted, nothing is written.

A ZIP's rows are its image members (by suffix, ``IMAGE_SUFFIXES``), sorted by name; directories and other members
are left out, as a folder leaves out other files. A tar shard's rows are its samples in the shard's order: its
members grouped by key as WebDataset groups them (the member's path up to the first dot of its base name, so
``a/001.jpg`` and ``a/001.cls`` are sample ``a/001``), each read from its image member (the first of
``TAR_IMAGE_EXTENSIONS`` it has); a sample without one is left out.

A member is read into memory, at most ``member_byte_limit()`` bytes (checked on the size the archive declares,
before anything is inflated), and decoded by ``featurehooks._decode`` exactly as an image file is. What cannot be
read safely becomes an invalid row naming why: an encrypted member, a member whose data does not match what its
archive declares (a ZIP member that inflates past its declared size fails its CRC: it is never inflated further),
a member name found twice, a link, device or FIFO in a tar (never followed), a member cut short by a truncated
shard. Member names are only names: ``../x.png`` or ``/etc/x.png`` name rows, never a place on disk.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
import zipfile
from collections.abc import Callable

from torch import Tensor

from .. import images
from .._decode import decode_pixels, header_size
from ..errors import InputNotFoundError, InvalidValueError

__all__ = ["IMAGE_SUFFIXES", "TAR_IMAGE_EXTENSIONS", "TarShard", "ZipArchive", "member_byte_limit", "open_zip"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
"""The suffixes (any case) of the files a folder or glob source lists as images (and of a ZIP's members).

Examples:
    >>> from featurehooks.dump import IMAGE_SUFFIXES
    >>> ".png" in IMAGE_SUFFIXES, ".txt" in IMAGE_SUFFIXES
    (True, False)
"""
TAR_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm")
"""The extensions (any case) a tar sample's image member may have, in the order one is chosen."""
BYTES_PER_PIXEL = 16  # no image file of MAX_DECODED_PIXELS pixels needs more (RGBA float32, uncompressed)
_WEBDATASET_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: key, extension
_END_OF_ARCHIVE = bytes(tarfile.BLOCKSIZE)
_TAR_KINDS: tuple[tuple[Callable[[tarfile.TarInfo], bool], str], ...] = (
    (tarfile.TarInfo.issym, "a symbolic link"),
    (tarfile.TarInfo.islnk, "a hard link"),
    (tarfile.TarInfo.ischr, "a character device"),
    (tarfile.TarInfo.isblk, "a block device"),
    (tarfile.TarInfo.isfifo, "a FIFO"),
    (tarfile.TarInfo.isdir, "a directory"),
    (tarfile.TarInfo.issparse, "a sparse file"),
)


def member_byte_limit() -> int:
    """Most bytes one archive member may declare: ``BYTES_PER_PIXEL`` (16) for each of ``MAX_DECODED_PIXELS``
    (1 GiB by default), read when called, so assigning ``featurehooks.images.MAX_DECODED_PIXELS`` changes it."""
    return BYTES_PER_PIXEL * images.MAX_DECODED_PIXELS


def _check_bytes(size: int, where: str) -> None:
    """Refuse a member declaring more than ``member_byte_limit()`` bytes, before a byte of it is read."""
    if size > member_byte_limit():
        raise InvalidValueError(
            f"{where} declares {size} bytes, over {BYTES_PER_PIXEL} bytes a pixel of MAX_DECODED_PIXELS = "
            f"{images.MAX_DECODED_PIXELS} (featurehooks.images); it is not inflated"
        )


def _decoded(data: bytes, name: str) -> Tensor:
    return decode_pixels(io.BytesIO(data), name, images.MAX_DECODED_PIXELS)


def _inside(names: list[str], inner: str, exact: bool, path: str, what: str) -> list[str]:
    """``[inner]`` where it names a row (``exact``), else the rows under folder ``inner``, else a clear error."""
    if exact:
        return [inner]
    prefix = inner.rstrip("/") + "/"
    found = [name for name in names if name.startswith(prefix)]
    if not found:
        raise InputNotFoundError(f"no {what} or folder {inner!r} in {path}")
    return found


def open_zip(path: str, kind: str) -> zipfile.ZipFile:
    """The ZIP file ``path`` (``kind``: what it should be, for the error), or an ``InvalidValueError`` naming it."""
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise InvalidValueError(f"{path} is not {kind} ({exc})") from None


class ZipArchive:
    """The image members of the ZIP archive ``path``, read in place.

    Raises:
        InvalidValueError: ``path`` is not a ZIP archive.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._zip = open_zip(path, "a ZIP archive")
        self._members: dict[str, list[zipfile.ZipInfo]] = {}
        for info in self._zip.infolist():
            if not info.is_dir():
                self._members.setdefault(info.filename, []).append(info)
        self._images = sorted(name for name in self._members if _has_image_suffix(name))

    def names(self, inner: str | None) -> list[str]:
        """The members a source names: all images (``inner`` ``None``), one member, or the images under a folder."""
        if inner is None:
            if not self._images:
                raise InputNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES[:4])}, ...) in {self.path}")
            return list(self._images)
        return _inside(self._images, inner, inner in self._members, self.path, "member")

    def read(self, inner: str) -> Tensor:
        """Member ``inner`` decoded as ``read_image`` decodes a file."""
        return _decoded(self._bytes(inner), f"{self.path}/{inner}")

    def size(self, inner: str) -> tuple[int, int]:
        """(H, W) of member ``inner`` from its header."""
        info = self._info(inner)
        with self._zip.open(info) as handle:  # seekable, inflated only as far as the header is read
            return header_size(handle, f"{self.path}/{inner}")  # type: ignore[arg-type]

    def close(self) -> None:
        self._zip.close()

    def _info(self, inner: str) -> zipfile.ZipInfo:
        found = self._members.get(inner)
        if not found:
            raise InputNotFoundError(f"no member {inner!r} in {self.path}")
        if len(found) > 1:
            raise InvalidValueError(f"member name {inner!r} appears {len(found)} times in {self.path}")
        info = found[0]
        if info.flag_bits & 0x1:
            raise InvalidValueError(f"member {inner!r} of {self.path} is encrypted; it is not read")
        _check_bytes(info.file_size, f"member {inner!r} of {self.path}")
        return info

    def _bytes(self, inner: str) -> bytes:
        """The member's bytes: zipfile inflates no more than the declared size, and checks the CRC at its end."""
        with self._zip.open(self._info(inner)) as handle:
            return handle.read()


def _has_image_suffix(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES


class TarShard:
    """The samples of the (uncompressed) WebDataset tar shard ``path``, read in place.

    Its headers are read once, as tarfile lists them; ``truncated_at`` is the offset where they stop short of the
    end-of-archive marker (the shard was cut: the samples after it are not known), else ``None``.

    Raises:
        InvalidValueError: ``path`` is not an uncompressed tar archive.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 - held while the shard is (``close``)
        try:
            self._samples, self.truncated_at = self._index()
        except BaseException:
            self._file.close()
            raise

    def _index(self) -> tuple[dict[str, dict[str, list[tarfile.TarInfo]]], int | None]:
        """Members by sample key and extension, and where the headers stop short of the end (``None``: they don't)."""
        samples: dict[str, dict[str, list[tarfile.TarInfo]]] = {}
        try:
            tar = tarfile.open(fileobj=self._file, mode="r:")  # noqa: SIM115 - closing it would close our file
        except tarfile.TarError as exc:
            raise InvalidValueError(f"{self.path} is not an uncompressed tar archive ({exc})") from None
        complete = True
        try:
            for info in tar:
                parts = _WEBDATASET_KEY.match(info.name)
                if parts and not info.isdir():
                    samples.setdefault(parts[1], {}).setdefault(parts[2].lower(), []).append(info)
        except tarfile.TarError:  # tarfile stops quietly at most broken headers past the first, raises at a few
            complete = False
        fd = self._file.fileno()
        if complete and os.pread(fd, tarfile.BLOCKSIZE, tar.offset) == _END_OF_ARCHIVE:
            return samples, None
        return samples, min(tar.offset, os.fstat(fd).st_size)

    def names(self, inner: str | None) -> list[str]:
        """The samples a source names: all with an image (``inner`` ``None``), one key, or the keys under a folder."""
        keys = [key for key, members in self._samples.items() if _image_extension(members)]
        if inner is None:
            if not keys:
                raise InputNotFoundError(
                    f"no samples with an image member ({', '.join(TAR_IMAGE_EXTENSIONS[:4])}, ...) in {self.path}"
                )
            return keys
        return _inside(keys, inner, inner in keys, self.path, "sample")

    def read(self, inner: str) -> Tensor:
        """The image of sample ``inner`` decoded as ``read_image`` decodes a file."""
        return _decoded(self._bytes(inner), f"{self.path}/{inner}")

    def size(self, inner: str) -> tuple[int, int]:
        """(H, W) of the image of sample ``inner``, from its header."""
        return header_size(io.BytesIO(self._bytes(inner)), f"{self.path}/{inner}")

    def close(self) -> None:
        self._file.close()

    def _bytes(self, inner: str) -> bytes:
        members = self._samples.get(inner, {})
        extension = _image_extension(members)
        if extension is None:
            raise InputNotFoundError(f"no sample {inner!r} with an image member in {self.path}")
        found = members[extension]
        where = f"member {found[0].name!r} of {self.path}"
        if len(found) > 1:
            raise InvalidValueError(f"{where} appears {len(found)} times")
        info = found[0]
        kind = next((name for test, name in _TAR_KINDS if test(info)), None if info.isreg() else "not a regular file")
        if kind is not None:
            raise InvalidValueError(f"{where} is {kind}; it is not followed")
        _check_bytes(info.size, where)
        data = os.pread(self._file.fileno(), info.size, info.offset_data)
        if len(data) != info.size:
            raise InvalidValueError(f"{where} is cut short ({len(data)} of {info.size} bytes): the shard is truncated")
        return data


def _image_extension(members: dict[str, list[tarfile.TarInfo]]) -> str | None:
    """The extension of a sample's image member: the first of ``TAR_IMAGE_EXTENSIONS`` it has."""
    return next((extension for extension in TAR_IMAGE_EXTENSIONS if extension in members), None)
