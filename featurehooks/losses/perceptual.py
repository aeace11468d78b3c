"""PerceptualLoss: distances between deep features of an output and a target (content loss)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..backbones import BackboneSpec
from ..extractor import FeatureExtractor
from ..functional import Distance, MaskNormalization, Reduction, channel_normalize
from ._base import FeatureLoss, InputSize, LayerWeights, takes_old_resize

__all__ = ["PerceptualLoss"]


class PerceptualLoss(FeatureLoss):
    r"""Perceptual (feature reconstruction, content) loss on a frozen pretrained backbone.

    For each layer and sample, the elementwise ``distance`` between the features of input and
    target is averaged over C, H and W; layers are summed with ``layer_weights``; ``reduction``
    acts over the batch. Target features are computed without a graph unless the target requires
    grad; a target with batch 1 is broadcast over the input batch.

    Relations to reference implementations (tested): with ``reduction="none"`` on ``relu3_3``,
    ``256 *`` this loss equals piq's ``ContentLoss``; with ``normalize_features=True``, layers
    ``relu1_2 ... relu5_3`` and ``layer_weights`` equal to their channel counts it equals
    ``lpips.LPIPS(net="vgg", lpips=False)``. For LPIPS itself, calibrated or not, use
    ``featurehooks.LPIPS``.

    Args:
        backbone: backbone name (``"vgg16"``), ``nn.Module``, or a shared ``FeatureExtractor``
            built with ``mode="grad"`` (then ``weights`` and ``input_range`` are taken from it).
        layers: layers to compare; default the keys of a ``layer_weights`` dict, else ``("relu3_3",)``,
            or every layer of a shared extractor.
        layer_weights: a weight per layer (dict by name, or a sequence aligned with ``layers``);
            default 1 each. A dict alone names the layers too, as BasicSR and KAIR configs do.
        distance: ``"mse"`` (default), ``"l1"``, ``"smooth_l1"``, ``"charbonnier"``, ``"cosine"``
            (one minus the cosine similarity over channels at each position, averaged over the
            positions: DINO/CLIP feature losses), ``"fro"`` (BasicSR's ``criterion: fro``: one
            Frobenius norm of the whole batch's difference per layer, so only with ``reduction="mean"``
            and without a mask), or a callable ``(input, target) -> Tensor`` of elementwise values,
            which are averaged per sample over every dimension but the batch before ``reduction`` (so
            ``F.l1_loss``-style means over the whole batch come out the same); see
            ``functional.DISTANCES``.
        normalize_features: scale each feature vector to unit length over channels first (LPIPS).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (one value per sample).
        mask_normalization: with a ``mask=`` in the call, each layer's weighted sum over its positions is
            divided by the mask's area there (``"mask"``, default: the mean over the masked region) or by
            the whole grid (``"image"``: the mean over the image, masked-out positions counting 0).
        input_size: the exact ``(H, W)`` (an int: a square) input and target are resized to before the
            backbone; ``None`` (default) leaves them as they are. Formerly ``resize``, which still works
            with a FutureWarning.
        **extractor_options: keyword arguments of the ``FeatureExtractor`` built for the loss:
            ``weights``, ``input_range`` (the value range of your images, e.g. ``(-1, 1)``),
            ``mean``/``std``, ``normalize=False`` (images to the backbone as they are),
            ``memory_format``, ``precision="bf16"`` (the backbone in bfloat16, the loss in float32)...
            (not with a shared extractor, whose own settings apply).

    Input and target run in two forwards (the target's without a graph): one forward of the
    concatenated batch is slower, because the backward then runs over the target's rows too
    (measured in docs/performance.md).

    A ``mask=`` in the call (``(B, 1, H, W)`` weights in [0, 1] on the images' pixels) compares the masked
    region only: each layer's per-position distances are weighted by the mask's area average over that
    layer's cells (``functional.resize_mask``) and normalized as ``mask_normalization`` says; an all-ones
    mask gives the unmasked loss bitwise, an all-zeros one 0 (with a warning). ``return_layers=True``
    returns each layer's weighted term too (they sum to the total).

    Shape:
        input: ``(B, 3, H, W)``; target: ``(B, 3, H, W)`` or ``(1, 3, H, W)``; mask: ``(B, 1, H, W)`` or
        ``(1, 1, H, W)``; output: scalar, or ``(B,)`` with ``reduction="none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.losses import PerceptualLoss
        >>> loss_fn = PerceptualLoss("vgg16", layers=["relu2_2", "relu3_3"], weights=None)
        >>> output = torch.rand(2, 3, 64, 64, requires_grad=True)
        >>> loss = loss_fn(output, torch.rand(2, 3, 64, 64))
        >>> loss.backward()
        >>> hole = torch.zeros(2, 1, 64, 64)
        >>> hole[..., 16:48, 16:48] = 1  # compare inside the hole only
        >>> loss, terms = loss_fn(output, torch.rand(2, 3, 64, 64), mask=hole, return_layers=True)
        >>> sorted(terms), bool(torch.isclose(terms["relu2_2"] + terms["relu3_3"], loss))
        (['relu2_2', 'relu3_3'], True)

    References:
        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV. https://arxiv.org/abs/1603.08155

        Zhang, Isola, Efros, Shechtman, Wang (2018). The Unreasonable Effectiveness of Deep
        Features as a Perceptual Metric. CVPR. https://arxiv.org/abs/1801.03924
    """

    @takes_old_resize
    def __init__(
        self,
        backbone: BackboneSpec | FeatureExtractor = "vgg16",
        layers: str | Sequence[str] | None = None,
        *,
        layer_weights: LayerWeights = None,
        distance: Distance = "mse",
        normalize_features: bool = False,
        reduction: Reduction = "mean",
        mask_normalization: MaskNormalization = "mask",
        input_size: InputSize = None,
        **extractor_options: Any,
    ) -> None:
        super().__init__(
            backbone, layers, layer_weights, distance, reduction, input_size, extractor_options, mask_normalization
        )
        self.normalize_features = normalize_features

    def statistic(self, features: Tensor) -> Tensor:
        """Features in float32 (float64 stays), unit-normalized over channels if ``normalize_features``."""
        if self.normalize_features:
            return channel_normalize(features)
        return features.to(torch.promote_types(features.dtype, torch.float32))

    def extra_repr(self) -> str:
        return super().extra_repr() + (", normalize_features=True" if self.normalize_features else "")
