"""StyleLoss: distances between Gram matrices of deep features (texture statistics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..backbones import BackboneSpec
from ..errors import InvalidValueError
from ..extractor import FeatureExtractor
from ..functional import Distance, GramNormalization, MaskNormalization, Reduction, gram_matrix
from ._base import FeatureLoss, InputSize, LayerWeights, takes_old_resize

__all__ = ["StyleLoss"]

_GRAM_NORMALIZATIONS = ("chw", "hw", "none")


class StyleLoss(FeatureLoss):
    r"""Style loss: per layer and sample, the mean over C x C of the squared difference of Gram matrices.

    Gram matrices are computed in float32 with autocast disabled (they overflow in float16). The
    target may differ in size from the input, since a Gram matrix is C x C whatever H and W are.
    For a fixed style image, call ``set_target(style)`` (or pass ``target=``) once: its Grams are
    computed a single time, kept in float32 on the module's device, and the loss is then called
    with the input alone. They are not written to ``state_dict()``.

    With ``gram_normalization="none"`` this equals piq's ``StyleLoss`` (tested).

    A ``mask=`` in the call (``(B, 1, H, W)`` weights in [0, 1] on the images' pixels) compares the Gram
    matrices of the masked region, as masked style-transfer code computes them: each layer's features are
    multiplied by the mask's area average over its cells (``functional.resize_mask``), and the ``H * W``
    that ``gram_normalization`` divides by becomes the mask's area there (``mask_normalization="mask"``;
    ``"image"`` keeps ``H * W``); see ``functional.gram_matrix``. The mask applies to the input and to a
    target passed in the call (then of the input's size); a fixed target keeps the Grams it was set with
    (``set_target(style, mask=...)`` for a region of the style image). A sample whose mask is all zeros
    has a loss of 0 (with a warning).

    Args:
        backbone: backbone name, ``nn.Module``, or a shared ``FeatureExtractor`` (``mode="grad"``).
        layers: layers whose Grams are compared; default the keys of a ``layer_weights`` dict, else
            Johnson et al.'s VGG16 style layers ``("relu1_2", "relu2_2", "relu3_3", "relu4_3")``, or
            every layer of a shared extractor.
        layer_weights: a weight per layer (dict by name, or a sequence aligned with ``layers``); a
            dict alone names the layers too.
        distance: ``"mse"`` (default), ``"l1"``, ``"smooth_l1"``, ... or a callable, averaged over
            C x C per sample (``"cosine"``: over the C columns of the Grams); ``"fro"``: one Frobenius
            norm over the whole batch (BasicSR, without a mask).
        gram_normalization: ``"chw"`` (default, Johnson et al.), ``"hw"`` or ``"none"`` (Gatys et al., piq).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (one value per sample).
        mask_normalization: what masked Grams divide by: the mask's area (``"mask"``, default) or the
            whole grid's (``"image"``).
        input_size: the exact ``(H, W)`` (an int: a square) images are resized to before the backbone
            (formerly ``resize``, which still works with a FutureWarning).
        target: a fixed style image, same as calling ``set_target(target)``.
        **extractor_options: keyword arguments of the ``FeatureExtractor`` built for the loss
            (``weights``, ``input_range``, ``mean``/``std``, ``normalize``, ``memory_format``,
            ``precision``...).

    Shape:
        input: ``(B, 3, H, W)``; target: ``(B, 3, H', W')`` or ``(1, 3, H', W')``; output: scalar,
        or ``(B,)`` with ``reduction="none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.losses import StyleLoss
        >>> style = torch.rand(1, 3, 96, 96)
        >>> loss_fn = StyleLoss("vgg16", layers=["relu1_2", "relu2_2"], weights=None, target=style)
        >>> loss_fn(torch.rand(2, 3, 64, 64)).shape
        torch.Size([])

    References:
        Gatys, Ecker, Bethge (2016). Image Style Transfer Using Convolutional Neural Networks. CVPR.

        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV. https://arxiv.org/abs/1603.08155
    """

    default_layers = ("relu1_2", "relu2_2", "relu3_3", "relu4_3")

    @takes_old_resize
    def __init__(
        self,
        backbone: BackboneSpec | FeatureExtractor = "vgg16",
        layers: str | Sequence[str] | None = None,
        *,
        layer_weights: LayerWeights = None,
        distance: Distance = "mse",
        gram_normalization: GramNormalization = "chw",
        reduction: Reduction = "mean",
        mask_normalization: MaskNormalization = "mask",
        input_size: InputSize = None,
        target: Tensor | None = None,
        **extractor_options: Any,
    ) -> None:
        if gram_normalization not in _GRAM_NORMALIZATIONS:
            raise InvalidValueError(
                f"gram_normalization must be one of {_GRAM_NORMALIZATIONS}, not {gram_normalization!r}"
            )
        super().__init__(
            backbone, layers, layer_weights, distance, reduction, input_size, extractor_options, mask_normalization
        )
        self.gram_normalization: GramNormalization = gram_normalization
        if target is not None:
            self.set_target(target)

    def statistic(self, features: Tensor) -> Tensor:
        """The Gram matrix of one layer's features (float32)."""
        return gram_matrix(features, self.gram_normalization)

    def masked_statistic(self, features: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """The Gram matrix of the masked region (``mask`` on the features' grid); nothing left for the distance."""
        return gram_matrix(features, self.gram_normalization, mask, self.mask_normalization), None

    @torch.no_grad()
    def set_target(self, target: Tensor, mask: Tensor | None = None) -> None:
        """Compute the target's Grams once (of its region under ``mask``) and reuse them for every call without a
        target.

        Shape:
            target: ``(1, C, H, W)`` (broadcast over the input batch) or ``(B, C, H, W)``; mask: ``(1, 1, H, W)``
            or ``(B, 1, H, W)`` on the target's pixels.
        """
        self._store_target(target, mask)

    def _needs_same_size(self) -> bool:
        return False

    def _shape_message(self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> str:
        return (
            f"input {input_shape} and target {target_shape} do not match: the target needs the input's "
            "channels and a batch of 1 or the input's batch (its size may differ)"
        )

    def extra_repr(self) -> str:
        fixed = ", fixed target" if self.has_target else ""
        return super().extra_repr() + f", gram_normalization={self.gram_normalization!r}{fixed}"
