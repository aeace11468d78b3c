"""Gradient scaling through a float16 backbone, so that a float32 loss's gradients neither vanish nor overflow there.

float16's smallest value is 6e-8 and its largest 65504; the gradient of a loss reduced by a mean over millions of
feature values is about the former, and a Gram loss's far smaller (measured: every input-gradient entry of a
StyleLoss became 0, 18% of a PerceptualLoss's at 224 px). A forward in ``precision="fp16"`` that builds a graph
therefore widens its features to float32 in one autograd node (``widen``) whose backward sees the gradients of all
of them at once and scales them by one power of two, chosen so that the largest is ``TARGET``, before they enter
the float16 backbone; the node that cast the images to float16 (``narrow``) divides the gradient it hands back by
the same power. Scaling by a power of two is exact, as ``torch.amp.GradScaler``'s is; unlike it, the factor comes
from this backward's own gradients (no step is skipped) and stays on their device (no synchronization).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TARGET", "GradScale", "narrow", "widen"]

# the largest scaled gradient entering the backbone: 2^8 leaves a factor of 256 before float16's 65504 for the
# gradients to grow on their way back to the images, and 2^-32 of it still above float16's smallest value
TARGET = 2.0**8


class GradScale:
    """The factor the gradients of one float16 forward carry through the backbone: set by ``widen``'s backward,
    taken off by ``narrow``'s (None before any backward)."""

    __slots__ = ("factor",)

    def __init__(self) -> None:
        self.factor: Tensor | None = None


def _power_of_two(largest: Tensor) -> Tensor:
    """The power of two that brings ``largest`` nearest ``TARGET`` from below (1 for a NaN, 2^64 for 0)."""
    exponent = torch.floor(torch.log2(TARGET / largest)).clamp(-64, 64)
    return torch.exp2(torch.nan_to_num(exponent, nan=0.0))


class _Narrow(torch.autograd.Function):
    """The images cast to float16; backward: their gradient in float32, the scale taken off."""

    @staticmethod
    def forward(ctx: Any, images: Tensor, scale: GradScale) -> Tensor:
        ctx.scale, ctx.dtype = scale, images.dtype
        return images.to(torch.float16)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        widened = grad.to(ctx.dtype)
        factor = ctx.scale.factor
        return (widened if factor is None else widened / factor), None


class _Widen(torch.autograd.Function):
    """Float16 features as float32 ones; backward: their gradients scaled by one power of two, in float16."""

    @staticmethod
    def forward(ctx: Any, scale: GradScale, *features: Tensor) -> tuple[Tensor, ...]:
        ctx.scale = scale
        return tuple(feature.float() for feature in features)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        present = [grad for grad in grads if grad is not None and grad.numel()]
        if not present:
            return (None, *grads)
        with torch.no_grad():
            largest = torch.stack([grad.detach().abs().amax().float() for grad in present]).amax()
            factor = _power_of_two(largest)
        ctx.scale.factor = factor
        return (None, *(None if grad is None else (grad * factor).to(torch.float16) for grad in grads))


# Both run outside torch.compile's graphs: the factor passes from one backward to the other through ``GradScale``,
# a side effect a compiled backward drops (measured: the gradients then came back still scaled).
@torch.compiler.disable  # type: ignore[misc]
def narrow(images: Tensor, scale: GradScale) -> Tensor:
    """``images`` in float16, their gradient unscaled by ``scale``."""
    return _Narrow.apply(images, scale)  # type: ignore[no-any-return, no-untyped-call]


@torch.compiler.disable  # type: ignore[misc]
def widen(features: Sequence[Tensor], scale: GradScale) -> tuple[Tensor, ...]:
    """``features`` in float32, their gradients scaled into ``scale`` on the way back."""
    return _Widen.apply(scale, *features)  # type: ignore[no-any-return, no-untyped-call]
