"""Image preparation for dumps: shorter-side resize, center crop, scaling to the extractor's input range."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torchvision.transforms.v2.functional as F
from torch import Tensor
from torchvision.transforms import InterpolationMode

from ..backbones import Preprocessing

__all__ = ["ImageTransform", "transform_for"]

_DEFAULT_CROP = 224
_DEFAULT_RESIZE = 256


@dataclass(frozen=True)
class ImageTransform:
    """Resize the shorter side to ``resize_size``, center-crop ``crop_size``, map [0, 1] to ``input_range``.

    Takes ``uint8`` images (0..255) or floats in [0, 1]; for ``uint8`` the steps are exactly those of
    torchvision's ``weights.transforms()`` (without the normalization, which the extractor applies).

    ``None`` skips that step; without a crop every image must already share one size (others are
    reported as invalid rows).
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
        if image.dtype == torch.uint8:  # like torchvision's convert_image_dtype, after the resize
            image = image.float().div_(255)
        low, high = self.input_range
        image = image.clamp(0.0, 1.0)  # bicubic overshoots on floats
        return image if (low, high) == (0.0, 1.0) else image * (high - low) + low

    def output_shape(self, channels: int = 3) -> tuple[int, int, int] | None:
        """(C, H, W) of every prepared image, or ``None`` when there is no crop."""
        if self.crop_size is None:
            return None
        return (channels, self.crop_size, self.crop_size)

    def describe(self) -> dict[str, object]:
        """The JSON-able settings, for the manifest."""
        return {
            "resize_size": self.resize_size,
            "crop_size": self.crop_size,
            "interpolation": self.interpolation,
            "input_range": list(self.input_range),
        }


_FROM_WEIGHTS = "weights"


def transform_for(
    preprocessing: Preprocessing,
    input_range: tuple[float, float],
    resize_size: int | None | str = _FROM_WEIGHTS,
    crop_size: int | None | str = _FROM_WEIGHTS,
) -> ImageTransform:
    """The dump transform: the weights' resize and crop unless overridden (``None`` turns a step off).

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
    return ImageTransform(resize_size, crop_size, interpolation, (float(input_range[0]), float(input_range[1])))
