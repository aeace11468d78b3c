"""Preparing an image for an extractor, in one place: read a file, resize and crop, scale to ``input_range``, move.

Dumps, ``featurehooks show`` and feature grids all go through these functions, so an image gets the
same pixels whichever route it takes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
import torchvision.transforms.v2.functional as F
from PIL import Image, ImageOps
from torch import Tensor
from torchvision.transforms import InterpolationMode

from .backbones import Preprocessing

if TYPE_CHECKING:
    from .extractor import FeatureExtractor

__all__ = [
    "ImageTransform",
    "decode_image",
    "from_input_range",
    "prepare_image",
    "read_image",
    "to_input_range",
    "transform_for",
]

ImageSpec = Union[str, "os.PathLike[str]", Tensor]

_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
_DEFAULT_CROP = 224
_DEFAULT_RESIZE = 256
_FROM_WEIGHTS = "weights"


def _high_depth_rgb(image: Image.Image) -> np.ndarray:
    """RGB float32 (H, W, 3) in [0, 1] from a 16-bit, 32-bit integer or float grayscale image."""
    values = np.asarray(image, dtype=np.float32)
    if image.mode == "F":
        gray = values
    else:  # 16-bit; mode "I" may also hold 8-bit values
        gray = values / (65535.0 if image.mode != "I" or values.max(initial=0) > 255 else 255.0)
    return np.repeat(np.clip(gray, 0.0, 1.0)[..., None], 3, axis=2)


def _rgb8(image: Image.Image) -> Image.Image:
    """An 8-bit RGB image from any other mode; transparent pixels are composited on white."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")  # L, 1, P, CMYK, YCbCr, LAB, HSV


def read_image(path: str | os.PathLike[str]) -> Tensor:
    """Read an image file as (3, H, W): ``uint8`` for 8-bit images, float32 in [0, 1] for deeper ones.

    Keeping 8-bit images in ``uint8`` until after the resize is what torchvision's
    ``weights.transforms()`` does, and twice as fast as resizing floats. Grayscale, palette,
    RGBA/LA (composited on white), CMYK and 16-bit images are converted; EXIF orientation is applied.
    Raises ``OSError``/``ValueError`` (from Pillow) for unreadable files.
    """
    with Image.open(path) as image:
        image.load()  # a truncated file fails here, not later
        image = ImageOps.exif_transpose(image)
        array = _high_depth_rgb(image) if image.mode in _HIGH_DEPTH else np.array(_rgb8(image))
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).contiguous()


def decode_image(path: str | os.PathLike[str]) -> Tensor:
    """Read an image file as float (3, H, W) in [0, 1] (see ``read_image`` for the conversions)."""
    return to_input_range(read_image(path), (0.0, 1.0))


def _bounds(input_range: tuple[float, float]) -> tuple[float, float]:
    """``input_range`` as two floats, refused unless low < high (the scaling divides by the width)."""
    low, high = (float(v) for v in input_range)
    if not low < high:
        raise ValueError(f"input_range must be (low, high) with low < high, got {input_range}")
    return low, high


def to_input_range(images: Tensor, input_range: tuple[float, float]) -> Tensor:
    """Map images in [0, 1] (or ``uint8`` pixels 0..255) to floats in ``input_range``, the scale an extractor expects.

    ``uint8`` is divided by 255 first, like torchvision's ``convert_image_dtype``. For ``(0, 1)`` a
    float input is returned as it is.
    """
    low, high = _bounds(input_range)
    if images.dtype == torch.uint8:
        images = images.float().div_(255)
    elif not images.is_floating_point():
        raise TypeError(f"expected uint8 pixels or floats in [0, 1], got {images.dtype}")
    return images if (low, high) == (0.0, 1.0) else images * (high - low) + low


def from_input_range(images: Tensor, input_range: tuple[float, float]) -> Tensor:
    """Map float images in ``input_range`` back to [0, 1] (no clamping), e.g. to draw them."""
    low, high = _bounds(input_range)
    return images if (low, high) == (0.0, 1.0) else (images - low) / (high - low)


