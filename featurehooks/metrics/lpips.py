"""LPIPS, the learned perceptual image patch similarity, on a frozen featurehooks extractor.

Per tapped layer: unit-normalize the features of both images over channels, square their
difference, weigh the channels with the layer's calibrated linear head (a non-negative 1x1
convolution without bias), average over positions; sum over layers. The heads are the ones the
authors fitted to human judgements; this module reads them from a file, never trains them.

The heads travel as files: the ``lpips`` package bundles them (``lpips/weights/v<version>/<net>.pth``)
and so does ``torchmetrics`` (``torchmetrics/functional/image/lpips_models/<net>.pth``, version 0.1).
Both are found from the installed package's location without importing it; ``heads=`` takes a file
of your own.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .._compute import KeepsPrecision
from ..backbones import WeightsSpec
from ..backbones._files import check_state_dict, read_state_dict
from ..errors import InvalidTypeError, InvalidValueError, WeightsUnavailableError, did_you_mean
from ..functional import (
    MaskNormalization,
    Reduction,
    channel_normalize,
    check_mask,
    check_mask_normalization,
    check_reduction,
    check_rgb_pair,
    masked_mean,
    reduce_loss,
    resize_mask,
)
from ._full_reference import calibration, concatenation_pays, metric_extractor, package_dir, pair_features

__all__ = ["LPIPS", "LPIPS_NETS", "LPIPS_VERSIONS", "LpipsNet", "find_heads", "load_heads"]

HeadsSpec = Union[str, "os.PathLike[str]", Mapping[str, Tensor], None]


@dataclass(frozen=True)
class LpipsNet:
    """One LPIPS trunk: the torchvision backbone, the layers LPIPS taps (as featurehooks aliases) and their channels.

    The taps are where the slices of the reference implementation end (``lpips/pretrained_networks.py``):
    AlexNet ``features[:2] [2:5] [5:8] [8:10] [10:12]``, VGG16 ``features[:4] [4:9] [9:16] [16:23] [23:30]``,
    SqueezeNet 1.1 ``features[:2] [2:5] [5:8] [8:10] [10] [11] [12]``.
    """

    backbone: str
    layers: tuple[str, ...]
    channels: tuple[int, ...]


LPIPS_NETS: dict[str, LpipsNet] = {
    "alex": LpipsNet("alexnet", ("relu1", "relu2", "relu3", "relu4", "relu5"), (64, 192, 384, 256, 256)),
    "vgg": LpipsNet("vgg16", ("relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"), (64, 128, 256, 512, 512)),
    "squeeze": LpipsNet(
        "squeezenet1_1",
        ("relu1", "fire3", "fire5", "fire6", "fire7", "fire8", "fire9"),
        (64, 128, 256, 384, 384, 512, 512),
    ),
}
"""The three trunks of LPIPS by their LPIPS names; ``net=`` also takes the torchvision names."""

LPIPS_VERSIONS = ("0.0", "0.1")
"""``"0.1"`` (the default, and the paper's final version) scales the input as below; ``"0.0"``, the first
release, fed the [-1, 1] image to the trunk unscaled and has heads of its own."""

# Version 0.1 maps an image x in [-1, 1] to (x - shift) / scale before the trunk. For an image u in [0, 1]
# (x = 2u - 1) that is (u - (1 + shift) / 2) / (scale / 2): ImageNet's mean and std, to three decimals.
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
_NET_ALIASES = {"alexnet": "alex", "vgg16": "vgg", "squeezenet1_1": "squeeze"}
# The smallest image side each trunk's convolutions and pools accept (every layer LPIPS taps must run).
_MIN_SIDE = {"alex": 31, "vgg": 16, "squeeze": 17}
# Keys of a head: lpips' "lin3.model.1.weight" (after a Dropout), "lin3.model.0.weight" (without one),
# "lins.3.model.1.weight" (its ModuleList), "lin3.weight", any of them under a prefix such as "module.".
_HEAD_KEY = re.compile(r"(?:^|\.)lin(?:s\.)?(\d+)(?:\.model\.\d+)?\.weight$")


def input_scaling(version: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The ``(mean, std)`` for images in [0, 1] that reproduce LPIPS' own input scaling of ``version``."""
    if version == "0.0":
        return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)  # [0, 1] -> [-1, 1], nothing more
    return tuple((1 + s) / 2 for s in _SHIFT), tuple(s / 2 for s in _SCALE)


