"""FeatureMatchingLoss: distances between a discriminator's features of fake and real images."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Union, cast

import torch
from torch import Tensor, nn

from .. import functional
from .._layout import channels_first
from ..errors import InvalidTypeError, InvalidValueError
from ._base import LayerWeights, layer_mask, resolve_layer_weights

__all__ = ["FeatureMatchingLoss"]

_LAYOUTS = ("NCHW", "NHWC", "NLC")
Features = Union[Mapping[str, Tensor], Sequence[Tensor]]
MultiScaleFeatures = Union[Features, Sequence[Features]]


def _as_scales(features: MultiScaleFeatures, side: str) -> list[list[tuple[str, Tensor]]]:
    """``[[(name, tensor), ...] per discriminator]`` from a dict, a list, or a list of dicts/lists."""
    if isinstance(features, Tensor):
        raise InvalidTypeError(
            f"{side} must be a dict or list of feature tensors (or a list of those), not a single Tensor"
        )
    if isinstance(features, Mapping):
        return [_named(features, side)]
    if not isinstance(features, Sequence) or not features:
        raise InvalidTypeError(
            f"{side} must be a non-empty dict, list of Tensors, or list of lists; got {features!r:.80}"
        )
    if all(isinstance(item, Tensor) for item in features):
        return [_named(cast(Sequence[Tensor], features), side)]
    if all(isinstance(item, (Mapping, Sequence)) and not isinstance(item, Tensor) for item in features):
        return [_named(cast(Features, item), side) for item in features]
    raise InvalidTypeError(f"{side} mixes Tensors and containers; pass a list of Tensors or a list of lists")


def _by_name(features: MultiScaleFeatures, index: int) -> bool:
    """Whether discriminator ``index``'s features were given as a dict (so they have layer names)."""
    return isinstance(features, Mapping) or isinstance(features[index], Mapping)  # type: ignore[index]


def _named(features: Features, side: str) -> list[tuple[str, Tensor]]:
    items = list(features.items()) if isinstance(features, Mapping) else [(str(i), f) for i, f in enumerate(features)]
    if not items:
        raise InvalidValueError(f"{side} holds no features")
    for name, value in items:
        if not isinstance(value, Tensor):
            raise InvalidTypeError(f"{side} feature {name!r} is a {type(value).__name__}, not a Tensor")
        functional.check_batch(value, f"{side} feature {name!r}")
    return items


