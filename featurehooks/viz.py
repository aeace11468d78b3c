"""Feature-map pictures: a grid of each layer's most active channels, next to the input image; attention maps over
the image (per head, and their rollout); and a caption band that says what drew a picture (which weights, above all
whether they are random)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont
from torch import Tensor

from .attention import HeadFusion, attention_rollout
from .errors import InvalidValueError
from .images import from_input_range

__all__ = [
    "add_caption",
    "attention_grid",
    "attention_saliency",
    "colorize",
    "feature_grid",
    "rollout_saliency",
    "save_attention_grid",
    "save_feature_grid",
    "top_channels",
]

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


def _min_max(plane: Tensor) -> np.ndarray:
    """``plane`` scaled to [0, 1] by its finite minimum and maximum (inf/nan, an fp16 overflow, must not decide the
    scale); a constant or all non-finite plane is all 0."""
    finite = plane[torch.isfinite(plane)]
    if finite.numel() == 0:
        return np.zeros(plane.shape, dtype=np.float32)
    low, high = float(finite.min()), float(finite.max())
    plane = plane.nan_to_num(nan=low, posinf=high, neginf=low)
    return ((plane - low) / (high - low) if high > low else torch.zeros_like(plane)).numpy()


def _tile(values: Tensor, size: int) -> np.ndarray:
    plane = values[None, None]
    plane = F.interpolate(plane, size=(size, size), mode="nearest" if values.shape[-1] < size else "area")[0, 0]
    return colorize(_min_max(plane))


def _overlay(picture: np.ndarray, values: Tensor, alpha: float) -> np.ndarray:
    """``values`` upsampled (bilinear) to the square ``picture``, min-max scaled, colorized and blended over it with
    weight ``alpha``."""
    size = picture.shape[0]
    plane = values.detach().float().cpu()[None, None]
    plane = F.interpolate(plane, size=(size, size), mode="bilinear", align_corners=False)[0, 0]
    heat = colorize(_min_max(plane)).astype(np.float32)
    return (picture.astype(np.float32) * (1 - alpha) + heat * alpha).round().astype(np.uint8)


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
    first = [] if image is None else [(_image_tile(image, tile_size, input_range), "")]
    rows = [
        (
            f"{name}  {tuple(fmap.shape)}",
            [*first, *((_tile(fmap[index], tile_size), str(index)) for index in top_channels(fmap, channels))],
        )
        for name, fmap in maps.items()
    ]
    return _rows_picture(rows, tile_size, caption)


_Row = tuple[str, Sequence[tuple[np.ndarray, str]]]


def _rows_picture(rows: Sequence[_Row], tile_size: int, caption: str | None) -> np.ndarray:
    """One row per ``(label, tiles)``: the label above, then each square tile with its text written in its corner,
    left to right; under a caption band when ``caption`` is given."""
    columns = max(len(tiles) for _, tiles in rows)
    row_height = _LABEL_HEIGHT + tile_size
    width = columns * tile_size + (columns - 1) * _GAP
    canvas = Image.new("RGB", (width, len(rows) * row_height + (len(rows) - 1) * _GAP), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    for row, (label, tiles) in enumerate(rows):
        top = row * (row_height + _GAP)
        draw.text((2, top + 1), label, fill=(0, 0, 0), font=font)
        for column, (tile, text) in enumerate(tiles):
            left = column * (tile_size + _GAP)
            canvas.paste(Image.fromarray(tile), (left, top + _LABEL_HEIGHT))
            if text:
                draw.text((left + 2, top + _LABEL_HEIGHT + 1), text, fill=(255, 255, 255), font=font)
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
    return _save_picture(path, feature_grid(features, image, **kwargs))  # type: ignore[arg-type]


def _save_picture(path: str | os.PathLike[str], picture: np.ndarray) -> Path:
    """Write an RGB picture to ``path`` (PNG unless the suffix says otherwise), its folder created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(picture).save(path, format=None if path.suffix else "PNG")
    return path