def _resolve_net(net: object) -> str:
    if not isinstance(net, str):
        raise InvalidTypeError(f"net must be one of {list(LPIPS_NETS)}, not {net!r}")
    name = _NET_ALIASES.get(net, net)
    if name not in LPIPS_NETS:
        hint = did_you_mean(net, [*LPIPS_NETS, *_NET_ALIASES])
        raise InvalidValueError(f"unknown LPIPS net {net!r}; {hint} LPIPS has heads for {list(LPIPS_NETS)}")
    return name


def _resolve_version(version: object) -> str:
    if not isinstance(version, str):
        raise InvalidTypeError(f"version must be a string such as '0.1', not {version!r}")
    if version not in LPIPS_VERSIONS:
        hint = did_you_mean(version, LPIPS_VERSIONS)
        raise InvalidValueError(f"unknown LPIPS version {version!r}; {hint} Versions: {list(LPIPS_VERSIONS)}")
    return version


def find_heads(net: str, version: str = "0.1") -> Path | None:
    """The bundled head file of an installed ``lpips`` (or, for version 0.1, ``torchmetrics``), or None.

    Examples:
        >>> from featurehooks.metrics import find_heads
        >>> find_heads("alex").parts[-3:]  # with lpips installed (the dev extra installs it)
        ('weights', 'v0.1', 'alex.pth')
    """
    net, version = _resolve_net(net), _resolve_version(version)
    candidates = []
    lpips_dir = package_dir("lpips")
    if lpips_dir is not None:
        candidates.append(lpips_dir / "weights" / f"v{version}" / f"{net}.pth")
    torchmetrics_dir = package_dir("torchmetrics")
    if torchmetrics_dir is not None and version == "0.1":  # torchmetrics ships the 0.1 heads only
        candidates.append(torchmetrics_dir / "functional" / "image" / "lpips_models" / f"{net}.pth")
    return next((path for path in candidates if path.is_file()), None)


def _expected_keys(spec: LpipsNet) -> str:
    return ", ".join(f"lin{k}.model.1.weight {(1, c, 1, 1)}" for k, c in enumerate(spec.channels))


def load_heads(source: str | os.PathLike[str] | Mapping[str, Tensor], net: str) -> list[Tensor]:
    """The per-layer head weights of ``net`` from a file (or a state dict), each a float32 ``(C,)`` tensor.

    Accepts lpips' layout (``lin0.model.1.weight`` ... of shape ``(1, C, 1, 1)``) and its variants
    (``lins.0...``, no Dropout, a ``module.`` prefix). Files are read with ``weights_only=True``.

    Raises:
        WeightsUnavailableError: the file cannot be read, or does not hold one head per layer of
            ``net`` with the right channel counts and non-negative finite values.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import load_heads
        >>> channels = (64, 192, 384, 256, 256)  # AlexNet's five tapped layers
        >>> state = {f"lin{k}.model.1.weight": torch.ones(1, c, 1, 1) for k, c in enumerate(channels)}
        >>> [tuple(head.shape) for head in load_heads(state, "alex")]  # or load_heads("alex.pth", "alex")
        [(64,), (192,), (384,), (256,), (256,)]
    """
    spec = LPIPS_NETS[_resolve_net(net)]
    label = "the heads dict" if isinstance(source, Mapping) else str(source)
    state = check_state_dict(source, label) if isinstance(source, Mapping) else read_state_dict(source)
    found: dict[int, Tensor] = {}
    for key, value in state.items():
        match = _HEAD_KEY.search(key)
        if match is not None:
            found[int(match[1])] = value
    expected = f"expected {len(spec.channels)} heads for net={net!r}: {_expected_keys(spec)}"
    if sorted(found) != list(range(len(spec.channels))):
        keys = list(state)
        shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")
        raise WeightsUnavailableError(f"{label} does not hold LPIPS heads: {expected}; it has {shown}")
    heads = []
    for index, channels in enumerate(spec.channels):
        value = found[index]
        if value.numel() != channels or not value.is_floating_point():
            raise WeightsUnavailableError(
                f"{label}: head {index} has shape {tuple(value.shape)} ({value.dtype}); {expected}. "
                "Is it the head file of another net?"
            )
        weight = value.detach().reshape(channels).to(torch.float32)
        if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
            raise WeightsUnavailableError(
                f"{label}: head {index} holds negative or non-finite weights; LPIPS heads are non-negative"
            )
        heads.append(weight)
    return heads


