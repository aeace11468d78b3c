"""The shell shared by feature losses: extractor, layer weights, targets, resizing and reduction.

A feature loss runs in three steps (the template of piq and lpips): features of input and target
from a frozen backbone, a per-layer statistic of each (the features, normalized features or Gram
matrices), then a per-layer, per-sample distance, summed over layers with weights and reduced over
the batch. Subclasses only define the statistic.
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, Union, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._layout import channels_first
from ..backbones import BackboneSpec
from ..errors import InvalidTypeError, InvalidValueError
from ..extractor import FeatureExtractor
from ..functional import (
    BATCH_DISTANCES,
    Distance,
    MaskNormalization,
    Reduction,
    check_batch,
    check_images,
    check_mask,
    check_mask_normalization,
    check_reduction,
    feature_distance,
    reduce_loss,
    resize_mask,
    resolve_distance,
)

LayerWeights = Union[Mapping[str, float], Sequence[float], None]
InputSize = Union[int, tuple[int, int], None]
P = ParamSpec("P")
R = TypeVar("R")


def _float32_or_wider(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def resolve_layer_weights(layer_weights: LayerWeights, layers: Sequence[str]) -> list[float]:
    """One float per layer from a dict by name, a sequence aligned with ``layers``, or None (all 1)."""
    if layer_weights is None:
        return [1.0] * len(layers)
    if isinstance(layer_weights, Mapping):
        unknown = [name for name in layer_weights if name not in layers]
        if unknown:
            raise InvalidValueError(f"layer_weights names layers that are not in layers={list(layers)}: {unknown}")
        missing = [name for name in layers if name not in layer_weights]
        if missing:
            raise InvalidValueError(f"layer_weights has no weight for {missing}; give one per layer in {list(layers)}")
        return [float(layer_weights[name]) for name in layers]
    if isinstance(layer_weights, (str, bytes)) or not isinstance(layer_weights, Iterable):
        raise InvalidTypeError(
            f"layer_weights must be a dict by layer name or a sequence of floats, got {layer_weights!r}"
        )
    weights = [float(w) for w in layer_weights]
    if len(weights) != len(layers):
        raise InvalidValueError(
            f"{len(weights)} layer_weights for {len(layers)} layers {list(layers)}; give one per layer"
        )
    return weights


def check_input_size(input_size: InputSize) -> tuple[int, int] | None:
    """``None``, or ``(height, width)`` from an int (square) or a pair of positive ints; a bool is a mistake."""
    if input_size is None:
        return None
    expected = f"input_size must be None (no resize), a positive int or (height, width), not {input_size!r}"
    if isinstance(input_size, bool):
        raise InvalidTypeError(f"{expected}; a bool is no size: give one (224 or (224, 224)), or None not to resize")
    pair = (
        list(input_size)
        if isinstance(input_size, Sequence) and not isinstance(input_size, str)
        else [input_size, input_size]
    )
    sizes = [_positive_int(value) for value in pair]
    if len(sizes) != 2 or sizes[0] is None or sizes[1] is None:
        raise InvalidValueError(expected)
    return (sizes[0], sizes[1])


def _positive_int(value: object) -> int | None:
    """``value`` as an int if it is a positive integer (numpy's too) and not a bool, else None."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return number if number > 0 else None


def takes_old_resize(function: Callable[P, R]) -> Callable[P, R]:
    """Let ``function`` take ``resize=``, the old spelling of ``input_size=``, with a FutureWarning naming the new."""

    @functools.wraps(function)
    def renamed(*args: P.args, **kwargs: P.kwargs) -> R:
        if "resize" in kwargs:
            if "input_size" in kwargs:
                raise InvalidTypeError("both input_size= and resize= were given; resize= is its old name: drop it")
            warnings.warn(
                "resize= is renamed input_size= (the exact size images are resized to before the backbone, not the "
                "shorter side that resize_size= means elsewhere); write input_size=, resize= will be removed",
                FutureWarning,
                stacklevel=2,
            )
            kwargs["input_size"] = kwargs.pop("resize")
        return function(*args, **kwargs)

    return renamed


def as_layer_list(layers: str | Sequence[str]) -> list[str]:
    """Layer names as a list; a single string is one layer."""
    names = [layers] if isinstance(layers, str) else list(layers)
    if not names:
        raise InvalidValueError("layers is empty; name at least one layer, e.g. layers=['relu3_3']")
    for name in names:
        if not isinstance(name, str):
            raise InvalidTypeError(f"layer names must be strings, got {name!r}")
    return names


def layer_mask(mask: Tensor, features: Tensor, name: str) -> Tensor:
    """``mask`` (image coordinates) on the grid of one layer's channels-first ``(B, C, h, w)`` features, by
    ``functional.resize_mask``'s area average; tokens and pooled vectors have no grid and are refused."""
    if features.dim() != 4:
        raise InvalidValueError(
            f"layer {name!r} gives features of shape {tuple(features.shape)} (channels first) without an (h, w) grid "
            "to resize a mask to: tokens or pooled vectors; for a ViT, build the extractor with output_format='nchw' "
            "(patch tokens as maps)"
        )
    return resize_mask(mask, features.shape[-2:])


def grad_extractor(backbone: BackboneSpec, layers: Sequence[str], options: Mapping[str, Any]) -> FeatureExtractor:
    """The ``mode="grad"`` extractor a loss runs on, built with the user's ``FeatureExtractor`` options."""
    if "mode" in options:
        raise InvalidValueError("a loss's extractor always runs in mode='grad' (gradients reach the input); drop mode")
    return FeatureExtractor(backbone, list(layers), mode="grad", **options)


class FeatureLoss(nn.Module):
    """Base class of losses computed on features of a frozen backbone (see PerceptualLoss, StyleLoss).

    Holds a ``FeatureExtractor`` in ``mode="grad"``: the backbone stays outside the module tree, so
    the loss has no parameters, adds nothing to ``state_dict()`` and stays in eval mode whatever its
    parent does. Pass an existing ``FeatureExtractor`` as ``backbone`` to share one extractor (and
    one forward, see ``LossGroup`` and ``from_features``) between several losses.

    A fixed target (``set_target``) is computed once and kept out of ``state_dict()``: it is
    derived from an image, not learned, and saving it would make checkpoints large and their keys
    depend on whether a target was set. Call ``set_target`` again after loading a checkpoint.

    A new loss overrides ``statistic``, the per-layer quantity compared (``StyleLoss``: a Gram matrix).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import FeatureLoss
        >>> class ChannelMeanLoss(FeatureLoss):
        ...     def __init__(self, backbone, layers, **extractor_options):
        ...         super().__init__(
        ...             backbone, layers, layer_weights=None, distance="l1", reduction="mean", input_size=None,
        ...             extractor_options=extractor_options,
        ...         )
        ...
        ...     def statistic(self, features):
        ...         return features.mean(dim=(2, 3))  # each channel's mean activation
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
        >>> loss_fn = ChannelMeanLoss(net, ["1"])
        >>> loss_fn(torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16)).shape
        torch.Size([])
    """

    default_layers: tuple[str, ...] = ("relu3_3",)

    @takes_old_resize
    def __init__(
        self,
        backbone: BackboneSpec | FeatureExtractor,
        layers: str | Sequence[str] | None,
        layer_weights: LayerWeights,
        distance: Distance,
        reduction: Reduction,
        input_size: InputSize,
        extractor_options: Mapping[str, Any],
        mask_normalization: MaskNormalization = "mask",
    ) -> None:
        super().__init__()
        if layers is None and isinstance(layer_weights, Mapping):
            layers = list(layer_weights)  # BasicSR/KAIR configs: one dict of layer -> weight
        if isinstance(backbone, FeatureExtractor):
            if backbone.mode != "grad":
                raise InvalidValueError("a shared FeatureExtractor must use mode='grad' so gradients reach the input")
            if extractor_options:
                raise InvalidValueError(
                    f"{sorted(extractor_options)} come from the shared FeatureExtractor; set them where it is built"
                )
            names = as_layer_list(layers) if layers is not None else list(backbone.layers)
            missing = [name for name in names if name not in backbone.layers]
            if missing:
                raise InvalidValueError(
                    f"layers {missing} are not computed by the shared FeatureExtractor (it has {backbone.layers}); "
                    "build it over the union of the layers of every loss that shares it"
                )
            self.extractor = backbone
        else:
            names = as_layer_list(layers if layers is not None else self.default_layers)
            self.extractor = grad_extractor(backbone, names, extractor_options)
        self.layers: list[str] = names
        self.layer_weights = resolve_layer_weights(layer_weights, names)
        self.distance = distance
        check_reduction(reduction)
        self._whole_batch = isinstance(distance, str) and distance in BATCH_DISTANCES
        if self._whole_batch and reduction != "mean":
            raise InvalidValueError(
                f"distance={distance!r} is one norm over the whole batch (BasicSR's criterion), with no per-sample "
                f"value to {reduction!r}: use reduction='mean'"
            )
        self._distance: Callable[[Tensor, Tensor], Tensor] = (
            BATCH_DISTANCES[distance] if self._whole_batch else resolve_distance(distance)  # type: ignore[index]
        )
        self.reduction: Reduction = reduction
        self.input_size = check_input_size(input_size)
        check_mask_normalization(mask_normalization)
        self.mask_normalization: MaskNormalization = mask_normalization
        self._target: list[Tensor] | None = None

    # -- features ---------------------------------------------------------------------------------

    def features(self, images: Tensor) -> dict[str, Tensor]:
        """Features of ``images`` (resized first to ``input_size`` if it is set) for every layer of the extractor."""
        if self.input_size is not None and tuple(images.shape[-2:]) != self.input_size:
            if images.dtype in (torch.float16, torch.bfloat16):  # resized in float32, as the extractor takes them
                images = images.float()  # (torch's antialiased resize has no half kernels on the CPU)
            images = F.interpolate(images, size=self.input_size, mode="bilinear", align_corners=False, antialias=True)
        return self.extractor(images)

    def target_features(self, target: Tensor) -> dict[str, Tensor]:
        """Features of a target: without a graph unless the target itself requires grad."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and target.requires_grad):
            return self.features(target)

    def statistic(self, features: Tensor) -> Tensor:
        """The per-layer quantity that is compared (the features themselves here).

        ``features`` come channels first, ``(B, C, *positions)``, whatever the layer's layout: Swin's
        ``(B, H, W, C)`` maps and ``(B, L, C)`` tokens are viewed with their channels on axis 1. Those of
        an extractor with ``precision="bf16"``/``"fp16"`` come in float32.
        """
        return features

    def masked_statistic(self, features: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """The statistic under ``mask`` (on the features' grid), and the mask left to weigh the distance's positions.

        Here the statistic keeps the features' positions, so it is ``statistic(features)`` and the mask weighs
        the distance (``functional.masked_mean``); a statistic without positions applies the mask itself and
        returns None (``StyleLoss``: the Gram matrix of the masked region).
        """
        return self.statistic(features), mask

    def _statistics(self, features: Mapping[str, Tensor], side: str) -> list[Tensor]:
        return [self.statistic(layer) for layer in self._channels_first(features, side)]

    def _masked_statistics(self, layers: list[Tensor], mask: Tensor) -> tuple[list[Tensor], list[Tensor | None]]:
        """Each layer's masked statistic and the mask left for its distance (see ``masked_statistic``)."""
        pairs = [
            self.masked_statistic(layer, layer_mask(mask, layer, name)) for name, layer in zip(self.layers, layers)
        ]
        return [statistic for statistic, _ in pairs], [left for _, left in pairs]

    def _channels_first(self, features: Mapping[str, Tensor], side: str) -> list[Tensor]:
        """This loss's layers of ``features``, each ``(B, C, *positions)`` (float32 for a bf16/fp16 extractor)."""
        if not isinstance(features, Mapping):
            raise InvalidTypeError(
                f"{side} features must be a dict of layer name -> Tensor, got {type(features).__name__}"
            )
        missing = [name for name in self.layers if name not in features]
        if missing:
            raise InvalidValueError(f"{side} features lack layers {missing}; got {list(features)}")
        layouts = self.extractor.output_layouts
        # a bf16/fp16 extractor's features are reduced in float32 (a float32 one's are left as they are, bitwise)
        wide = self.extractor.precision != "float32"
        return [
            channels_first(_float32_or_wider(features[name]) if wide else features[name], layouts[name].kind)
            for name in self.layers
        ]

    # -- fixed target ------------------------------------------------------------------------------

    @property
    def has_target(self) -> bool:
        """Whether a fixed target was set with ``set_target`` (then call the loss without a target)."""
        return self._target is not None

    @torch.no_grad()
    def set_target(self, target: Tensor) -> None:
        """Compute the target's statistics once and reuse them for every call without a target.

        Shape:
            target: ``(1, C, H, W)`` (broadcast over the input batch) or ``(B, C, H, W)``.
        """
        self._store_target(target, None)

    def _store_target(self, target: Tensor, mask: Tensor | None) -> None:
        """Keep the statistics of ``target`` (of its masked region with a ``mask``), without a graph."""
        check_images(target, "target")
        target = target.to(self.extractor.mean.device)
        features = self.features(target)
        if mask is None:
            statistics = self._statistics(features, "target")
        else:
            checked = check_mask(mask, target.shape[0], target.shape[-2:], target.device)
            statistics = self._masked_statistics(self._channels_first(features, "target"), checked)[0]
        self._target = [stat.detach() for stat in statistics]

    def clear_target(self) -> None:
        """Forget the fixed target; the loss then needs a target on every call."""
        self._target = None

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FeatureLoss:
        super()._apply(fn, recurse)
        if self._target is not None:  # follow the device, keep the (float32) dtype: Grams overflow in fp16
            device = self.extractor.mean.device
            self._target = [stat.to(device) for stat in self._target]
        return self

    # -- loss --------------------------------------------------------------------------------------

    @property
    def resize(self) -> tuple[int, int] | None:
        """The old name of ``input_size`` (with a FutureWarning)."""
        warnings.warn("a loss's resize is renamed input_size; read loss.input_size", FutureWarning, stacklevel=2)
        return self.input_size

    def check_target(self, input: Tensor, target: Tensor) -> None:
        """Raise before any forward unless this loss can compare ``target`` with ``input`` (``LossGroup`` asks each
        member before it shares one forward of the target): same channels, a batch of 1 or the input's, and
        the input's size unless the loss resizes both (``input_size``) or compares size-free statistics (Grams)."""
        check_images(target, "target")
        check_images(input, "input")
        same_size = input.shape[1:] == target.shape[1:] or not self._needs_same_size()
        if not same_size or target.shape[0] not in (1, input.shape[0]) or input.shape[1] != target.shape[1]:
            raise InvalidValueError(self._shape_message(tuple(input.shape), tuple(target.shape)))

    def _needs_same_size(self) -> bool:
        return self.input_size is None

    def _shape_message(self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> str:
        return (
            f"input {input_shape} and target {target_shape} do not match: the target needs the input's "
            "(C, H, W) and a batch of 1 or the input's batch"
        )

    def _target_statistics(self, input: Tensor, target: Tensor | None, mask: Tensor | None = None) -> list[Tensor]:
        if target is None:
            if self._target is None:
                raise InvalidValueError(
                    f"{type(self).__name__} needs a target: pass one, or call set_target(image) once"
                )
            return self._target
        if self._target is not None:
            raise InvalidValueError(
                f"this {type(self).__name__} has a fixed target from set_target(); call it without a target "
                "or call clear_target() first"
            )
        self.check_target(input, target)
        if mask is None:
            return self._statistics(self.target_features(target), "target")
        if self.input_size is None and target.shape[-2:] != input.shape[-2:]:
            raise InvalidValueError(
                f"a mask lies on the pixels of input and target alike, but target {tuple(target.shape)} is not the "
                f"input's size {tuple(input.shape[-2:])}; for a style image of its own size, call "
                "set_target(style, mask=its_mask) once and the loss without a target"
            )
        return self._masked_statistics(self._channels_first(self.target_features(target), "target"), mask)[0]

    def forward(
        self, input: Tensor, target: Tensor | None = None, *, mask: Tensor | None = None, return_layers: bool = False
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The loss of ``input`` against ``target`` (or against the fixed target from ``set_target``).

        Args:
            input: the images that receive gradients.
            target: the images to compare with; None with a fixed target (``set_target``).
            mask: weights in [0, 1] on the images' pixels (binary, or soft); see ``docs/losses.md``, "Masked
                losses": each layer compares its positions weighted by the mask's area average over them,
                divided by the mask's area (``mask_normalization="mask"``) or the whole grid's (``"image"``).
            return_layers: also return each layer's weighted term, by layer name (reduced as the total is).

        Shape:
            input: ``(B, C, H, W)`` in ``input_range``; target: ``(B, C, H, W)`` or ``(1, C, H, W)``;
            mask: ``(B, 1, H, W)`` or ``(1, 1, H, W)``; output: scalar, or ``(B,)`` with ``reduction="none"``
            (with ``return_layers``: that and ``{layer: term}``).
        """
        check_images(input, "input")
        if mask is None:
            target_stats = self._target_statistics(input, target)
            total, terms = self._combine(self._statistics(self.features(input), "input"), target_stats)
        else:
            checked = self._checked_mask(mask, input, input.shape[-2:])
            target_stats = self._target_statistics(input, target, checked)
            input_stats, grids = self._masked_statistics(self._channels_first(self.features(input), "input"), checked)
            total, terms = self._combine(input_stats, target_stats, checked, grids)
        return (total, self._by_layer(terms)) if return_layers else total

    @overload
    def from_features(
        self,
        input_features: Mapping[str, Tensor],
        target_features: Mapping[str, Tensor] | None = None,
        *,
        mask: Tensor | None = None,
        return_layers: Literal[False] = False,
    ) -> Tensor: ...

    @overload
    def from_features(
        self,
        input_features: Mapping[str, Tensor],
        target_features: Mapping[str, Tensor] | None = None,
        *,
        mask: Tensor | None = None,
        return_layers: Literal[True],
    ) -> tuple[Tensor, dict[str, Tensor]]: ...

    def from_features(
        self,
        input_features: Mapping[str, Tensor],
        target_features: Mapping[str, Tensor] | None = None,
        *,
        mask: Tensor | None = None,
        return_layers: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The loss from feature dicts computed elsewhere, e.g. by one shared ``FeatureExtractor``.

        Extra layers in the dicts are ignored. Without ``target_features``, the fixed target is used.
        ``mask`` and ``return_layers`` are ``forward``'s; as the images' size is not known here, the mask's is
        not checked (a mask of the images' size gives ``forward``'s value).

        Shape:
            features: ``{layer: (B, C, H, W)}``; output: scalar, or ``(B,)`` with ``reduction="none"``.
        """
        checked, grids = None, None
        if mask is None:
            input_stats = self._statistics(input_features, "input")
        else:
            layers = self._channels_first(input_features, "input")
            checked = self._checked_mask(mask, layers[0], None)
            input_stats, grids = self._masked_statistics(layers, checked)
        if target_features is not None:
            if self._target is not None:
                raise InvalidValueError(
                    f"this {type(self).__name__} has a fixed target from set_target(); pass no target_features"
                )
            if checked is None:
                target_stats = self._statistics(target_features, "target")
            else:
                target_stats = self._masked_statistics(self._channels_first(target_features, "target"), checked)[0]
        elif self._target is None:
            raise InvalidValueError(f"{type(self).__name__} needs target features, or call set_target(image) once")
        else:
            target_stats = self._target
        total, terms = self._combine(input_stats, target_stats, checked, grids)
        return (total, self._by_layer(terms)) if return_layers else total

    def _checked_mask(self, mask: Tensor, like: Tensor, size: Sequence[int] | None) -> Tensor:
        """``functional.check_mask`` for ``like``'s batch and device; a whole-batch distance takes no mask."""
        if self._whole_batch:
            raise InvalidValueError(
                f"distance={self.distance!r} is one norm over the whole batch, with no per-position mean for a mask "
                "to weigh; use a per-sample distance ('l1', 'mse', ...) with mask="
            )
        return check_mask(mask, like.shape[0], size, like.device)

    def _combine(
        self,
        input_stats: list[Tensor],
        target_stats: list[Tensor],
        mask: Tensor | None = None,
        grids: list[Tensor | None] | None = None,
    ) -> tuple[Tensor, list[Tensor]]:
        """The reduced loss and each layer's weighted, unreduced term. With the images' ``mask``, ``grids`` holds each
        layer's mask left for the distance: None where the statistic applied it (there a sample whose ``mask`` is all
        zeros counts 0)."""
        terms = []
        layer_grids = grids if grids is not None else [None] * len(self.layers)
        for name, weight, a, b, grid in zip(self.layers, self.layer_weights, input_stats, target_stats, layer_grids):
            check_batch(a, f"the input features of layer {name!r}")
            check_batch(b, f"the target features of layer {name!r}")
            if a.shape[1:] != b.shape[1:] or b.shape[0] not in (1, a.shape[0]):
                raise InvalidValueError(
                    f"layer {name!r}: input {tuple(a.shape)} and target {tuple(b.shape)} do not match "
                    "(the target's batch may be 1 or the input's)"
                )
            if mask is None:
                value = self._distance(a, b) if self._whole_batch else feature_distance(a, b, self._distance)
            elif grid is None:
                value = feature_distance(a, b, self._distance) * (mask.flatten(1).amax(dim=1) > 0).to(a.dtype)
            else:
                value = feature_distance(a, b, self._distance, grid, self.mask_normalization)
            terms.append(weight * value)
        total = sum(terms[1:], terms[0])
        return (total if self._whole_batch else reduce_loss(total, self.reduction)), terms

    def _by_layer(self, terms: list[Tensor]) -> dict[str, Tensor]:
        """Each layer's weighted term, reduced over the batch as the total is (the terms sum to it)."""
        if self._whole_batch:
            return dict(zip(self.layers, terms))
        return {name: reduce_loss(term, self.reduction) for name, term in zip(self.layers, terms)}

    def extra_repr(self) -> str:
        weights = "" if all(w == 1.0 for w in self.layer_weights) else f", layer_weights={self.layer_weights}"
        size = f", input_size={self.input_size}" if self.input_size is not None else ""
        return f"layers={self.layers}{weights}, distance={self.distance!r}, reduction={self.reduction!r}{size}"
