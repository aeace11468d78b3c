"""What a loaded backbone carries besides its weights: its name, provenance, preprocessing and input channels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from torch import nn

from ..errors import InvalidValueError

Size = Union[int, tuple[int, int]]
"""A side length (a square, or the shorter side for a ``"center"`` resize) or an ``(H, W)`` pair."""

CROP_MODES = ("center", "squash", "border", "square")


@dataclass(frozen=True)
class Preprocessing:
    """How images are prepared for a backbone, as its weights (or its library's config) define it.

    ``mean`` and ``std`` apply to images scaled to [0, 1]; ``None`` means no normalization. ``None`` sizes
    skip that step. The resize follows ``crop_mode``, as timm's eval transform does:

    - ``"center"``: an int resizes the shorter side (torchvision's ``Resize(int)``); an ``(H, W)`` pair scales
      the image, keeping its aspect ratio, to the smallest size that covers it, each side rounded (timm's
      ``ResizeKeepRatio``).
    - ``"squash"``: resize to ``(H, W)`` (an int: a square), whatever the aspect ratio.
    - ``"border"``: scale, keeping the aspect ratio, to the largest size within ``(H, W)``, each side rounded.
    - ``"square"``: crop the centered square of side ``min(H, W)`` first (offsets rounded down), then resize it
      to ``resize_size`` (CMMD's reference code).

    ``crop_size`` (an int: a square) is then center-cropped; where the image is smaller it is padded with
    black, as torchvision's ``CenterCrop`` pads, or with ``fill`` (0..255 per channel: timm's ``"border"`` pads
    with the mean).

    Examples:
        >>> from featurehooks import Preprocessing, load_backbone
        >>> load_backbone("resnet18", weights=None).preprocessing  # what the DEFAULT weights' transforms do
        Preprocessing(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), resize_size=256, crop_size=224, ...)
        >>> Preprocessing(resize_size=(256, 256), crop_size=224, crop_mode="squash").mean is None  # no normalization
        True
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize_size: Size | None = None
    crop_size: Size | None = None
    interpolation: str = "bilinear"
    crop_mode: str = "center"
    fill: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.crop_mode not in CROP_MODES:
            raise InvalidValueError(f"crop_mode must be one of {CROP_MODES}, not {self.crop_mode!r}")


@dataclass
class Backbone:
    """A model ready to be wrapped, with the facts a manifest or a repr needs about it.

    ``in_channels`` is the input's channel count from the model's own metadata (a stem's first conv may take
    more, e.g. after a space-to-depth); None for a user's module, which has no such metadata.

    Examples:
        >>> from featurehooks import load_backbone
        >>> backbone = load_backbone("resnet18", weights=None)
        >>> type(backbone).__name__, backbone.name, backbone.weights, backbone.in_channels
        ('Backbone', 'resnet18', None, 3)
    """

    model: nn.Module
    name: str
    weights: str | None
    preprocessing: Preprocessing
    in_channels: int | None = None
