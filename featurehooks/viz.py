"""Feature-map pictures: a grid of each layer's most active channels, next to the input image, and a caption band
that says what drew a picture (which weights, above all whether they are random)."""

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

__all__ = ["add_caption", "colorize", "feature_grid", "save_feature_grid", "top_channels"]

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
_CAPTION_LINE = 12  # pixels per caption line; the band is this per line plus a margin above and below
_CAPTION_MARGIN = 3
_CAPTION_LEFT = 4


def colorize(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to viridis RGB ``uint8`` (the colors of every picture featurehooks draws).

    Examples:
        >>> import numpy as np
        >>> from featurehooks.viz import colorize
        >>> colorize(np.array([0.0, 1.0])).tolist()  # viridis' ends: dark purple, yellow
        [[68, 1, 84], [253, 231, 37]]
    """
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
    """Indices of the ``count`` channels with the highest mean activation, strongest first.

    Args:
        feature_map: one sample's maps.
        count: how many channels to return (all of them if there are fewer).

    Shape:
        feature_map: ``(C, H, W)``.

    Examples:
        >>> import torch
        >>> from featurehooks.viz import top_channels
        >>> maps = torch.stack([torch.full((4, 4), level) for level in (0.1, 3.0, -1.0, 2.0)])
        >>> top_channels(maps, 2)
        [1, 3]
    """
    means = feature_map.flatten(1).mean(dim=1)
    order = torch.argsort(means, descending=True, stable=True)
    return [int(i) for i in order[:count]]


def _wrap(caption: str, width: int, font: ImageFont.ImageFont | ImageFont.FreeTypeFont) -> list[str]:
    """The caption's lines, each wrapped at spaces to fit ``width`` pixels (a word wider than that keeps its line)."""
    lines: list[str] = []
    for paragraph in caption.splitlines():
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if line and font.getlength(candidate) > width:
                lines.append(line)
                candidate = word
            line = candidate
        lines.append(line)
    return lines


def add_caption(picture: np.ndarray, caption: str) -> np.ndarray:
    """``picture`` under a white band with ``caption`` written in black: say there which weights drew it.

    Each line of ``caption`` (split at ``\\n``) wraps at spaces to the picture's width; the band is 12 pixels per
    line plus 3 above and 3 below, as wide as the picture, which is copied below it unchanged.

    Args:
        picture: an RGB ``uint8`` image.
        caption: the text, one or more lines; not blank.

    Returns:
        A new RGB ``uint8`` array, ``picture`` with the band on top.

    Shape:
        picture: ``(H, W, 3)``; returned: ``(band + H, W, 3)``.

    Raises:
        InvalidValueError: the picture is not ``(H, W, 3)`` ``uint8``, or the caption is blank.

    Examples:
        >>> import numpy as np
        >>> from featurehooks.viz import add_caption
        >>> picture = np.zeros((32, 320, 3), dtype=np.uint8)
        >>> add_caption(picture, "VGG16 relu3_3\\nRANDOM weights (seed 0): the mechanics only").shape
        (62, 320, 3)
    """
    if picture.ndim != 3 or picture.shape[2] != 3 or picture.dtype != np.uint8:
        raise InvalidValueError(f"picture must be an RGB uint8 array (H, W, 3), got {picture.dtype} {picture.shape}")
    if not caption.strip():
        raise InvalidValueError("caption is blank: pass the text to write, or no caption")
    font = ImageFont.load_default()
    width = picture.shape[1]
    lines = _wrap(caption, width - 2 * _CAPTION_LEFT, font)
    band = Image.new("RGB", (width, 2 * _CAPTION_MARGIN + _CAPTION_LINE * len(lines)), (255, 255, 255))
    pen = ImageDraw.Draw(band)
    for row, text in enumerate(lines):
        pen.text((_CAPTION_LEFT, _CAPTION_MARGIN + _CAPTION_LINE * row), text, fill=(0, 0, 0), font=font)
    return np.concatenate([np.asarray(band), picture])


def _tile(values: Tensor, size: int) -> np.ndarray:
    plane = values[None, None]
    plane = F.interpolate(plane, size=(size, size), mode="nearest" if values.shape[-1] < size else "area")[0, 0]
    finite = plane[torch.isfinite(plane)]  # inf/nan (an fp16 overflow) must not decide the scale
    if finite.numel() == 0:
        return colorize(np.zeros(plane.shape, dtype=np.float32))
    low, high = float(finite.min()), float(finite.max())
    plane = plane.nan_to_num(nan=low, posinf=high, neginf=low)
    scaled = (plane - low) / (high - low) if high > low else torch.zeros_like(plane)
    return colorize(scaled.numpy())


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
    caption: str | None = None,
) -> np.ndarray:
    """A picture with one row per layer: the input image, then the ``channels`` most active maps.

    Each map is min-max scaled on its own and drawn with the viridis colormap; labels name the
    layer, its shape and each channel index. Only the first sample of a batch is drawn. A ``caption``
    goes in a band above the rows (``add_caption``): say there which weights drew the maps, above all
    when they are random, since random weights show the mechanics, not what a trained network sees.

    Args:
        features: ``{layer: feature}`` as returned by a FeatureExtractor (maps ``(B, C, H, W)``).
        image: the input batch or image ``(B, C, H, W)``/``(C, H, W)``, drawn at the start of each row.
        channels: maps per layer (fewer if the layer has fewer channels).
        tile_size: side of each tile in pixels.
        input_range: value range of ``image``.
        caption: text for a band above the rows, one or more lines; None (the default) draws no band.

    Returns:
        An RGB ``uint8`` array ``(height, width, 3)``.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.viz import feature_grid
        >>> grid = feature_grid({"a": torch.rand(1, 4, 8, 8)}, channels=2, tile_size=16)
        >>> grid.shape, grid.dtype
        ((30, 34, 3), dtype('uint8'))

        Maps of a backbone with random weights, captioned to say so:

        >>> _ = torch.manual_seed(0)
        >>> with FeatureExtractor("resnet18", ["layer1", "layer2"], weights=None) as extractor:
        ...     image = torch.rand(1, 3, 64, 64)
        ...     features = extractor(image)
        >>> caption = f"resnet18, weights {extractor.weights}" if extractor.weights else "resnet18, RANDOM weights"
        >>> feature_grid(features, image, channels=4, tile_size=32, caption=caption).shape
        (112, 168, 3)
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
    grid = np.asarray(canvas)
    return grid if caption is None else add_caption(grid, caption)


def save_feature_grid(
    path: str | os.PathLike[str], features: Mapping[str, Tensor], image: Tensor | None = None, **kwargs: object
) -> Path:
    """Write ``feature_grid(features, image, **kwargs)`` to ``path`` (PNG unless the suffix says otherwise).

    Args:
        path: the file to write; its folder is created.
        features: ``{layer: feature}``, as for ``feature_grid``.
        image: the input, as for ``feature_grid``.
        **kwargs: ``feature_grid``'s keyword arguments (``channels``, ``tile_size``, ``input_range``, ``caption``).

    Returns:
        ``path``, as a ``Path``.

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import torch
        >>> from featurehooks.viz import save_feature_grid
        >>> folder = Path(tempfile.mkdtemp())
        >>> save_feature_grid(folder / "maps.png", {"a": torch.rand(1, 4, 8, 8)}, caption="random features").name
        'maps.png'
    """
    path = Path(path)
    grid = feature_grid(features, image, **kwargs)  # type: ignore[arg-type]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(path, format=None if path.suffix else "PNG")
    return path