def _bundled_heads(net: str, version: str) -> tuple[list[Tensor], str]:
    path = find_heads(net, version)
    if path is None:
        torchmetrics = " (or torchmetrics, which bundles the 0.1 heads)" if version == "0.1" else ""
        raise WeightsUnavailableError(
            f"no LPIPS v{version} heads for net={net!r} found: install the lpips package{torchmetrics} "
            f"(pip install lpips), which bundles them as lpips/weights/v{version}/{net}.pth, or pass "
            f"heads='path/to/{net}.pth'; calibrated=False needs no heads"
        )
    return load_heads(path, net), str(path)


class LPIPS(KeepsPrecision):
    r"""Learned Perceptual Image Patch Similarity (LPIPS) of Zhang et al. (2018): a metric and a loss.

    The backbone is a frozen ``FeatureExtractor`` (``mode="grad"``) that stops after the deepest
    tapped layer; like every backbone here it stays in eval mode, outside ``parameters()`` and out
    of ``state_dict()``. The calibrated heads are non-persistent buffers: they come from a file, as
    the backbone's weights do, so ``state_dict()`` is empty and checkpoints of a model that holds
    this loss do not change. Nothing in the module is trainable.

    Computation, per layer ``l`` with features ``\hat y^l`` unit-normalized over channels
    (in float32, autocast off) and head ``w_l \ge 0``:
    ``d(x, x_0) = \sum_l \operatorname{mean}_{h,w} \sum_c w_{l,c} (\hat y^l_{hwc} - \hat y^l_{0,hwc})^2``.
    With ``calibrated=False`` every ``w_{l,c} = 1`` (the paper's uncalibrated baseline,
    ``lpips.LPIPS(lpips=False)``). Equal to ``lpips.LPIPS(net=net, version=version)`` on the same
    trunk weights (tested to 1e-5), except that a zero feature vector gets a finite gradient here.

    As a loss, ``mask=`` (``(B, 1, H, W)`` weights in [0, 1] on the images' pixels) compares a region only
    (inpainting, matting, faces): each layer's per-position distance is weighted by the mask's area
    average over that layer's cells (``functional.resize_mask``) and divided by the mask's area there
    (``mask_normalization="mask"``, the mean over the region) or the whole grid's (``"image"``). An
    all-ones mask gives the unmasked value bitwise; an all-zeros one 0 (with a warning). ``return_layers=True``
    also returns each layer's term, as ``lpips.LPIPS(retPerLayer=True)`` does (tested).

    Speed and memory: when no image of the pair needs a graph (metric use), both go through the
    backbone in one concatenated batch on a GPU (half the kernel launches); on the CPU in two
    forwards, which measured within 1-8% of one concatenated forward in time (faster above ~32 MiB
    feature maps, where each call maps fresh pages) and use 0.66-0.8x its peak memory. When only one
    needs a graph (loss use), the other is computed without one, in a separate forward (20-35%
    faster than one forward with a graph through both). ``benchmarks/metrics.py`` measures each
    choice against the alternative.

    Args:
        net: ``"alex"`` (the paper's recommended metric), ``"vgg"`` (closer to a perceptual loss),
            or ``"squeeze"``; torchvision's names ``"alexnet"``, ``"vgg16"``, ``"squeezenet1_1"`` work too.
        version: ``"0.1"`` (default) or ``"0.0"`` (the first release, without input scaling).
        calibrated: use the learned heads; ``False`` gives the uncalibrated baseline (no heads needed).
        spatial: return a distance map at the input's size instead of one value per image: each
            layer's map is upsampled bilinearly (``align_corners=False``) and the maps are summed.
            Its spatial mean is close to, not equal to, the non-spatial value (as in lpips).
        reduction: over the batch: ``"mean"`` (default, a training loss), ``"sum"``, or ``"none"``
            (one value per image, a metric). With ``spatial=True`` it acts over the batch only.
        mask_normalization: with a ``mask=`` in the call, divide each layer's weighted sum by the mask's
            area (``"mask"``, default) or by the whole grid (``"image"``).
        input_range: the value range of the images you pass: ``(0, 1)`` (default) or lpips' own
            ``(-1, 1)``; the same image gives the same distance either way.
        weights: the backbone's weights, as for ``FeatureExtractor``: ``"DEFAULT"`` (the ImageNet
            weights LPIPS was calibrated on), a member name, ``None`` (random) or a local file.
        heads: the calibrated heads: ``None`` finds those bundled with an installed ``lpips`` (or
            ``torchmetrics``) package; or a ``.pth`` file (or state dict) in lpips' layout.
        **extractor_options: keyword arguments of the backbone's ``FeatureExtractor``, as the losses take
            them: ``memory_format``, ``precision`` (``"float32"``, the default, ``"bf16"`` or ``"fp16"``; the
            distances are computed from its features in float32). Those that would change the
            features the heads were fitted on (``mean``, ``std``, ``normalize``, ``mode``, ...) are refused.

    Shape:
        input, target: ``(B, 3, H, W)`` in ``input_range``; target may have batch 1 (broadcast); mask:
        ``(B, 1, H, W)`` or ``(1, 1, H, W)``. output: ``spatial=False``: ``(B,)`` for ``"none"``, else a
        scalar; ``spatial=True``: ``(B, 1, H, W)`` for ``"none"``, else ``(1, H, W)`` (the batch's mean or
        sum map).

    Raises:
        WeightsUnavailableError: no heads found (install ``lpips`` or pass ``heads=``), a head file
            that is not one, or backbone weights that are neither cached nor downloadable.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import LPIPS
        >>> metric = LPIPS("alex", weights=None, calibrated=False, reduction="none")
        >>> metric(torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)).shape
        torch.Size([2])

    References:
        Zhang, Isola, Efros, Shechtman, Wang (2018). The Unreasonable Effectiveness of Deep
        Features as a Perceptual Metric. CVPR. https://arxiv.org/abs/1801.03924
    """

    def __init__(
        self,
        net: str = "alex",
        version: str = "0.1",
        *,
        calibrated: bool = True,
        spatial: bool = False,
        reduction: Reduction = "mean",
        mask_normalization: MaskNormalization = "mask",
        input_range: tuple[float, float] = (0.0, 1.0),
        weights: WeightsSpec = "DEFAULT",
        heads: HeadsSpec = None,
        **extractor_options: Any,
    ) -> None:
        super().__init__()
        self.net = _resolve_net(net)
        self.version = _resolve_version(version)
        check_reduction(reduction)
        self.reduction: Reduction = reduction
        check_mask_normalization(mask_normalization)
        self.mask_normalization: MaskNormalization = mask_normalization
        self.calibrated = bool(calibrated)
        self.spatial = bool(spatial)
        spec = LPIPS_NETS[self.net]
        weights_per_layer, self.heads_source = calibration(
            self.calibrated,
            heads,
            "heads",
            ones=lambda: [torch.ones(c) for c in spec.channels],
            bundled=lambda: _bundled_heads(self.net, self.version),
            load=lambda source: load_heads(source, self.net),
        )
        mean, std = input_scaling(self.version)
        self.extractor = metric_extractor(
            "LPIPS",
            spec.backbone,
            list(spec.layers),
            extractor_options,
            weights=weights,
            input_range=input_range,
            mean=mean,
            std=std,
        )
        self.layers: list[str] = list(spec.layers)
        for name, weight in zip(self.layers, weights_per_layer):
            self.register_buffer(f"head_{name}", weight.to(self.extractor.mean), persistent=False)

    @property
    def input_range(self) -> tuple[float, float]:
        """The value range of the images this metric takes."""
        return self.extractor.input_range

    def head(self, layer: str) -> Tensor:
        """The ``(C,)`` channel weights of ``layer``'s head (ones when uncalibrated)."""
        return getattr(self, f"head_{layer}")

    def train(self, mode: bool = True) -> LPIPS:
        """Stay in eval mode: LPIPS is frozen (its heads are fixed and it has no dropout)."""
        return super().train(False)

    def _kept_precision(self) -> str:
        """``.to()``, ``.half()``, ...; under ``precision="bf16"``/``"fp16"`` only their moves apply, to the heads
        as to the extractor: the distances stay float32, the heads never rounded through another dtype."""
        return self.extractor.precision

    # -- features ----------------------------------------------------------------------------------

    def _check_pair(self, input: Tensor, target: Tensor) -> None:
        check_rgb_pair(input, target, "LPIPS")
        smallest = _MIN_SIDE[self.net]
        if min(input.shape[-2:]) < smallest:
            raise InvalidValueError(
                f"images of {input.shape[-2]}x{input.shape[-1]} are too small for LPIPS({self.net!r}): its trunk needs "
                f"at least {smallest}x{smallest}; upsample them first"
            )

    def _one_forward(self, input: Tensor) -> bool:
        """Whether a pair that needs no graph (or two) runs as one concatenated batch: on accelerators only
        (see the class docstring)."""
        return concatenation_pays(input)

    def _features(self, input: Tensor, target: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Features of both images (see ``pair_features``)."""
        return pair_features(self.extractor, input, target, self._one_forward(input))

    # -- distances ---------------------------------------------------------------------------------

    def layer_distances(self, input: Tensor, target: Tensor, *, mask: Tensor | None = None) -> dict[str, Tensor]:
        """Each layer's unreduced contribution, by layer name (the terms that ``forward`` sums), inside ``mask``.

        Shape:
            output: ``{layer: (B,)}``, or ``{layer: (B, 1, H, W)}`` with ``spatial=True``.
        """
        self._check_pair(input, target)
        checked = None
        if mask is not None:
            if self.spatial:
                raise InvalidValueError(
                    "spatial=True returns the distance map itself; weigh it by your mask instead of passing mask="
                )
            checked = check_mask(mask, input.shape[0], input.shape[-2:], input.device)
        first, second = self._features(input, target)
        size = (input.shape[-2], input.shape[-1])
        with torch.autocast(device_type=input.device.type, enabled=False):
            return {name: self._layer_map(name, first[name], second[name], size, checked) for name in self.layers}

    def _layer_map(self, name: str, a: Tensor, b: Tensor, size: tuple[int, int], mask: Tensor | None) -> Tensor:
        """Head-weighted squared difference of normalized features: ``(B,)``, or ``(B, 1, H, W)`` if spatial."""
        diff = channel_normalize(a) - channel_normalize(b)
        # the head weighs the squares in place: one feature-sized temporary fewer than (diff * diff * w), and
        # nothing more saved for backward (the squares' own backward needs diff, not them)
        squares = diff * diff
        weight = self.head(name).to(diff.dtype).view(1, -1, 1, 1)
        per_position = squares.mul_(weight).sum(dim=1, keepdim=True)
        if self.spatial:
            return F.interpolate(per_position, size=size, mode="bilinear", align_corners=False)
        if mask is None:
            return per_position.mean(dim=(1, 2, 3))
        return masked_mean(per_position, resize_mask(mask, per_position.shape[-2:]), self.mask_normalization)

    def _reduce(self, values: Tensor) -> Tensor:
        """Per-image values (or maps) reduced over the batch."""
        if not self.spatial:
            return reduce_loss(values, self.reduction)
        if self.reduction == "mean":
            return values.mean(dim=0)
        if self.reduction == "sum":
            return values.sum(dim=0)
        return values

    def forward(
        self, input: Tensor, target: Tensor, *, mask: Tensor | None = None, return_layers: bool = False
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The LPIPS distance of ``input`` to ``target`` (0 for identical images), reduced over the batch.

        Args:
            input: images in ``input_range``.
            target: images of the same size (batch 1 is broadcast).
            mask: weights in [0, 1] on the pixels (see the class docstring); not with ``spatial=True``.
            return_layers: also return each layer's term by layer name, reduced as the total is: with
                ``reduction="none"``, lpips' ``retPerLayer`` list (flattened).

        Shape:
            see the class docstring.
        """
        layers = self.layer_distances(input, target, mask=mask)
        terms = list(layers.values())
        total = self._reduce(sum(terms[1:], terms[0]))
        if not return_layers:
            return total
        return total, {name: self._reduce(term) for name, term in layers.items()}

    def extra_repr(self) -> str:
        return (
            f"net={self.net!r}, version={self.version!r}, calibrated={self.calibrated}, spatial={self.spatial}, "
            f"reduction={self.reduction!r}, input_range={self.extractor.input_range}"
        )
