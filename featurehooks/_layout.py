"""Output layouts: which axis of a layer's output holds channels, positions and prefix tokens.

A convolution returns ``(B, C, H, W)`` ("NCHW"), Swin's stages ``(B, H, W, C)`` ("NHWC"), a
transformer block ``(B, P + H*W, C)`` tokens ("NLC", led by ``P`` class/register/distillation
tokens), a head ``(B, C)`` ("NC"). The layout of each output is read from its shape in the meta
trace (or from the first real forward of a model that cannot be traced); the functions here turn
any of them into channels-first views, ``(B, C, H, W)`` maps, or pooled ``(B, C)`` vectors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from .errors import InvalidValueError

__all__ = [
    "POOLS",
    "as_pool",
    "Layout",
    "Pool",
    "channels_first",
    "check_nchw",
    "classify",
    "pool_positions",
    "patch_size_of",
    "prefix_tokens_of",
    "split_prefix",
    "to_nchw",
    "token_grid",
]

Kind = Literal["NCHW", "NHWC", "NLC", "NC", "other"]
Pool = Literal["avg", "max", "cls"]
POOLS: tuple[Pool, ...] = ("avg", "max", "cls")


def as_pool(value: object) -> Pool | None:
    """``value`` as a pooling the type checker knows (None, "avg", "max" or "cls"); anything else is refused."""
    if value is None:
        return None
    for pool in POOLS:
        if value == pool:
            return pool
    raise InvalidValueError(f"pool must be None, 'avg', 'max' or 'cls', not {value!r}")


@dataclass(frozen=True)
class Layout:
    """How one output is laid out: ``kind``, its ``channels``, its ``stride`` over the input (None
    where it has no positions or they do not tile the input) and, for ``"NLC"``, ``prefix_tokens``
    (the tokens before the patch tokens; None when the model does not say)."""

    kind: Kind
    channels: int | None = None
    stride: int | None = None
    prefix_tokens: int | None = None


OTHER = Layout("other")


def prefix_tokens_of(model: nn.Module) -> int | None:
    """How many tokens (class, register, distillation) lead the patch tokens of ``model``'s token outputs.

    timm models say so (``num_prefix_tokens``; none of them has any without saying), torchvision's
    ViT has one class token and its other models none; any other module only if it has an integer
    ``num_prefix_tokens`` attribute, else None (unknown).
    """
    count = getattr(model, "num_prefix_tokens", None)
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    origin = type(model).__module__
    if origin.startswith("timm."):  # CoaT, CrossViT: class tokens without saying how many lead
        return None if any("cls_token" in name or "dist_token" in name for name, _ in model.named_parameters()) else 0
    if origin.startswith("torchvision.models"):
        return 1 if type(model).__name__ == "VisionTransformer" else 0
    return None


def patch_size_of(model: nn.Module) -> int | None:
    """The square patch size of the first patch embedding in ``model`` (timm's ``patch_embed``,
    torchvision's ViT), or None."""
    for module in model.modules():
        size = getattr(module, "patch_size", None)
        if isinstance(size, (tuple, list)) and len(size) == 2 and size[0] == size[1]:
            size = size[0]
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    return None


def _spatial_stride(height: int, width: int, input_hw: tuple[int, int]) -> int | None:
    """The stride at which a ``height x width`` map covers the input, or None if it cannot be one."""
    in_height, in_width = input_hw
    if not (1 <= height <= in_height and 1 <= width <= in_width):
        return None
    stride = in_height // height
    return stride if in_width // width == stride else None


def _token_stride(tokens: int, input_hw: tuple[int, int], patch_size: int | None) -> int | None:
    """The patch size at which ``tokens`` patch tokens tile the input (rounding down or up), or None.

    The model's own ``patch_size`` is tried first: a grid may fit several strides (a 150x220 image
    padded at 16 or cropped at 15 both give 10x14). Otherwise the stride nearest to the one the
    token count implies wins, within a quarter of it.
    """
    if tokens < 1:
        return None
    estimate = (input_hw[0] * input_hw[1] / tokens) ** 0.5
    reach = max(1, int(estimate / 4))
    nearest = sorted(range(max(1, int(estimate) - reach), int(estimate) + reach + 2), key=lambda s: abs(s - estimate))
    for stride in ([patch_size] if patch_size else []) + nearest:
        if any(rows * columns == tokens for rows, columns in _grids(input_hw, stride)):
            return stride
    return None


def _grids(image_hw: tuple[int, int], stride: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The patch grids of an image at ``stride``: rounding down (cropping) and up (padding), in integers."""
    height, width = image_hw
    return (height // stride, width // stride), (-(-height // stride), -(-width // stride))


def classify(
    shape: tuple[int, ...] | None,
    input_shape: tuple[int, ...],
    prefix_tokens: int | None,
    patch_size: int | None = None,
) -> Layout:
    """The layout of an output of ``shape`` for an input of ``input_shape`` ``(B, C, H, W)``.

    Outputs whose first axis is not the input's batch (windows of Swin or MaxViT attention, heads
    folded into the batch) are ``"other"``: traces use a batch of 2, so a leading 1 is no batch.
    Tokens are ``"NLC"`` with ``prefix_tokens`` leading tokens when the rest tile the input, else
    with none when all of them do; ``patch_size`` (the model's, if it says) settles ambiguous grids.
    """
    if shape is None or len(shape) not in (2, 3, 4) or len(input_shape) != 4 or shape[0] != input_shape[0]:
        return OTHER
    input_hw = (input_shape[-2], input_shape[-1])
    if len(shape) == 2:
        return Layout("NC", shape[1])
    if len(shape) == 3:
        if prefix_tokens and shape[1] <= prefix_tokens:  # class tokens only (CaiT's class-attention blocks)
            return Layout("NLC", shape[2], None, shape[1])
        for prefix in dict.fromkeys((prefix_tokens or 0, 0)):
            stride = _token_stride(shape[1] - prefix, input_hw, patch_size)
            if stride is not None:
                return Layout("NLC", shape[2], stride, prefix if prefix_tokens is not None else None)
        return Layout("NLC", shape[2], None, prefix_tokens)
    channels_first_stride = _spatial_stride(shape[2], shape[3], input_hw)
    channels_last_stride = _spatial_stride(shape[1], shape[2], input_hw)
    if channels_first_stride is None and channels_last_stride is not None:
        return Layout("NHWC", shape[3], channels_last_stride)
    if channels_first_stride is None and shape[2] != shape[3]:  # (B, heads, N, head_dim), (B, windows, N, C)
        return OTHER
    return Layout("NCHW", shape[1], channels_first_stride)


def channels_first(feature: Tensor, kind: str) -> Tensor:
    """A ``(B, C, *positions)`` view of an output: NHWC and NLC move their channels to axis 1."""
    if kind == "NHWC":
        return feature.permute(0, 3, 1, 2)
    if kind == "NLC":
        return feature.transpose(1, 2)
    return feature


def split_prefix(tokens: Tensor, layout: Layout, name: str) -> tuple[Tensor, Tensor]:
    """``(prefix, patches)`` of ``(B, P + N, C)`` tokens; raises when the prefix count is unknown."""
    if layout.prefix_tokens is None:
        raise _unknown_prefix(name, tuple(tokens.shape))
    count = layout.prefix_tokens
    return tokens[:, :count], tokens[:, count:]


def _unknown_prefix(name: str, shape: tuple[int, ...]) -> InvalidValueError:
    return InvalidValueError(
        f"layer {name!r} returns {shape} tokens, and the model does not say how many of them lead the patch "
        "tokens (class, register or distillation tokens); pass prefix_tokens=<count> (0 for none) to the "
        "FeatureExtractor"
    )


def check_nchw(layout: Layout, shape: tuple[int, ...], image_hw: tuple[int, int], name: str) -> None:
    """Raise now what ``to_nchw`` would raise for an output of ``shape``: tokens whose prefix count is
    unknown, or whose patch tokens do not tile the image."""
    if layout.kind != "NLC":
        return
    if layout.prefix_tokens is None:
        raise _unknown_prefix(name, shape)
    if layout.prefix_tokens >= shape[1]:
        raise InvalidValueError(
            f"layer {name!r} returns {shape[1]} tokens and all of them lead the patch tokens (prefix tokens: "
            f"{layout.prefix_tokens}): no patch tokens to lay out as a map; use output_format='native'"
        )
    token_grid(shape[1] - layout.prefix_tokens, image_hw, layout.stride, name)


def token_grid(tokens: int, image_hw: tuple[int, int], stride: int | None, name: str) -> tuple[int, int]:
    """The ``(rows, columns)`` patch grid of ``tokens`` patch tokens for an image of ``image_hw``.

    Patch embeddings round the image size down, or up when they pad (timm's ``dynamic_img_pad``):
    the rounding whose grid holds exactly ``tokens`` wins.
    """
    if stride is not None:
        for grid in _grids(image_hw, stride):
            if grid[0] * grid[1] == tokens:
                return grid
    at = f"stride {stride}" if stride is not None else "an unknown stride"
    raise InvalidValueError(
        f"layer {name!r}: {tokens} patch tokens do not tile a {image_hw[0]}x{image_hw[1]} image at {at}, so they "
        "cannot be laid out as a map; use output_format='native' for this layer"
    )


def to_nchw(feature: Tensor, layout: Layout, image_hw: tuple[int, int], name: str) -> tuple[Tensor, Tensor | None]:
    """``(maps, prefix)``: NHWC permuted and NLC patch tokens reshaped to their grid, as ``(B, C, H, W)``
    views (no copy); ``prefix`` holds the ``(B, P, C)`` prefix tokens of an NLC output, else None."""
    if layout.kind == "NHWC":
        return feature.permute(0, 3, 1, 2), None
    if layout.kind != "NLC":
        return feature, None
    prefix, patches = split_prefix(feature, layout, name)
    rows, columns = token_grid(patches.shape[1], image_hw, layout.stride, name)
    return patches.unflatten(1, (rows, columns)).permute(0, 3, 1, 2), prefix


def pool_positions(feature: Tensor, layout: Layout, how: Pool, name: str) -> Tensor:
    """``(B, C)``: the average or maximum over an output's positions (never over prefix tokens), or
    with ``"cls"`` its first prefix token. An ``"NC"`` output is returned as it is."""
    if layout.kind == "NC":
        if how == "cls":
            raise InvalidValueError(f"pool='cls': layer {name!r} returns {tuple(feature.shape)} vectors, not tokens")
        return feature
    if layout.kind == "other":
        raise InvalidValueError(
            f"layer {name!r} returns shape {tuple(feature.shape)}, which is neither maps nor tokens of the input; "
            "it cannot be pooled, dump it with pool=None"
        )
    if layout.kind == "NLC":
        prefix, feature = split_prefix(feature, layout, name)
        if how == "cls":
            if prefix.shape[1] == 0:
                raise InvalidValueError(f"pool='cls': the tokens of layer {name!r} have no class token")
            return prefix[:, 0]
        if feature.shape[1] == 0:
            raise InvalidValueError(
                f"pool={how!r}: layer {name!r} returns class tokens only, no patch tokens to pool; use pool='cls'"
            )
    elif how == "cls":
        raise InvalidValueError(
            f"pool='cls': layer {name!r} returns {layout.kind} maps, which have no class token; "
            "use output_format='native' for its tokens, or pool='avg'"
        )
    positions = channels_first(feature, layout.kind).flatten(2)
    return positions.mean(dim=2) if how == "avg" else torch.amax(positions, dim=2)