def attention_saliency(attention: Tensor, grid: tuple[int, int], prefix_tokens: int) -> Tensor:
    """Per head, where one layer's attention falls on the patch grid: the class token's row over the patch tokens
    or, for a model without prefix tokens, the mean attention each patch receives (its column, averaged over the
    queries).

    Args:
        attention: post-softmax weights, as ``capture_attention`` records them.
        grid: ``(rows, columns)`` of the patch tokens.
        prefix_tokens: the tokens that lead the patch tokens (the class token first, then registers or a
            distillation token); 0 for none.

    Shape:
        attention: ``(batch, heads, queries, prefix_tokens + rows * columns)``; returned:
        ``(batch, heads, rows, columns)``.

    Raises:
        InvalidValueError: keys that are not the prefix tokens and the grid's patches: window attention (Swin),
            spatial reduction (PVT, Twins).

    Examples:
        >>> import torch
        >>> from featurehooks.viz import attention_saliency
        >>> attention = torch.rand(1, 3, 17, 17).softmax(-1)  # the class token and 4x4 patches, 3 heads
        >>> saliency = attention_saliency(attention, (4, 4), prefix_tokens=1)
        >>> tuple(saliency.shape), torch.equal(saliency[0, 2].flatten(), attention[0, 2, 0, 1:])
        ((1, 3, 4, 4), True)
    """
    rows, columns = grid
    if attention.dim() != 4 or prefix_tokens < 0 or attention.shape[-1] != prefix_tokens + rows * columns:
        raise InvalidValueError(
            f"attention of shape {tuple(attention.shape)} is not (batch, heads, queries, keys) over {prefix_tokens} "
            f"prefix token(s) and a {rows}x{columns} grid of patches (window attention or spatial reduction "
            "attends to other keys): no map over the image to draw"
        )
    patches = attention[..., 0, prefix_tokens:] if prefix_tokens else attention.mean(-2)
    return patches.unflatten(-1, (rows, columns))


def rollout_saliency(
    maps: Mapping[str, Tensor] | Sequence[Tensor],
    grid: tuple[int, int],
    prefix_tokens: int,
    *,
    head_fusion: HeadFusion = "mean",
) -> Tensor:
    """The attention rollout of ``maps`` on the patch grid: the class token's row of ``attention_rollout`` over the
    patch tokens or, for a model without prefix tokens, the rollout each patch receives (column mean).

    Args:
        maps: every attention layer's ``(batch, heads, tokens, tokens)`` map, in layer order.
        grid: ``(rows, columns)`` of the patch tokens.
        prefix_tokens: the tokens that lead the patch tokens (class, registers, distillation); 0 for none.
        head_fusion: how each layer's heads become one map (``attention_rollout``'s).

    Shape:
        maps: ``(batch, heads, prefix_tokens + rows * columns, prefix_tokens + rows * columns)`` each; returned:
        ``(batch, rows, columns)``.

    Raises:
        InvalidValueError: maps that ``attention_rollout`` refuses, or tokens that are not the prefix tokens and the
            grid's patches.

    Examples:
        >>> import torch
        >>> from featurehooks.attention import attention_rollout
        >>> from featurehooks.viz import rollout_saliency
        >>> maps = [torch.rand(1, 2, 10, 10).softmax(-1) for _ in range(3)]  # class token + 3x3 patches
        >>> saliency = rollout_saliency(maps, (3, 3), prefix_tokens=1)
        >>> tuple(saliency.shape), torch.equal(saliency.flatten(1), attention_rollout(maps, prefix_tokens=1))
        ((1, 3, 3), True)
    """
    rows, columns = grid
    rollout = attention_rollout(maps, head_fusion=head_fusion, prefix_tokens=prefix_tokens or None)
    received = rollout if prefix_tokens else rollout.mean(1)
    if received.shape[-1] != rows * columns:
        raise InvalidValueError(
            f"the rollout has {received.shape[-1]} patch tokens after {prefix_tokens} prefix token(s), not a "
            f"{rows}x{columns} grid: no map over the image to draw"
        )
    return received.unflatten(-1, (rows, columns))


