"""Reading image files safely: regular files only, the size checked from the header, every mode decoded to RGB.

Files are opened here (``read_pixels``, ``image_size``); an image already open (a member of a ZIP or tar archive,
read by ``featurehooks._stream.archives``) goes through the same decoder (``decode_pixels``, ``header_size``).

``featurehooks.images`` builds ``read_image`` and ``image_size`` on this module and holds the limit it applies
(``MAX_DECODED_PIXELS``), so that assigning the public constant changes what is read. A FIFO or a device is
refused before it is opened, an image too large is refused before a pixel is decoded, EXIF (or XMP) orientation
is applied, 16-bit, 32-bit and float images keep their depth as float32 (integer ones scaled by the depth their
file declares, not by their content), and RGB and grayscale JPEGs are decoded by torchvision's libjpeg-turbo where
it gives Pillow's pixels.
"""

from __future__ import annotations

import functools
import io
import os
import re
import stat
import warnings
from typing import BinaryIO

import numpy as np
import torch
from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError
from torch import Tensor

from .errors import InvalidValueError

try:
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # a torchvision without it (deprecated since 0.29 for TorchCodec): Pillow decodes every file
    decode_jpeg = None

__all__ = ["decode_jpeg_is_pillows", "decode_pixels", "header_size", "image_size", "read_pixels"]

_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
_SPECIAL_FILES = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)
_ROTATED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
# Pillow's exif_transpose as (swap height and width, then flip these axes) on (C, H, W)
_EXIF_TRANSPOSES: dict[int, tuple[bool, tuple[int, ...]]] = {
    2: (False, (-1,)),  # FLIP_LEFT_RIGHT
    3: (False, (-2, -1)),  # ROTATE_180
    4: (False, (-2,)),  # FLIP_TOP_BOTTOM
    5: (True, ()),  # TRANSPOSE
    6: (True, (-1,)),  # ROTATE_270
    7: (True, (-2, -1)),  # TRANSVERSE
    8: (True, (-2,)),  # ROTATE_90
}


def read_pixels(path: str | os.PathLike[str], max_pixels: int) -> Tensor:
    """What ``featurehooks.images.read_image`` returns for ``path`` (see there), refusing an image of more than
    ``max_pixels`` pixels from its header, before any pixel is decoded."""
    with _open_regular(path) as handle:
        return decode_pixels(handle, path, max_pixels)


def decode_pixels(handle: BinaryIO, name: str | os.PathLike[str], max_pixels: int) -> Tensor:
    """``read_pixels`` of the image file open as ``handle`` (seekable; a member of an archive read into memory, or
    an open file), ``name`` naming it in errors: the one decoder of files and of archives' members."""
    with _identify(handle, name) as image:
        _check_decoded_size(image.size, max_pixels)
        if image.format == "JPEG" and image.mode in ("RGB", "L") and decode_jpeg_is_pillows():
            pixels = _decode_jpeg(handle)
            if pixels is not None:
                return _exif_transpose(pixels, image)
        full_scale = _full_scale(image)  # from the file's declared depth, which load() forgets
        image.load()  # a truncated file fails here, not later
        ImageOps.exif_transpose(image, in_place=True)
        return _high_depth_rgb(image, full_scale) if image.mode in _HIGH_DEPTH else _rgb8(image)


def image_size(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(H, W) of the image ``read_image`` would return, from the file's header (no pixel is decoded)."""
    with _open_regular(path) as handle:
        return header_size(handle, path)


def header_size(handle: BinaryIO, name: str | os.PathLike[str]) -> tuple[int, int]:
    """``image_size`` of the image file open as ``handle`` (seekable), ``name`` naming it in errors."""
    with _identify(handle, name) as image:
        width, height = image.size
        rotated = image.getexif().get(ExifTags.Base.Orientation) in _ROTATED
    return (width, height) if rotated else (height, width)


@functools.cache
def decode_jpeg_is_pillows() -> bool:
    """Whether torchvision's ``decode_jpeg`` gives Pillow's pixels in this process (checked once, on a small noise
    JPEG); ``read_pixels`` uses it for JPEGs only then.

    Both wheels bundle libjpeg-turbo; a torchvision built against another libjpeg (IJG's 7 and later
    upsample chroma by a scaled IDCT) can round otherwise, and then every JPEG stays with Pillow.
    """
    if decode_jpeg is None:
        return False
    noise = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(noise).save(buffer, format="JPEG", quality=90)  # 4:2:0, where decoders differ most
    with Image.open(buffer) as image:
        pixels = _decode_jpeg(buffer)
        return pixels is not None and torch.equal(pixels, _rgb8(image))


def _refuse_special(mode: int) -> None:
    """Raise ``OSError`` unless ``mode`` is a regular file's: reading a FIFO or a device may never end."""
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _SPECIAL_FILES if test(mode)), "special file")
        raise OSError(f"not a regular file: {kind}")


