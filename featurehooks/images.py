"""Preparing an image for an extractor, in one place: read a file, resize and crop, scale to ``input_range``, move.

Dumps, ``featurehooks show`` and feature grids all go through these functions, so an image gets the
same pixels whichever route it takes. Reading a file (special files, the size limit, modes, orientation, JPEG)
is ``featurehooks._decode``'s job; ``read_image`` applies this module's ``MAX_DECODED_PIXELS`` to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torchvision.transforms.v2.functional as F
from PIL import Image
from torch import Tensor
from torchvision.transforms import InterpolationMode

from ._decode import image_size as image_size
from ._decode import read_pixels
from .backbones import Preprocessing
from .backbones.base import Size
from .errors import InvalidTypeError, InvalidValueError

if TYPE_CHECKING:
    from .extractor import FeatureExtractor

__all__ = [
    "MAX_DECODED_PIXELS",
    "MAX_RESIZED_PIXELS",
    "ImageTransform",
    "decode_image",
    "from_input_range",
    "prepare_image",
    "read_image",
    "resized_size",
    "to_input_range",
    "transform_for",
]

ImageSpec = Union[str, "os.PathLike[str]", Tensor]

MAX_DECODED_PIXELS = 2**26
"""Most pixels (width × height) an image file may have; a larger one is refused before it is decoded.