class FeatureMatchingLoss(nn.Module):
    r"""Feature matching loss between a discriminator's intermediate features of fake and real images.

    Per layer and sample, the elementwise ``distance`` (L1 by default) is averaged over all
    non-batch dimensions; layers are summed with ``layer_weights``; with several discriminators
    (multi-scale, a list of lists) the per-discriminator sums are averaged, as in pix2pixHD
    (whose per-layer weight is ``4 / (n_layers + 1)`` and whose loss weight is 10). The real side
    is detached, so only the generator receives gradients through the fake features.

    A ``mask=`` in the call (``(B, 1, H, W)`` weights in [0, 1] on the images' pixels, at any resolution)
    compares the masked region only, as the other feature losses do: each layer's per-position
    distances are weighted by the mask's area average over that layer's cells
    (``functional.resize_mask``) and divided by the mask's area there (``mask_normalization="mask"``)
    or the whole grid's (``"image"``). Every layer of every discriminator covers the whole image, so
    one mask serves the scales of a multi-scale discriminator alike. Features without an ``(h, w)``
    grid (``"NLC"`` tokens, final logits as vectors) take no mask. ``return_layers=True`` returns each
    layer's term too, by name (``"<discriminator>/<name>"`` with several discriminators), the
    per-discriminator mean included, so that they sum to the total.

    Capture the features with ``featurehooks.capture`` during the discriminator forwards you run
    anyway (copy the dict after each forward, since every forward refills it)::

        with fh.capture(discriminator, ["blocks.1", "blocks.2", "blocks.3"]) as feats:
            fake_logits = discriminator(fake)
            fake_feats = dict(feats)
            real_logits = discriminator(real)
            real_feats = dict(feats)
        loss_fm = fh.FeatureMatchingLoss()(fake_feats, real_feats)

    Args:
        layer_weights: a weight per layer: a dict by name (dict features) or a sequence aligned
            with each discriminator's list of features; default 1 each.
        distance: ``"l1"`` (default), ``"mse"``, ... or a callable; see ``functional.DISTANCES``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (one value per sample).
        mask_normalization: ``"mask"`` (default: the mean over the masked region) or ``"image"`` (the
            mean over the whole grid, masked-out positions counting 0).
        layout: where the channels of the features sit: ``"NCHW"`` (default, also any ``(B, C, ...)``),
            ``"NHWC"`` (channels last, e.g. Swin) or ``"NLC"`` (transformer tokens), or a dict of
            those by layer name. Elementwise distances average the same over any layout; the
            channel-wise ones (``"cosine"``, your callables) see ``(B, C, ...)`` features.

    Shape:
        fake, real: ``{name: (B, ...)}``, ``[(B, ...), ...]`` or ``[[(B, ...), ...], ...]`` with
        matching structure and shapes; mask: ``(B, 1, H, W)`` or ``(1, 1, H, W)``; output: scalar, or
        ``(B,)`` with ``reduction="none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.losses import FeatureMatchingLoss
        >>> fake = [torch.rand(2, 8, 16, 16, requires_grad=True), torch.rand(2, 16, 8, 8)]
        >>> real = [torch.rand(2, 8, 16, 16), torch.rand(2, 16, 8, 8)]
        >>> FeatureMatchingLoss()(fake, real).shape
        torch.Size([])

    References:
        Salimans et al. (2016). Improved Techniques for Training GANs. NeurIPS.

        Wang, Liu, Zhu, Tao, Kautz, Catanzaro (2018). High-Resolution Image Synthesis and Semantic
        Manipulation with Conditional GANs (pix2pixHD). CVPR. https://arxiv.org/abs/1711.11585
    """

    def __init__(
        self,
        layer_weights: LayerWeights = None,
        *,
        distance: functional.Distance = "l1",
        reduction: functional.Reduction = "mean",
        mask_normalization: functional.MaskNormalization = "mask",
        layout: str | Mapping[str, str] = "NCHW",
    ) -> None:
        super().__init__()
        for kind in layout.values() if isinstance(layout, Mapping) else [layout]:
            if kind not in _LAYOUTS:
                raise InvalidValueError(f"layout must be one of {_LAYOUTS} (or a dict of them by layer), not {kind!r}")
        self.layout = layout
        self.layer_weights = layer_weights
        self.distance = distance
        self._distance = functional.resolve_distance(distance)
        functional.check_reduction(reduction)
        self.reduction: functional.Reduction = reduction
        functional.check_mask_normalization(mask_normalization)
        self.mask_normalization: functional.MaskNormalization = mask_normalization

    def forward(
        self,
        fake: MultiScaleFeatures,
        real: MultiScaleFeatures,
        *,
        mask: Tensor | None = None,
        return_layers: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The loss between ``fake`` features (with graph) and ``real`` features (detached), inside ``mask`` if given;
        with ``return_layers``, also each layer's term by name (see the class docstring)."""
        fake_scales, real_scales = _as_scales(fake, "fake"), _as_scales(real, "real")
        if len(fake_scales) != len(real_scales):
            raise InvalidValueError(
                f"fake has features of {len(fake_scales)} discriminators but real of {len(real_scales)}"
            )
        first = fake_scales[0][0][1]
        checked = None if mask is None else functional.check_mask(mask, first.shape[0], None, first.device)
        per_scale, layer_terms = [], {}
        for index, (fake_items, real_items) in enumerate(zip(fake_scales, real_scales)):
            where = f"discriminator {index}: " if len(fake_scales) > 1 else ""
            names = [name for name, _ in fake_items]
            real_by_name = dict(real_items)
            if sorted(names) != sorted(real_by_name):
                raise InvalidValueError(f"{where}fake has layers {names} but real has {list(real_by_name)}")
            if isinstance(self.layer_weights, Mapping) and not _by_name(fake, index):
                raise InvalidTypeError(
                    "layer_weights by name needs features given as dicts; give a list of weights instead"
                )
            weights = resolve_layer_weights(self.layer_weights, names)
            terms = []
            for (name, fake_value), weight in zip(fake_items, weights):
                real_value = real_by_name[name].detach()
                if fake_value.shape[1:] != real_value.shape[1:] or real_value.shape[0] not in (1, fake_value.shape[0]):
                    raise InvalidValueError(
                        f"{where}layer {name!r}: fake {tuple(fake_value.shape)} and real {tuple(real_value.shape)} "
                        "do not match"
                    )
                kind = self.layout.get(name, "NCHW") if isinstance(self.layout, Mapping) else self.layout
                a = channels_first(fake_value.to(torch.promote_types(fake_value.dtype, torch.float32)), kind)
                b = channels_first(real_value.to(a.dtype), kind)
                if checked is None:
                    terms.append(weight * functional.feature_distance(a, b, self._distance))
                else:
                    grid = layer_mask(checked, a, name)
                    terms.append(
                        weight * functional.feature_distance(a, b, self._distance, grid, self.mask_normalization)
                    )
                if return_layers:
                    layer_terms[f"{index}/{name}" if len(fake_scales) > 1 else name] = terms[-1]
            per_scale.append(sum(terms[1:], terms[0]))
        total = functional.reduce_loss(sum(per_scale[1:], per_scale[0]) / len(per_scale), self.reduction)
        if not return_layers:
            return total
        scales = len(per_scale)
        return total, {key: functional.reduce_loss(term / scales, self.reduction) for key, term in layer_terms.items()}

    def extra_repr(self) -> str:
        weights = f"layer_weights={self.layer_weights!r}, " if self.layer_weights is not None else ""
        layout = f", layout={self.layout!r}" if self.layout != "NCHW" else ""
        return f"{weights}distance={self.distance!r}, reduction={self.reduction!r}{layout}"