def _open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file (checked before opening, and again on what was opened)."""
    _refuse_special(os.stat(path).st_mode)  # opening a device can have effects of its own
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in meanwhile cannot block
    handle = os.fdopen(fd, "rb")
    try:
        _refuse_special(os.fstat(fd).st_mode)
    except OSError:
        handle.close()
        raise
    return handle


def _identify(handle: BinaryIO, path: str | os.PathLike[str]) -> Image.Image:
    """``Image.open`` on an open file; an unknown format names the path, as when Pillow opens the file itself."""
    try:
        return Image.open(handle)
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"cannot identify image file {os.fspath(path)!r}") from None


def _check_decoded_size(size: tuple[int, int], max_pixels: int) -> None:
    """Refuse an image whose header says it has more than ``max_pixels`` (``featurehooks.images.MAX_DECODED_PIXELS``)
    pixels, ``size`` being its (W, H)."""
    width, height = size
    if width * height > max_pixels:
        raise InvalidValueError(
            f"image of {width}x{height} pixels is over MAX_DECODED_PIXELS = {max_pixels} (featurehooks.images)"
        )


def _full_scale(image: Image.Image) -> float:
    """The pixel value that reads as 1.0 in an integer grayscale image of more than 8 bits, from the depth its file
    declares (read before ``load()``, which forgets it), never from its content.

    Pillow opens 16-bit files of some formats (PGM, PNG in older Pillows) in its 32-bit mode "I": the raw mode
    their decoder was given (``I;16B``) keeps the file's 16 bits, so they scale by 65535 as a 16-bit PNG does. A
    32-bit integer file scales by its 32 bits (``2**31 - 1`` when signed, as Pillow's mode "I" is), whatever range
    its pixels use: 16-bit data stored in 32 bits reads dark. Pillow stretches a PGM's ``maxval`` to 16 bits.
    """
    if image.mode != "I" or image.format == "PPM":
        return 65535.0  # the I;16 modes, and a PGM's pixels, which Pillow stretches to 16 bits
    tiles = image.tile if isinstance(image, ImageFile.ImageFile) else []  # what Image.open returns
    args = tiles[0].args if tiles else None
    rawmode = args if isinstance(args, str) else args[0] if isinstance(args, tuple) and args else "I"
    declared = re.fullmatch(r"I;(\d+)[BLN]?(S?)", str(rawmode))  # I;16B, I;32S, I;16BS; a bare I is 32-bit signed
    bits, signed = (int(declared[1]), bool(declared[2])) if declared else (32, True)
    return float((1 << (bits - signed)) - 1)


def _high_depth_rgb(image: Image.Image, full_scale: float) -> Tensor:
    """(3, H, W) float32 in [0, 1] from a 16-bit, 32-bit integer or float grayscale image.

    Float pixels are taken as they are (NaN or infinite ones are refused); integer ones are divided by
    ``full_scale``, the largest value of the depth their file declares (see ``_full_scale``).
    """
    gray = np.array(image, dtype=np.float32)
    if image.mode == "F":
        if not np.isfinite(gray).all():
            raise InvalidValueError("float image with NaN or infinite pixels")
    else:
        gray /= full_scale
    np.clip(gray, 0.0, 1.0, out=gray)
    return torch.from_numpy(gray).expand(3, *gray.shape).contiguous()


def _rgb8(image: Image.Image) -> Tensor:
    """(3, H, W) ``uint8`` view of an (H, W, 3) array from an image of any other mode (see ``read_image``);
    transparent pixels are composited on white."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    if image.mode != "RGB":  # L, 1, P, CMYK, YCbCr, LAB, HSV; convert() would copy an RGB image too
        image = image.convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def _decode_jpeg(handle: BinaryIO) -> Tensor | None:
    """(3, H, W) ``uint8`` of a whole JPEG file by torchvision's libjpeg-turbo; ``None`` where it raises.

    Faster than Pillow's decode and conversion, the most for large baseline files (docs/performance.md), with
    the same pixels. torchvision raises for what it cannot decode (a truncated file, since 0.8, or a build
    without its image extension); the caller then lets Pillow decode, so such a file fails, or succeeds,
    exactly as it does with Pillow.
    """
    handle.seek(0)
    data = torch.frombuffer(bytearray(handle.read()), dtype=torch.uint8)
    try:
        with warnings.catch_warnings():  # its decoders are deprecated since 0.29, yet there is no equal one
            warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision.io")
            return decode_jpeg(data, mode=ImageReadMode.RGB)
    except RuntimeError:
        return None


def _exif_transpose(pixels: Tensor, image: Image.Image) -> Tensor:
    """``ImageOps.exif_transpose`` of decoded (C, H, W) pixels, following Pillow's reading of ``image``.

    Pillow's reading (EXIF, else XMP) is the one ``image_size`` and the Pillow route use; torchvision's
    own ``apply_exif_orientation`` ignores XMP. The result is a (C, H, W) view of an (H, W, C) array, like
    the Pillow route's: the decoder's own buffer when nothing turns, else a copy (numpy's, which is faster
    than ``Tensor.contiguous()``).
    """
    swap, flips = _EXIF_TRANSPOSES.get(image.getexif().get(ExifTags.Base.Orientation, 1), (False, ()))
    turned = pixels.permute(1, 2, 0).numpy()
    if swap:
        turned = turned.swapaxes(0, 1)
    if flips:
        turned = np.flip(turned, tuple(axis + 2 for axis in flips))  # -2 (H) and -1 (W) of (C, H, W) are 0 and 1 here
    return torch.from_numpy(np.ascontiguousarray(turned)).permute(2, 0, 1)