@dataclass(frozen=True)
class ImageTransform:
    """Resize the shorter side to ``resize_size``, center-crop ``crop_size``, map [0, 1] to ``input_range``.

    Takes ``uint8`` images (0..255) or floats in [0, 1]; for ``uint8`` the steps are exactly those of
    torchvision's ``weights.transforms()`` (without the normalization, which the extractor applies).

    ``None`` skips that step; without a crop every image must already share one size (dumps report
    others as invalid rows).
    """

    resize_size: int | None
    crop_size: int | None
    interpolation: str
    input_range: tuple[float, float]

    def __call__(self, image: Tensor) -> Tensor:
        mode = InterpolationMode(self.interpolation)
        if self.resize_size is not None:
            image = F.resize(image, [self.resize_size], interpolation=mode, antialias=True)
        if self.crop_size is not None:
            image = F.center_crop(image, [self.crop_size, self.crop_size])
        if image.is_floating_point():
            image = image.clamp(0.0, 1.0)  # bicubic overshoots on floats
        return to_input_range(image, self.input_range)  # uint8 is scaled after the resize, like torchvision

    def output_shape(self, channels: int = 3) -> tuple[int, int, int] | None:
        """(C, H, W) of every prepared image, or ``None`` when there is no crop."""
        if self.crop_size is None:
            return None
        return (channels, self.crop_size, self.crop_size)

    def describe(self) -> dict[str, object]:
        """The JSON-able settings, for the dump manifest (compared when a dump resumes)."""
        return {
            "resize_size": self.resize_size,
            "crop_size": self.crop_size,
            "interpolation": self.interpolation,
            "input_range": list(self.input_range),
        }


def transform_for(
    preprocessing: Preprocessing,
    input_range: tuple[float, float],
    resize_size: int | None | str = _FROM_WEIGHTS,
    crop_size: int | None | str = _FROM_WEIGHTS,
) -> ImageTransform:
    """The weights' resize and crop unless overridden (``None`` turns a step off), then ``input_range``.

    A backbone without preprocessing facts (a user's ``nn.Module``) gets resize 256, crop 224.
    """
    known = preprocessing.crop_size is not None
    if resize_size == _FROM_WEIGHTS:
        resize_size = preprocessing.resize_size if known else _DEFAULT_RESIZE
    if crop_size == _FROM_WEIGHTS:
        crop_size = preprocessing.crop_size if known else _DEFAULT_CROP
    for name, value in (("resize_size", resize_size), ("crop_size", crop_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    interpolation = preprocessing.interpolation or "bilinear"
    return ImageTransform(resize_size, crop_size, interpolation, _bounds(input_range))


def prepare_image(
    image: ImageSpec,
    extractor: FeatureExtractor,
    *,
    resize_size: int | None | str = _FROM_WEIGHTS,
    crop_size: int | None | str = _FROM_WEIGHTS,
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

    Example:
        >>> ext = FeatureExtractor("vgg16", ["relu1_2"], weights=None)
        >>> prepare_image(torch.zeros(3, 300, 400, dtype=torch.uint8), ext).shape
        torch.Size([1, 3, 224, 224])
    """
    pixels = read_image(image) if isinstance(image, (str, os.PathLike)) else image
    if not isinstance(pixels, Tensor):
        raise TypeError(f"expected an image path or tensor, got {type(pixels).__name__}")
    if pixels.dim() not in (3, 4):
        raise ValueError(f"expected an image (C, H, W) or a batch (B, C, H, W), got shape {tuple(pixels.shape)}")
    transform = transform_for(extractor.preprocessing, extractor.input_range, resize_size, crop_size)
    batch = transform(pixels)
    reference = extractor.mean  # a buffer: it follows .to(), .cuda(), .double()
    return (batch if batch.dim() == 4 else batch[None]).to(device=reference.device, dtype=reference.dtype)