def attention_grid(
    panels: Mapping[str, Tensor],
    image: Tensor,
    *,
    tile_size: int = 96,
    input_range: tuple[float, float] = (0.0, 1.0),
    alpha: float = 0.6,
    caption: str | None = None,
) -> np.ndarray:
    """A picture with one row per entry of ``panels``: the input image, then each of its maps over the image.

    Each map (a head's ``attention_saliency``, a ``rollout_saliency``) is upsampled bilinearly to the image, min-max
    scaled on its own, drawn with the viridis colormap and blended over the image with weight ``alpha``. Labels
    name the row and its shape, and number the maps of rows with several. A ``caption`` goes in a band above the
    rows (``add_caption``): say there which weights drew the maps, above all when they are random.

    Args:
        panels: ``{label: maps}``, the maps of one image on its patch grid.
        image: the input ``(B, C, H, W)``/``(C, H, W)`` (its first image is drawn).
        tile_size: side of each tile in pixels.
        input_range: value range of ``image``.
        alpha: weight of the colored map over the image, in [0, 1].
        caption: text for a band above the rows; None (the default) draws no band.

    Returns:
        An RGB ``uint8`` array ``(height, width, 3)``.

    Shape:
        panels: ``(maps, rows, columns)`` each.

    Examples:
        >>> import torch
        >>> from featurehooks.viz import attention_grid, attention_saliency
        >>> attention = torch.rand(1, 3, 17, 17).softmax(-1)  # 3 heads over the class token and 4x4 patches
        >>> panels = {"blocks.11.attn": attention_saliency(attention, (4, 4), 1)[0]}
        >>> attention_grid(panels, torch.rand(1, 3, 64, 64), tile_size=32).shape  # the image, then 3 heads
        (46, 134, 3)
    """
    if not panels:
        raise InvalidValueError("no attention maps to draw")
    if tile_size < 8 or not 0.0 <= alpha <= 1.0:
        raise InvalidValueError(f"tile_size must be >= 8 and alpha in [0, 1], got {tile_size} and {alpha}")
    for label, maps in panels.items():
        if maps.dim() != 3 or maps.shape[0] < 1:
            raise InvalidValueError(f"panel {label!r} has shape {tuple(maps.shape)}, not (maps, rows, columns)")
    picture = _image_tile(image, tile_size, input_range)
    rows: list[_Row] = []
    for label, maps in panels.items():
        numbered = len(maps) > 1
        tiles = [(_overlay(picture, values, alpha), str(k) if numbered else "") for k, values in enumerate(maps)]
        rows.append((f"{label}  {tuple(maps.shape)}", [(picture, ""), *tiles]))
    return _rows_picture(rows, tile_size, caption)


def save_attention_grid(
    path: str | os.PathLike[str], panels: Mapping[str, Tensor], image: Tensor, **kwargs: object
) -> Path:
    """Write ``attention_grid(panels, image, **kwargs)`` to ``path`` as ``save_feature_grid`` writes its grid (PNG
    unless the suffix says otherwise, the folder created) and return ``path`` as a ``Path``; ``kwargs`` are
    ``attention_grid``'s (``tile_size``, ``input_range``, ``alpha``, ``caption``).

    Examples:
        >>> import tempfile
        >>> from pathlib import Path
        >>> import torch
        >>> from featurehooks.viz import rollout_saliency, save_attention_grid
        >>> maps = [torch.rand(1, 2, 10, 10).softmax(-1) for _ in range(3)]
        >>> panels = {"rollout": rollout_saliency(maps, (3, 3), prefix_tokens=1)}  # one map: the first image's
        >>> save_attention_grid(Path(tempfile.mkdtemp()) / "attention.png", panels, torch.rand(3, 48, 48)).name
        'attention.png'
    """
    return _save_picture(path, attention_grid(panels, image, **kwargs))  # type: ignore[arg-type]
