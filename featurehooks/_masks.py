"""Masks on images for losses: checked, resized to a layer's grid by area average, and the masked mean of a
per-position loss (``featurehooks.functional`` exports them; ``docs/losses.md``, "Masked losses", says why)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .errors import InvalidTypeError, InvalidValueError

__all__ = [
    "MaskNormalization",
    "check_mask",
    "check_mask_normalization",
    "mask_area",
    "masked_mean",
    "on_positions",
    "resize_mask",
]

MaskNormalization = Literal["mask", "image"]
"""What a masked loss divides its weighted sum by: the mask's area (``"mask"``, the mean over the masked positions)
or the whole grid (``"image"``, the mean over every position, masked ones counting 0).

Examples:
    >>> import torch
    >>> from featurehooks.functional import masked_mean
    >>> values, mask = torch.tensor([[[[2.0, 4.0]]]]), torch.tensor([[[[1.0, 0.0]]]])
    >>> masked_mean(values, mask, "mask"), masked_mean(values, mask, "image")
    (tensor([2.]), tensor([1.]))
"""

_MASK_NORMALIZATIONS = ("mask", "image")


def _per_sample_mean(values: Tensor) -> Tensor:
    """Mean over every dimension but the batch (``functional.per_sample_mean``'s arithmetic, unchecked)."""
    return values.reshape(values.shape[0], -1).mean(dim=1)


def check_mask_normalization(mask_normalization: str) -> None:
    """Raise ``InvalidValueError`` unless ``mask_normalization`` is ``"mask"`` or ``"image"``.

    Examples:
        >>> from featurehooks.functional import check_mask_normalization
        >>> check_mask_normalization("image")
        >>> check_mask_normalization("area")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: mask_normalization must be 'mask' (the mean over the mask) or ...
    """
    if mask_normalization not in _MASK_NORMALIZATIONS:
        raise InvalidValueError(
            "mask_normalization must be 'mask' (the mean over the mask) or 'image' (the mean over the whole image), "
            f"not {mask_normalization!r}"
        )


def check_mask(
    mask: object, batch: int, size: Sequence[int] | None = None, device: torch.device | None = None
) -> Tensor:
    """``mask`` as float weights after checking it: a ``(batch or 1, 1, H, W)`` tensor of weights in [0, 1].

    ``size`` is the images' ``(H, W)`` when they are known (a mask lies in image coordinates); a bool mask
    becomes float32 0/1, a float16/bfloat16 one float32. A mask whose sample is all zeros is accepted with
    a warning: that sample has nothing to compare, and its loss is 0. One device synchronization.

    Shape:
        mask: ``(B, 1, H, W)`` or ``(1, 1, H, W)``; output: the same, float32 or float64.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import check_mask
        >>> check_mask(torch.ones(2, 1, 8, 8, dtype=torch.bool), batch=2, size=(8, 8)).dtype
        torch.float32
        >>> check_mask(torch.full((2, 1, 8, 8), 2.0), batch=2)
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: mask must hold weights in [0, 1]; it holds values in [2, 2]
    """
    if not isinstance(mask, Tensor):
        raise InvalidTypeError(
            f"mask must be a Tensor of weights in [0, 1], shape (B, 1, H, W), not {type(mask).__name__}"
        )
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise InvalidTypeError(
            f"mask must hold float weights in [0, 1] or bools, not {mask.dtype}; for a 0/255 mask pass mask / 255.0"
        )
    expected = (
        f"({batch} or 1, 1, {size[0]}, {size[1]}) (the images' size)"
        if size is not None
        else f"({batch} or 1, 1, H, W)"
    )
    shape = tuple(mask.shape)
    if (
        mask.dim() != 4
        or mask.shape[0] not in (1, batch)
        or mask.shape[1] != 1
        or (size is not None and shape[2:] != tuple(size))
    ):
        hint = "; add the channel axis: mask[:, None]" if mask.dim() == 3 else ""
        raise InvalidValueError(f"mask must have shape {expected}, got {shape}{hint}")
    if device is not None and mask.device != device:
        raise InvalidValueError(f"mask is on {mask.device} but the images on {device}; move it there")
    weights = mask.float() if mask.dtype in (torch.bool, torch.float16, torch.bfloat16) else mask
    with torch.no_grad():
        outside = ~((weights >= 0) & (weights <= 1))  # NaN compares False: it is outside too
        empty = weights.flatten(1).amax(dim=1) == 0
        flags = torch.cat([outside.any().reshape(1), empty]).tolist()
    if flags[0]:
        finite = weights[torch.isfinite(weights)]
        span = f"[{float(finite.min()):.3g}, {float(finite.max()):.3g}]" if finite.numel() else "no finite value"
        nan = " and NaN" if bool(weights.isnan().any()) else ""
        raise InvalidValueError(f"mask must hold weights in [0, 1]; it holds values in {span}{nan}")
    empty_samples = [index for index, flag in enumerate(flags[1:]) if flag]
    if empty_samples:
        which = "the mask" if weights.shape[0] == 1 else f"the mask of sample(s) {empty_samples}"
        warnings.warn(f"{which} is all zeros: nothing to compare there, so the loss is 0", stacklevel=2)
    return weights


def resize_mask(mask: Tensor, size: Sequence[int]) -> Tensor:
    """A mask in image coordinates on a layer's ``(h, w)`` grid: each cell's area average of the mask.

    The rule is ``F.adaptive_avg_pool2d(mask, (h, w))`` (the same as ``F.interpolate(mode="area")``): cell
    ``(i, j)`` averages the mask's rows ``floor(i * H / h)`` to ``ceil((i + 1) * H / h) - 1`` and likewise
    its columns, so a binary mask becomes each cell's coverage. A mask already of size ``(h, w)`` is returned
    as it is.

    Shape:
        mask: ``(B, 1, H, W)``; output: ``(B, 1, h, w)``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import resize_mask
        >>> mask = torch.zeros(1, 1, 4, 4)
        >>> mask[..., :2, :] = 1  # the top half
        >>> resize_mask(mask, (2, 1)).flatten().tolist()
        [1.0, 0.0]
    """
    if len(size) != 2:
        raise InvalidValueError(f"a mask is resized to an (h, w) grid, not to {tuple(size)}")
    if tuple(mask.shape[-2:]) == tuple(size):
        return mask
    return F.adaptive_avg_pool2d(mask, (int(size[0]), int(size[1])))


def masked_mean(values: Tensor, mask: Tensor, normalization: MaskNormalization = "mask") -> Tensor:
    r"""Per-sample mean of ``values`` weighted by ``mask`` on their last two (position) dimensions.

    ``"image"``: ``\operatorname{mean}(v \cdot m)`` over every dimension but the batch (masked-out
    positions count 0); ``"mask"``: that divided by ``\operatorname{mean}(m)``, the mean over the masked
    positions (``\sum v m / (K \sum m)`` for ``K`` values per position). An all-ones mask gives
    ``_per_sample_mean(values)`` bitwise; an all-zeros mask gives 0, with a zero gradient.

    Shape:
        values: ``(B, ..., h, w)``; mask: ``(B, 1, h, w)`` or ``(1, 1, h, w)``; output: ``(B,)``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import masked_mean
        >>> values = torch.arange(4.0).reshape(1, 1, 2, 2)
        >>> mask = torch.tensor([[[[1.0, 1.0], [0.0, 0.0]]]])
        >>> masked_mean(values, mask), masked_mean(values, mask, "image")
        (tensor([0.5000]), tensor([0.2500]))
    """
    check_mask_normalization(normalization)
    weighted = _per_sample_mean(values * on_positions(mask, values))
    return weighted / mask_area(mask) if normalization == "mask" else weighted


def on_positions(mask: Tensor, values: Tensor) -> Tensor:
    """``mask`` (``(B, 1, h, w)``) shaped to broadcast over ``values`` (``(B, ..., h, w)``): its grid last."""
    grid = tuple(mask.shape[2:])
    if values.dim() < 1 + len(grid) or tuple(values.shape[values.dim() - len(grid) :]) != grid:
        raise InvalidValueError(f"values of shape {tuple(values.shape)} do not end with the mask's grid {grid}")
    return mask.reshape(mask.shape[0], *([1] * (values.dim() - 1 - len(grid))), *grid)


def mask_area(mask: Tensor) -> Tensor:
    """Each sample's mean mask weight (the masked area over the grid's), what ``"mask"`` normalization divides by;
    1 for an all-zeros mask, whose weighted sums are 0: their quotient is 0, and so is its gradient (a tiny divisor
    would make it ``inf * 0``, NaN).

    Shape:
        mask: ``(B, 1, h, w)``; output: ``(B,)``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import mask_area
        >>> mask = torch.zeros(2, 1, 2, 2)
        >>> mask[0, 0, 0] = 1  # the top row of the first sample; the second is empty
        >>> mask_area(mask)
        tensor([0.5000, 1.0000])
    """
    area = _per_sample_mean(mask)
    return torch.where(area > 0, area, torch.ones_like(area))
