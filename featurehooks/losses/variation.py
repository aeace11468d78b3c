"""TotalVariationLoss: a smoothness prior on generated images."""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn

from ..errors import InvalidValueError
from ..functional import Reduction, check_reduction, total_variation

__all__ = ["TotalVariationLoss"]


class TotalVariationLoss(nn.Module):
    r"""Total variation of the input: the mean absolute (``"l1"``) or squared (``"l2"``) difference
    between vertically and horizontally neighbouring pixels, per sample; see
    ``featurehooks.functional.total_variation``. It depends on the input only (``takes_target`` is
    False), so in a ``LossGroup`` it is called without the target.

    Args:
        norm: ``"l1"`` (anisotropic TV, default) or ``"l2"`` (squared differences).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the batch.

    Shape:
        input: ``(B, C, H, W)``; output: scalar, or ``(B,)`` with ``reduction="none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.losses import TotalVariationLoss
        >>> TotalVariationLoss()(torch.rand(2, 3, 32, 32)).shape
        torch.Size([])

    References:
        Mahendran, Vedaldi (2015). Understanding Deep Image Representations by Inverting Them. CVPR.

        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV.
    """

    takes_target = False

    def __init__(self, norm: Literal["l1", "l2"] = "l1", *, reduction: Reduction = "mean") -> None:
        super().__init__()
        if norm not in ("l1", "l2"):
            raise InvalidValueError(f"norm must be 'l1' or 'l2', not {norm!r}")
        check_reduction(reduction)
        self.norm: Literal["l1", "l2"] = norm
        self.reduction: Reduction = reduction

    def forward(self, input: Tensor) -> Tensor:
        """Total variation of ``input``."""
        return total_variation(input, self.norm, self.reduction)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}, reduction={self.reduction!r}"