67 million (8192 × 8192, a 64 MP photo): it bounds the memory one image costs to decode (docs/dumps.md, "Resource
bounds"). Pillow's own check refuses only above 179 million and can be switched off
(``Image.MAX_IMAGE_PIXELS = None``); this one always holds. Raise it by assigning
``featurehooks.images.MAX_DECODED_PIXELS`` (before a dump starts its workers).

Examples:
    >>> from featurehooks import images
    >>> default = images.MAX_DECODED_PIXELS
    >>> default == 8192 * 8192
    True
    >>> images.MAX_DECODED_PIXELS = 2**28  # for a folder of 16384 x 16384 scans
    >>> images.MAX_DECODED_PIXELS = default
"""

MAX_RESIZED_PIXELS = 2**25
"""Most pixels a resize may produce; checked before resizing, so a thin image cannot explode.

33.5 million (100 MiB of RGB ``uint8``): a 1000 × 1 PNG resized to 256 would become 256000 × 256
(65.5 million pixels) and is refused, while a 1:100 panorama at 256 (6.6 million) is far inside.

Examples:
    >>> from featurehooks.images import MAX_RESIZED_PIXELS, resized_size
    >>> height, width = resized_size(1, 1000, 256)  # a 1000 x 1 strip, shorter side to 256
    >>> height * width > MAX_RESIZED_PIXELS
    True
"""

FROM_WEIGHTS = "weights"


def read_image(path: str | os.PathLike[str]) -> Tensor:
    """Read an image file as (3, H, W): ``uint8`` for 8-bit images, float32 in [0, 1] for deeper ones.

    Keeping 8-bit images in ``uint8`` until after the resize is what torchvision's
    ``weights.transforms()`` does. Grayscale, palette, RGBA/LA (composited on white), CMYK and
    16-bit images are converted; EXIF orientation is applied. A ``uint8`` image is a (3, H, W) view
    of the (H, W, 3) array decoders write (``.contiguous()`` makes it channel-planar): Pillow resizes
    such an array without copying it again.

    Pillow reads the header of every file (format, size, orientation) and decodes all of them but
    RGB and grayscale JPEGs: torchvision's ``decode_jpeg`` decodes those faster, to the
    same pixels (both are libjpeg-turbo with its defaults, checked once per process; grayscale is
    repeated into three channels as ``convert("RGB")`` does). A JPEG it refuses (a truncated one)
    goes to Pillow, which decides as before. CMYK and YCCK JPEGs, like every other file, are Pillow's.

    Raises:
        OSError: the file cannot be read or decoded (a truncated file, not an image), or it is not a
            regular file (a directory, a FIFO or a device, which could block forever).
        ValueError: the image is over ``MAX_DECODED_PIXELS``, or a float image holds NaN or infinity.
            Pillow may raise others for broken files (``SyntaxError``, ``DecompressionBombError``, ...).

    Examples:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> from featurehooks import read_image
        >>> path = os.path.join(tempfile.mkdtemp(), "gray.png")
        >>> Image.new("L", (40, 30), color=128).save(path)
        >>> image = read_image(path)  # grayscale becomes RGB
        >>> image.shape, image.dtype, image[:, 0, 0].tolist()
        (torch.Size([3, 30, 40]), torch.uint8, [128, 128, 128])
    """
    return read_pixels(path, MAX_DECODED_PIXELS)  # the limit as it is now: a user may have raised it


def decode_image(path: str | os.PathLike[str]) -> Tensor:
    """Read an image file as float (3, H, W) in [0, 1] (see ``read_image`` for the conversions).

    Examples:
        >>> import os, tempfile
        >>> from PIL import Image
        >>> from featurehooks.images import decode_image
        >>> path = os.path.join(tempfile.mkdtemp(), "red.png")
        >>> Image.new("RGB", (4, 2), color=(255, 0, 0)).save(path)
        >>> decode_image(path)[:, 0, 0]
        tensor([1., 0., 0.])
    """
    return to_input_range(read_image(path), (0.0, 1.0))


def _bounds(input_range: tuple[float, float]) -> tuple[float, float]:
    """``input_range`` as two floats, refused unless low < high (the scaling divides by the width)."""
    low, high = (float(v) for v in input_range)
    if not low < high:
        raise InvalidValueError(f"input_range must be (low, high) with low < high, got {input_range}")
    return low, high


def to_input_range(images: Tensor, input_range: tuple[float, float]) -> Tensor:
    """Map images in [0, 1] (or ``uint8`` pixels 0..255) to floats in ``input_range``, the scale an extractor expects.

    ``uint8`` is divided by 255 first, like torchvision's ``convert_image_dtype``. For ``(0, 1)`` a
    float input is returned as it is.

    Examples:
        >>> import torch
        >>> from featurehooks.images import to_input_range
        >>> to_input_range(torch.tensor([0.0, 0.5, 1.0]), (-1.0, 1.0))
        tensor([-1.,  0.,  1.])
        >>> to_input_range(torch.tensor([0, 255], dtype=torch.uint8), (0.0, 255.0))
        tensor([  0., 255.])
    """
    low, high = _bounds(input_range)
    if images.dtype == torch.uint8:
        images = images.float().div_(255)
    elif not images.is_floating_point():
        raise InvalidTypeError(f"expected uint8 pixels or floats in [0, 1], got {images.dtype}")
    return images if (low, high) == (0.0, 1.0) else images * (high - low) + low


def from_input_range(images: Tensor, input_range: tuple[float, float]) -> Tensor:
    """Map float images in ``input_range`` back to [0, 1] (no clamping), e.g. to draw them.

    Examples:
        >>> import torch
        >>> from featurehooks.images import from_input_range
        >>> from_input_range(torch.tensor([-1.0, 0.0, 1.0]), (-1.0, 1.0))
        tensor([0.0000, 0.5000, 1.0000])
    """
    low, high = _bounds(input_range)
    return images if (low, high) == (0.0, 1.0) else (images - low) / (high - low)


def resized_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(H, W) after resizing the shorter side to ``size``, the longer one truncated as torchvision does.

    Examples:
        >>> from featurehooks.images import resized_size
        >>> resized_size(300, 400, 256), resized_size(401, 300, 256)
        ((256, 341), (342, 256))
    """
    _check_not_empty(height, width, "resize")
    short, long = (width, height) if width <= height else (height, width)
    longer = int(size * long / short)
    return (longer, size) if width <= height else (size, longer)


def _check_not_empty(height: int, width: int, what: str) -> None:
    """Refuse an image without pixels, which no resize or model can take."""
    if height < 1 or width < 1:
        raise InvalidValueError(f"cannot {what} an empty image of {height}x{width} pixels")


def _pair(size: Size) -> tuple[int, int]:
    """``(H, W)`` of a size: an int is a square."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _kept_ratio_size(height: int, width: int, target: tuple[int, int], *, inside: bool) -> tuple[int, int]:
    """(H, W) scaled by one factor to cover ``target`` (or, ``inside``, to fit in it), each side rounded.

    timm's ``ResizeKeepRatio`` (``longest`` 0 or 1), with its arithmetic, so the sizes equal timm's.
    """
    _check_not_empty(height, width, "resize")
    ratio_h, ratio_w = height / target[0], width / target[1]
    ratio = max(ratio_h, ratio_w) if inside else min(ratio_h, ratio_w)
    return round(height / ratio), round(width / ratio)


def _resize_target(size: Size, crop_mode: str, height: int, width: int) -> tuple[int, int]:
    """(H, W) an image of ``height x width`` is resized to, for ``size`` in ``crop_mode`` (see ``Preprocessing``)."""
    if crop_mode == "center" and isinstance(size, int):
        return resized_size(height, width, size)
    if crop_mode in ("squash", "square"):  # "square" has cut the image to its centered square first
        return _pair(size)
    return _kept_ratio_size(height, width, _pair(size), inside=crop_mode == "border")


def _resize(image: Tensor, new: tuple[int, int], mode: InterpolationMode) -> Tensor:
    """(..., C, H, W) resized to ``new``, refused past ``MAX_RESIZED_PIXELS`` or at 0 pixels before any work."""
    height, width = image.shape[-2:]
    if new[0] * new[1] > MAX_RESIZED_PIXELS or min(new) < 1:
        limit = f"over MAX_RESIZED_PIXELS = {MAX_RESIZED_PIXELS}" if min(new) > 0 else "an empty image"
        raise InvalidValueError(
            f"image of {width}x{height} pixels would be resized to {new[1]}x{new[0]}, {limit} (featurehooks.images)"
        )
    if new == (height, width):
        return image
    if image.dtype == torch.uint8:
        return _pillow_resize(image, new, mode)
    return F.resize(image, list(new), interpolation=mode, antialias=True)


def _center_crop(image: Tensor, size: tuple[int, int], fill: tuple[int, ...] | None) -> Tensor:
    """Center-crop (..., C, H, W) to ``size``; where it is smaller, pad with black (torchvision's ``CenterCrop``)
    or with ``fill``, 0..255 per channel (timm's ``CenterCropOrPad``): both pad first, then crop the center."""
    height, width = image.shape[-2:]
    grow_h, grow_w = max(size[0] - height, 0), max(size[1] - width, 0)
    if fill is not None and (grow_h or grow_w):
        values = list(fill) if image.dtype == torch.uint8 else [v / 255 for v in fill]
        image = F.pad(image, [grow_w // 2, grow_h // 2, (grow_w + 1) // 2, (grow_h + 1) // 2], fill=values)
    return F.center_crop(image, list(size))


def _pillow_resize(image: Tensor, size: tuple[int, int], mode: InterpolationMode) -> Tensor:
    """Resize (..., C, H, W) ``uint8`` with Pillow: the pixels ``weights.transforms()`` makes of a PIL image.

    torch's own ``uint8`` kernel rounds otherwise (one level on a share of the pixels, a different share
    on CPUs without AVX2), so Pillow is what makes the result equal torchvision's on every machine.
    """
    if image.dim() == 3:  # one image (what a dump's loader resizes): no stack, no reshape
        return _pillow_resize_one(image.detach().cpu(), list(size), mode).to(image.device)
    flat = image.detach().cpu().reshape(-1, *image.shape[-3:])
    resized = torch.stack([_pillow_resize_one(one, list(size), mode) for one in flat])
    return resized.reshape(*image.shape[:-2], *size).to(image.device)


def _pillow_resize_one(image: Tensor, size: list[int], mode: InterpolationMode) -> Tensor:
    """Resize one (C, H, W) ``uint8`` image: as one RGB picture, else channel by channel (the same numbers)."""
    if image.shape[0] == 3:
        picture = Image.fromarray(image.permute(1, 2, 0).numpy())
        return F.pil_to_tensor(F.resize(picture, size, interpolation=mode))
    planes = [F.resize(Image.fromarray(plane.numpy()), size, interpolation=mode) for plane in image]
    return torch.cat([F.pil_to_tensor(plane) for plane in planes])  # not as RGBA: Pillow would premultiply alpha


@dataclass(frozen=True)
class ImageTransform:
    """Resize, center-crop, map [0, 1] to ``input_range``: a backbone's ``Preprocessing`` applied to pixels.

    ``resize_size``, ``crop_size``, ``crop_mode`` and ``fill`` mean what they mean in ``Preprocessing``: an
    int ``resize_size`` with the default ``"center"`` is torchvision's shorter-side resize.

    Takes ``uint8`` images (0..255) or floats in [0, 1]. ``uint8`` images are resized by Pillow, so their
    pixels equal those of torchvision's ``weights.transforms()`` or timm's eval transform applied to the PIL
    image (before the normalization, which the extractor applies); floats are resized by torch and clamped.

    ``None`` skips that step; without a crop every image must already share one size (dumps report others
    as invalid rows). A resize past ``MAX_RESIZED_PIXELS``, or of an empty image, raises ``ValueError``
    before any work.

    Examples:
        >>> import torch
        >>> from featurehooks.images import ImageTransform
        >>> transform = ImageTransform(resize_size=256, crop_size=224, interpolation="bilinear", input_range=(-1, 1))
        >>> image = transform(torch.zeros(3, 300, 400, dtype=torch.uint8))
        >>> image.shape, image.min().item(), transform.prepared_size(300, 400)
        (torch.Size([3, 224, 224]), -1.0, (224, 224))
    """

    resize_size: Size | None
    crop_size: Size | None
    interpolation: str
    input_range: tuple[float, float]
    crop_mode: str = "center"
    fill: tuple[int, ...] | None = None

    def __call__(self, image: Tensor) -> Tensor:
        height, width = image.shape[-2:]
        _check_not_empty(height, width, "prepare")
        if self.crop_mode == "square":
            side = min(height, width)
            top, left = (height - side) // 2, (width - side) // 2
            image = image[..., top : top + side, left : left + side]
        if self.resize_size is not None:
            new = _resize_target(self.resize_size, self.crop_mode, *image.shape[-2:])
            image = _resize(image, new, InterpolationMode(self.interpolation))
        if self.crop_size is not None:
            image = _center_crop(image, _pair(self.crop_size), self.fill)
        if image.is_floating_point():
            image = image.clamp(0.0, 1.0)  # bicubic overshoots on floats
        return to_input_range(image, self.input_range)  # uint8 is scaled after the resize, like torchvision

    def prepared_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) this transform gives an image of ``height x width``."""
        if self.crop_mode == "square":
            height = width = min(height, width)
        if self.resize_size is not None:
            height, width = _resize_target(self.resize_size, self.crop_mode, height, width)
        if self.crop_size is not None:
            height, width = _pair(self.crop_size)
        return height, width

    def output_shape(self, channels: int = 3) -> tuple[int, int, int] | None:
        """(C, H, W) of every prepared image, or ``None`` when there is no crop."""
        if self.crop_size is None:
            return None
        return (channels, *_pair(self.crop_size))

    def describe(self) -> dict[str, object]:
        """The JSON-able settings, for the dump manifest (compared when a dump resumes).

        ``crop_mode`` and ``fill`` appear only when they are not the defaults, so the manifests of earlier
        dumps, which had neither, still compare equal.
        """
        described: dict[str, object] = {
            "resize_size": self.resize_size,
            "crop_size": self.crop_size,
            "interpolation": self.interpolation,
            "input_range": list(self.input_range),
        }
        if self.crop_mode != "center":
            described["crop_mode"] = self.crop_mode
        if self.fill is not None:
            described["fill"] = list(self.fill)
        return described


def transform_for(
    preprocessing: Preprocessing,
    input_range: tuple[float, float],
    resize_size: int | None | str = FROM_WEIGHTS,
    crop_size: int | None | str = FROM_WEIGHTS,
) -> ImageTransform:
    """The backbone's own resize and crop unless overridden (an int; ``None`` turns a step off), then ``input_range``.

    What the pipeline does is what ``preprocessing`` says: a backbone without preprocessing facts (a user's own
    ``nn.Module``) has no resize and no crop, so its images keep their size unless sizes are given. A given
    resize follows the backbone's ``crop_mode``: the shorter side for "center" (torchvision's, and most of
    timm's), a square for timm's "squash" and "border", as an int size is in timm.

    Examples:
        >>> from featurehooks import load_backbone
        >>> from featurehooks.images import transform_for
        >>> preprocessing = load_backbone("resnet18", weights=None).preprocessing
        >>> transform_for(preprocessing, (0.0, 1.0))  # the weights' own resize and crop
        ImageTransform(resize_size=256, crop_size=224, interpolation='bilinear', input_range=(0.0, 1.0), ...)
        >>> transform_for(preprocessing, (0.0, 1.0), resize_size=None, crop_size=128).prepared_size(300, 400)
        (128, 128)
    """
    resize = preprocessing.resize_size if resize_size == FROM_WEIGHTS else checked_size("resize_size", resize_size)
    crop = preprocessing.crop_size if crop_size == FROM_WEIGHTS else checked_size("crop_size", crop_size)
    interpolation = preprocessing.interpolation or "bilinear"
    return ImageTransform(
        resize, crop, interpolation, _bounds(input_range), preprocessing.crop_mode, preprocessing.fill
    )


def checked_size(name: str, value: object) -> int | None:
    """A size the user gave instead of the weights' (``FROM_WEIGHTS``): a positive int, or None to skip the step."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidValueError(f"{name} must be a positive int, None or {FROM_WEIGHTS!r}, got {value!r}")
    return value


def check_input_size(extractor: FeatureExtractor, size: tuple[int, ...]) -> None:
    """Refuse, before any forward, images prepared to another size than the only one the backbone takes."""
    fixed = extractor.input_size
    if fixed is None or tuple(size) == fixed:
        return
    fix = f"pass crop_size={fixed[0]} (--crop {fixed[0]})" if fixed[0] == fixed[1] else "prepare them to that size"
    raise InvalidValueError(
        f"{extractor.backbone_name} takes {fixed[0]}x{fixed[1]} images only (its patch embedding is fixed), and these "
        f"are prepared to {size[0]}x{size[1]}: {fix}, or leave the resize and crop to the weights"
    )


def prepare_image(
    image: ImageSpec,
    extractor: FeatureExtractor,
    *,
    resize_size: int | None | str = FROM_WEIGHTS,
    crop_size: int | None | str = FROM_WEIGHTS,
) -> Tensor:
    """An image file or tensor made ready for ``extractor``: resized, cropped, scaled, batched and moved.

    The resize and crop follow the extractor's weights (as in dumps; ``resize_size``/``crop_size``
    override, ``None`` skips a step), the values its ``input_range``, and the result has the device
    and floating dtype of its buffers, so ``extractor(prepare_image(path, extractor))`` just works.

    Args:
        image: a path (read with ``read_image``), or a ``(C, H, W)``/``(B, C, H, W)`` tensor of
            ``uint8`` pixels or floats in [0, 1].
        extractor: the ``FeatureExtractor`` the image is for.
        resize_size: shorter-side resize, ``"weights"`` for the weights' own, ``None`` for none.
        crop_size: center crop, ``"weights"`` for the weights' own, ``None`` for none.

    Shape:
        output: ``(1, C, crop, crop)`` for one image, ``(B, C, crop, crop)`` for a batch.

    Raises:
        ValueError: not an image or a batch, or a resize past ``MAX_RESIZED_PIXELS``; for a path, also
            what ``read_image`` raises.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor, prepare_image
        >>> ext = FeatureExtractor("resnet18", ["layer1"], weights=None)
        >>> prepare_image(torch.zeros(3, 300, 400, dtype=torch.uint8), ext).shape  # resized to 256, cropped to 224
        torch.Size([1, 3, 224, 224])
    """
    pixels = read_image(image) if isinstance(image, (str, os.PathLike)) else image
    if not isinstance(pixels, Tensor):
        raise InvalidTypeError(f"expected an image path or tensor, got {type(pixels).__name__}")
    if pixels.dim() not in (3, 4):
        raise InvalidValueError(f"expected an image (C, H, W) or a batch (B, C, H, W), got shape {tuple(pixels.shape)}")
    transform = transform_for(extractor.preprocessing, extractor.input_range, resize_size, crop_size)
    batch = transform(pixels)
    check_input_size(extractor, tuple(batch.shape[-2:]))
    reference = extractor.mean  # a buffer: it follows .to(), .cuda(), .double()
    return (batch if batch.dim() == 4 else batch[None]).to(device=reference.device, dtype=reference.dtype)
