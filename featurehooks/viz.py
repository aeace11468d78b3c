"""Feature-map pictures: a grid of each layer's most active channels, next to the input image."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from .errors import InvalidValueError
from .images import from_input_range

__all__ = ["feature_grid", "save_feature_grid", "top_channels"]

# Anchors of the viridis colormap (no matplotlib needed), interpolated linearly.
_VIRIDIS = np.array(
    [
        [68, 1, 84],
        [72, 40, 120],
        [62, 74, 137],
        [49, 104, 142],
        [38, 130, 142],
        [31, 158, 137],
        [53, 183, 121],
        [109, 205, 89],
        [180, 222, 44],
        [253, 231, 37],
    ],
    dtype=np.float32,
)
_LABEL_HEIGHT = 14
_GAP = 2


def _colorize(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to viridis RGB uint8."""
    position = np.clip(values, 0.0, 1.0) * (len(_VIRIDIS) - 1)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, len(_VIRIDIS) - 1)
    weight = (position - low)[..., None]
    return (_VIRIDIS[low] * (1 - weight) + _VIRIDIS[high] * weight).round().astype(np.uint8)


def _as_map(name: str, feature: Tensor) -> Tensor:
    """(C, H, W) of the first sample; token outputs with a square token count are folded into a map."""
    value = feature.detach().float().cpu()
    if value.dim() == 4:
        return value[0]
    if value.dim() == 3:  # (B, T, C) tokens
        tokens = value.shape[1]
        side = int(round(tokens**0.5))
        for extra in (0, 1):  # a class token may lead the sequence
            if (side * side) == tokens - extra and side > 0:
                return value[0, extra:].T.reshape(-1, side, side)
    raise InvalidValueError(
        f"layer {name!r} has shape {tuple(feature.shape)}, not a feature map (B, C, H, W); "
        "pick a convolutional layer (see `featurehooks layers BACKBONE`)"
    )


def top_channels(feature_map: Tensor, count: int) -> list[int]:
    """Indices of the ``count`` channels with the highest mean activation, strongest first."""
    means = feature_map.flatten(1).mean(dim=1)
    order = torch.argsort(means, descending=True, stable=True)
    return [int(i) for i in order[:count]]


def _tile(values: Tensor, size: int) -> np.ndarray:
    plane = values[None, None]
    plane = F.interpolate(plane, size=(size, size), mode="nearest" if values.shape[-1] < size else "area")[0, 0]
    finite = plane[torch.isfinite(plane)]  # inf/nan (an fp16 overflow) must not decide the scale
    if finite.numel() == 0:
        return _colorize(np.zeros(plane.shape, dtype=np.float32))
    low, high = float(finite.min()), float(finite.max())
    plane = plane.nan_to_num(nan=low, posinf=high, neginf=low)
    scaled = (plane - low) / (high - low) if high > low else torch.zeros_like(plane)
    return _colorize(scaled.numpy())


def _image_tile(image: Tensor, size: int, input_range: tuple[float, float]) -> np.ndarray:
    """The first image of ``image`` as an RGB ``uint8`` tile, mapped from ``input_range`` to [0, 1]."""
    picture = image.detach().float().cpu()
    picture = picture[0] if picture.dim() == 4 else picture
    picture = from_input_range(picture, input_range).clamp(0, 1)
    if picture.shape[0] == 1:
        picture = picture.expand(3, -1, -1)
    picture = F.interpolate(picture[None, :3], size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (picture[0].permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)


def feature_grid(
    features: Mapping[str, Tensor],
    image: Tensor | None = None,
    *,
    channels: int = 8,
    tile_size: int = 96,
    input_range: tuple[float, float] = (0.0, 1.0),
) -> np.ndarray:
    """A picture with one row per layer: the input image, then the ``channels`` most active maps.

    Each map is min-max scaled on its own and drawn with the viridis colormap; labels name the
    layer, its shape and each channel index. Only the first sample of a batch is drawn.

    Args:
        features: ``{layer: feature}`` as returned by a FeatureExtractor (maps ``(B, C, H, W)``).
        image: the input batch or image ``(B, C, H, W)``/``(C, H, W)``, drawn at the start of each row.
        channels: maps per layer (fewer if the layer has fewer channels).
        tile_size: side of each tile in pixels.
        input_range: value range of ``image``.

    Returns:
        An RGB ``uint8`` array ``(height, width, 3)``.

    Example:
        >>> grid = feature_grid({"a": torch.rand(1, 4, 8, 8)}, channels=2, tile_size=16)
        >>> grid.shape, grid.dtype
        ((30, 34, 3), dtype('uint8'))
    """
    if not features:
        raise InvalidValueError("no features to draw")
    if channels < 1 or tile_size < 8:
        raise InvalidValueError(f"channels must be >= 1 and tile_size >= 8, got {channels} and {tile_size}")
    maps = {name: _as_map(name, value) for name, value in features.items()}
    columns = min(channels, max(m.shape[0] for m in maps.values())) + (1 if image is not None else 0)
    row_height = _LABEL_HEIGHT + tile_size
    width = columns * tile_size + (columns - 1) * _GAP
    canvas = Image.new("RGB", (width, len(maps) * row_height + (len(maps) - 1) * _GAP), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    for row, (name, fmap) in enumerate(maps.items()):
        top = row * (row_height + _GAP)
        draw.text((2, top + 1), f"{name}  {tuple(fmap.shape)}", fill=(0, 0, 0), font=font)
        left = 0
        if image is not None:
            canvas.paste(Image.fromarray(_image_tile(image, tile_size, input_range)), (0, top + _LABEL_HEIGHT))
            left = tile_size + _GAP
        for index in top_channels(fmap, channels):
            canvas.paste(Image.fromarray(_tile(fmap[index], tile_size)), (left, top + _LABEL_HEIGHT))
            draw.text((left + 2, top + _LABEL_HEIGHT + 1), str(index), fill=(255, 255, 255), font=font)
            left += tile_size + _GAP
    return np.asarray(canvas)


def save_feature_grid(
    path: str | os.PathLike[str], features: Mapping[str, Tensor], image: Tensor | None = None, **kwargs: object
) -> Path:
    """Write ``feature_grid(features, image, **kwargs)`` to ``path`` (PNG unless the suffix says otherwise)."""
    path = Path(path)
    grid = feature_grid(features, image, **kwargs)  # type: ignore[arg-type]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(path, format=None if path.suffix else "PNG")
    return path
