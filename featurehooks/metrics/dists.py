"""DISTS, deep image structure and texture similarity, on a frozen featurehooks extractor.

The trunk is VGG16's convolutions with each max-pooling replaced by L2 pooling (a 3x3 Hann window,
stride 2: ``sqrt(hann * x²)``), which keeps the maps free of aliasing. For the image itself and each
stage's last ReLU (``relu1_2`` ... ``relu5_3``), every channel's spatial mean and variance give a
structure term (means) and a texture term (covariance over variances), in the form of SSIM's
luminance and structure terms; learned weights ``alpha`` (structure) and ``beta`` (texture), one per
channel of the six, sum them; the score is one minus that sum: 0 for identical images.

The learned ``alpha`` and ``beta`` travel as a file: the ``DISTS_pytorch`` package bundles them
(``DISTS_pytorch/weights.pt``), found from its location without importing it; ``alpha_beta=`` takes
a file of your own.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._compute import KeepsPrecision
from .._precision import autocast_off
from ..backbones import WeightsSpec, load_backbone
from ..backbones._files import check_state_dict, read_state_dict
from ..errors import InvalidValueError, WeightsUnavailableError
from ..functional import (
    MaskNormalization,
    Reduction,
    check_mask,
    check_mask_normalization,
    check_reduction,
    check_rgb_pair,
    mask_area,
    reduce_loss,
    resize_mask,
)
from ._full_reference import calibration, concatenation_pays, metric_extractor, package_dir, pair_features

__all__ = ["DISTS", "DISTS_LAYERS", "MIN_SIDE", "L2Pool2d", "L2PooledVGG16", "find_alpha_beta", "load_alpha_beta"]

AlphaBetaSpec = Union[str, "os.PathLike[str]", Mapping[str, Tensor], None]

DISTS_LAYERS = ("relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3")
"""The VGG16 layers DISTS compares, after the image itself: the last ReLU of each of the five stages."""

# The terms are taken of the image and of the five layers; alpha and beta hold one weight per channel of each.
_CHANNELS = (3, 64, 128, 256, 512, 512)
# Where the layers and the max-poolings sit in torchvision's vgg16().features; the trunk ends at relu5_3.
_TAPS = {"3": "relu1_2", "8": "relu2_2", "15": "relu3_3", "22": "relu4_3", "29": "relu5_3"}
_POOLS = (4, 9, 16, 23)
_TRUNK_END = 30
# DISTS normalizes images in [0, 1] with ImageNet's mean and std, whatever weights the trunk has: its alpha
# and beta were fitted on features of images normalized so.
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
_C1 = _C2 = 1e-6  # the stabilizing constants of the structure and texture terms
_POOL_EPS = 1e-12  # inside the L2 pooling's square root: a finite gradient where a window is all zeros
MIN_SIDE = 17
"""The smallest image side DISTS takes: each L2 pooling halves a side, rounding up, so 17 pixels leave ``relu5_3``
(at 1/16 of the input) 2 positions a side; on a single position its texture term (variances, covariance) is 1 for
any pair of images."""


class L2Pool2d(nn.Module):
    """L2 pooling: the square root of a Hann-weighted 3x3 average of squares, stride 2, padding 1.

    The window is the outer product of ``(0.5, 1, 0.5)`` (a 5-point Hann window without its zero ends),
    normalized to sum 1. A side of ``n`` becomes ``ceil(n / 2)``. Computed in float32 with autocast off
    (squares of activations overflow float16) and returned in the input's dtype.

    Args:
        channels: the input's channel count (the window is applied to each channel on its own).

    Shape:
        input: ``(B, C, H, W)``; output: ``(B, C, ceil(H / 2), ceil(W / 2))``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.dists import L2Pool2d
        >>> L2Pool2d(4)(torch.ones(1, 4, 9, 8)).shape
        torch.Size([1, 4, 5, 4])

    References:
        Hénaff, Simoncelli (2016). Geodesics of learned representations. ICLR.
        https://arxiv.org/abs/1511.06394
    """

    window: Tensor

    def __init__(self, channels: int) -> None:
        super().__init__()
        side = torch.tensor([0.5, 1.0, 0.5])
        window = side[:, None] * side[None, :]
        self.register_buffer("window", (window / window.sum()).expand(channels, 1, 3, 3).contiguous())

    def forward(self, input: Tensor) -> Tensor:
        with autocast_off(input.device.type):
            squares = input.float().square()
            window = self.window.float()
            pooled = F.conv2d(squares, window, stride=2, padding=1, groups=squares.shape[1])
            return (pooled + _POOL_EPS).sqrt().to(input.dtype)

    def extra_repr(self) -> str:
        return f"channels={self.window.shape[0]}"


class L2PooledVGG16(nn.Sequential):
    """DISTS' trunk: VGG16's ``features`` up to ``relu5_3``, each max pooling replaced by ``L2Pool2d``.

    Its modules keep their index in ``torchvision.models.vgg16().features`` as their name (``"29"`` is
    ``relu5_3``), so a state dict of that ``features`` (keys ``"0.weight"`` ...) fits it.

    Examples:
        >>> import torchvision
        >>> from featurehooks.metrics.dists import L2PooledVGG16
        >>> trunk = L2PooledVGG16(torchvision.models.vgg16().features)
        >>> len(trunk), type(trunk[4]).__name__
        (30, 'L2Pool2d')
    """

    def __init__(self, features: nn.Module) -> None:
        modules = list(features.children())
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for index in range(_TRUNK_END):
            if index in _POOLS:
                layers[str(index)] = L2Pool2d(_CHANNELS[_POOLS.index(index) + 1])
            else:
                layers[str(index)] = modules[index]
        super().__init__(layers)


def _trunk(weights: WeightsSpec) -> tuple[L2PooledVGG16, str | None]:
    """DISTS' trunk on VGG16 ``weights``, and the weights' name or file (None: random)."""
    vgg = load_backbone("vgg16", weights)
    return L2PooledVGG16(vgg.model.get_submodule("features")), vgg.weights


def find_alpha_beta() -> Path | None:
    """The ``weights.pt`` (alpha and beta) bundled with an installed ``DISTS_pytorch``, or None.

    Found from the package's location, without importing it: ``DISTS_pytorch/weights.pt``, or, for
    release 1.0.0, which installs it as a data file, ``weights.pt`` in the environment's prefix.

    Examples:
        >>> from featurehooks.metrics.dists import find_alpha_beta
        >>> find_alpha_beta().name  # with DISTS_pytorch installed (the dev extra installs it)
        'weights.pt'
    """
    package = package_dir("DISTS_pytorch")
    if package is None:
        return None
    candidates = (package / "weights.pt", Path(sys.prefix) / "weights.pt")
    return next((path for path in candidates if path.is_file()), None)


def load_alpha_beta(source: str | os.PathLike[str] | Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """DISTS' learned ``alpha`` and ``beta`` from a file (or a state dict), each a float32 ``(1475,)`` tensor.

    The file holds ``alpha`` and ``beta`` of ``3 + 64 + 128 + 256 + 512 + 512 = 1475`` weights each
    (``DISTS_pytorch`` stores them as ``(1, 1475, 1, 1)``), one per channel of the image and of
    ``DISTS_LAYERS``, in that order. Files are read with ``weights_only=True``. They are returned as
    stored; ``DISTS`` divides both by the sum of all of them.

    Raises:
        WeightsUnavailableError: the file cannot be read, lacks ``alpha`` or ``beta``, holds another
            number of weights, or weights that are negative, non-finite or all zero.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.dists import load_alpha_beta
        >>> state = {"alpha": torch.full((1, 1475, 1, 1), 0.1), "beta": torch.full((1, 1475, 1, 1), 0.2)}
        >>> alpha, beta = load_alpha_beta(state)  # or load_alpha_beta("weights.pt")
        >>> alpha.shape, float(beta[0])
        (torch.Size([1475]), 0.2...)
    """
    label = "the alpha_beta dict" if isinstance(source, Mapping) else str(source)
    state = check_state_dict(source, label) if isinstance(source, Mapping) else read_state_dict(source)
    total = sum(_CHANNELS)
    expected = f"expected 'alpha' and 'beta' of {total} weights each, as DISTS_pytorch's weights.pt holds them"
    missing = [key for key in ("alpha", "beta") if key not in state]
    if missing:
        keys = list(state)
        shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")
        raise WeightsUnavailableError(f"{label} does not hold DISTS weights: {expected}; it has {shown}")
    values = []
    for key in ("alpha", "beta"):
        value = state[key]
        if value.numel() != total or not value.is_floating_point():
            raise WeightsUnavailableError(f"{label}: {key} has shape {tuple(value.shape)} ({value.dtype}); {expected}")
        weight = value.detach().reshape(total).to(torch.float32)
        if not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
            raise WeightsUnavailableError(f"{label}: {key} holds negative or non-finite weights")
        values.append(weight)
    if float(values[0].sum() + values[1].sum()) <= 0:
        raise WeightsUnavailableError(f"{label}: alpha and beta are all zero; DISTS divides by their sum")
    return values[0], values[1]


def _bundled_alpha_beta() -> tuple[tuple[Tensor, Tensor], str]:
    path = find_alpha_beta()
    if path is None:
        raise WeightsUnavailableError(
            "no DISTS alpha/beta found: install the DISTS_pytorch package (pip install DISTS_pytorch), which "
            "bundles them as DISTS_pytorch/weights.pt, or pass alpha_beta='path/to/weights.pt'; "
            "calibrated=False needs none"
        )
    return load_alpha_beta(path), str(path)


class DISTS(KeepsPrecision):
    r"""Deep Image Structure and Texture Similarity (DISTS) of Ding et al. (2020): a metric and a loss.

    The trunk is VGG16 up to ``relu5_3`` with L2 pooling (``L2Pool2d``) in place of max pooling, a
    frozen ``FeatureExtractor`` (``mode="grad"``) that, like every backbone here, stays in eval mode,
    outside ``parameters()`` and out of ``state_dict()``. The learned ``alpha`` and ``beta`` are
    non-persistent buffers: they come from a file, as the trunk's weights do, so ``state_dict()`` is
    empty. Nothing in the module is trainable.

    Computation, for each term ``k`` (the image in [0, 1], then ``relu1_2`` ... ``relu5_3``) with
    per-channel spatial means ``\mu``, variances ``\sigma^2`` and covariance ``\sigma_{xy}`` (in
    float32, autocast off), and ``\alpha, \beta \ge 0`` divided by their total sum:
    ``D(x, y) = 1 - \sum_k \sum_c \alpha_{kc} \frac{2\mu_x\mu_y + c_1}{\mu_x^2 + \mu_y^2 + c_1}
    + \beta_{kc} \frac{2\sigma_{xy} + c_2}{\sigma_x^2 + \sigma_y^2 + c_2}``, ``c_1 = c_2 = 10^{-6}``.
    Each term is computed as the distance it is, ``\alpha_{kc} \frac{(\mu_x - \mu_y)^2}{\mu_x^2 + \mu_y^2 + c_1}
    + \beta_{kc} \frac{\overline{(x - \mu_x - y + \mu_y)^2}}{\sigma_x^2 + \sigma_y^2 + c_2}`` (the same function),
    so that the score is never negative and exactly 0 for identical images, where ``1 - \sum`` rounds to
    ``\pm 10^{-7}``.
    Equal to ``DISTS_pytorch.DISTS`` on the same VGG16 weights (tested to 1e-5 per image, and in
    input gradients): ``reduction="none"`` is its ``forward(x, y)`` (which keeps no graph unless
    ``require_grad=True``, and returns a scalar for one image), ``"mean"`` its
    ``forward(x, y, require_grad=True, batch_average=True)``. Mind that its default
    ``require_grad=False`` still returns a graph to the input, through the image term alone: an input
    gradient taken from it misses every VGG term.

    As a loss, ``mask=`` (``(B, 1, H, W)`` weights in [0, 1] on the images' pixels) compares a region only:
    each term's means, variances and covariance become those of the region, every spatial mean
    ``\operatorname{mean}(v)`` weighted by the mask's area average over that term's cells
    (``functional.resize_mask``): ``\operatorname{mean}(v m) / \operatorname{mean}(m)``. With
    ``mask_normalization="image"`` each term's distance is then multiplied by the mask's coverage of its grid,
    ``\operatorname{mean}(m)``, as the mean over the whole image of a per-position loss would count the region.
    An all-ones mask gives the unmasked value bitwise; an all-zeros one 0 (with a warning). ``return_layers=True``
    also returns each term (``"image"``, then the layers) with its alpha and beta, reduced as the total is.

    Images of any size from ``MIN_SIDE`` (17) pixels a side are accepted; the two images of a pair
    must have one size. DISTS resizes nothing: ``piq.DISTS`` first shrinks images whose shorter side
    exceeds 256 to 256, this (like ``DISTS_pytorch``) does not.

    Speed and memory: as ``LPIPS``, a pair that needs no graph runs as one concatenated batch on an
    accelerator and in two forwards on the CPU (as ``DISTS_pytorch`` does, at the same speed); the
    image without a graph in a loss is computed without one. ``torch.compile(fullgraph=True)``
    traces it whole (without a mask: checking a mask reads its values, a graph break).

    Args:
        calibrated: use the learned ``alpha`` and ``beta``; ``False`` weighs every channel of every
            term equally (a baseline that needs no file; not a metric anyone reports).
        reduction: over the batch: ``"mean"`` (default, a training loss), ``"sum"``, or ``"none"``
            (one value per image, a metric).
        mask_normalization: with a ``mask=`` in the call, the statistics of the region (``"mask"``, default),
            or those times the region's coverage (``"image"``), see above.
        input_range: the value range of the images you pass: ``(0, 1)`` (default, as DISTS_pytorch
            takes them), ``(-1, 1)`` or ``(0, 255)``; the same image gives the same score either way.
        weights: the VGG16 weights, as for ``FeatureExtractor``: ``"DEFAULT"`` (ImageNet
            ``IMAGENET1K_V1``, on which alpha and beta were fitted), a member name, ``None``
            (random) or a local file. Images are normalized with ImageNet's mean and std whatever
            the weights.
        alpha_beta: the learned weights: ``None`` finds those bundled with an installed
            ``DISTS_pytorch``; or a ``.pt`` file (or state dict) with ``alpha`` and ``beta``.
        **extractor_options: keyword arguments of the trunk's ``FeatureExtractor``, as the losses take
            them: ``memory_format``, ``precision`` (``"float32"``, the default, ``"bf16"`` or ``"fp16"``; the
            distances are computed from its features in float32). Those that would change the
            features alpha and beta were fitted on (``mean``, ``std``, ``normalize``, ``mode``, ...) are refused.

    Shape:
        input, target: ``(B, 3, H, W)`` in ``input_range``, ``H, W >= 17``; target may have batch 1
        (broadcast); mask: ``(B, 1, H, W)`` or ``(1, 1, H, W)``. output: ``(B,)`` for ``"none"``, else a scalar.

    Raises:
        WeightsUnavailableError: no alpha/beta found (install ``DISTS_pytorch`` or pass
            ``alpha_beta=``), a file that does not hold them, or VGG16 weights that are neither
            cached nor downloadable.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import DISTS
        >>> metric = DISTS(weights=None, calibrated=False, reduction="none")  # random weights: offline
        >>> x, y = torch.rand(2, 3, 64, 48), torch.rand(2, 3, 64, 48)
        >>> scores = metric(x, y)  # one value per pair of images
        >>> scores.shape, bool((scores > 0).all()), metric(x, x).tolist()  # identical images: exactly 0
        (torch.Size([2]), True, [0.0, 0.0])
        >>> output = x.clone().requires_grad_(True)
        >>> metric(output, y[:1]).mean().backward()  # as a loss; a target of batch 1 is broadcast
        >>> output.grad.shape
        torch.Size([2, 3, 64, 48])

    References:
        Ding, Ma, Wang, Simoncelli (2020). Image Quality Assessment: Unifying Structure and Texture
        Similarity. IEEE TPAMI. https://arxiv.org/abs/2004.07728
    """

    alpha: Tensor
    beta: Tensor

    def __init__(
        self,
        *,
        calibrated: bool = True,
        reduction: Reduction = "mean",
        mask_normalization: MaskNormalization = "mask",
        input_range: tuple[float, float] = (0.0, 1.0),
        weights: WeightsSpec = "DEFAULT",
        alpha_beta: AlphaBetaSpec = None,
        **extractor_options: Any,
    ) -> None:
        super().__init__()
        check_reduction(reduction)
        self.reduction: Reduction = reduction
        check_mask_normalization(mask_normalization)
        self.mask_normalization: MaskNormalization = mask_normalization
        self.calibrated = bool(calibrated)
        (alpha, beta), self.alpha_beta_source = calibration(
            self.calibrated,
            alpha_beta,
            "alpha_beta",
            ones=lambda: (torch.ones(sum(_CHANNELS)), torch.ones(sum(_CHANNELS))),
            bundled=_bundled_alpha_beta,
            load=load_alpha_beta,
        )
        trunk, self.weights = _trunk(weights)
        self.extractor = metric_extractor(
            "DISTS", trunk, _TAPS, extractor_options, input_range=input_range, mean=_MEAN, std=_STD
        )
        total = alpha.sum() + beta.sum()  # DISTS_pytorch's normalization, in the same float32 arithmetic
        like = self.extractor.mean
        self.register_buffer("alpha", (alpha / total).to(like), persistent=False)
        self.register_buffer("beta", (beta / total).to(like), persistent=False)

    @property
    def input_range(self) -> tuple[float, float]:
        """The value range of the images this metric takes."""
        return self.extractor.input_range

    def train(self, mode: bool = True) -> DISTS:
        """Stay in eval mode: DISTS is frozen."""
        return super().train(False)

    def _kept_precision(self) -> str:
        """``.to()``, ``.half()``, ...; under ``precision="bf16"``/``"fp16"`` only their moves apply, to alpha and
        beta as to the extractor: the distances stay float32, alpha and beta never rounded through another dtype."""
        return self.extractor.precision

    def _check_pair(self, input: Tensor, target: Tensor) -> None:
        check_rgb_pair(input, target, "DISTS")
        if min(input.shape[-2:]) < MIN_SIDE:
            raise InvalidValueError(
                f"images of {input.shape[-2]}x{input.shape[-1]} are too small for DISTS: it needs at least "
                f"{MIN_SIDE}x{MIN_SIDE}, so that relu5_3 (at 1/16 of the input) has more than one position per "
                "side; upsample them first"
            )

    def _features(self, input: Tensor, target: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Features of both images (see ``pair_features``)."""
        return pair_features(self.extractor, input, target, concatenation_pays(input))

    def _unit(self, images: Tensor) -> Tensor:
        """The images in [0, 1], DISTS' first term."""
        low, high = self.input_range
        return images if (low, high) == (0.0, 1.0) else (images - low) / (high - low)

    def forward(
        self, input: Tensor, target: Tensor, *, mask: Tensor | None = None, return_layers: bool = False
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """The DISTS distance of ``input`` to ``target`` (0 for identical images), reduced over the batch.

        Args:
            input: images in ``input_range``.
            target: images of the same size (batch 1 is broadcast).
            mask: weights in [0, 1] on the pixels (see the class docstring).
            return_layers: also return each term (``"image"``, ``"relu1_2"``, ...) reduced as the total is.

        Shape:
            see the class docstring.
        """
        self._check_pair(input, target)
        checked = None if mask is None else check_mask(mask, input.shape[0], input.shape[-2:], input.device)
        first, second = self._features(input, target)
        pairs = [(self._unit(input), self._unit(target))] + [(first[name], second[name]) for name in DISTS_LAYERS]
        alphas, betas = self.alpha.float().split(_CHANNELS), self.beta.float().split(_CHANNELS)
        structures, textures = [], []
        with autocast_off(input.device.type):
            for (x, y), alpha, beta in zip(pairs, alphas, betas):
                if checked is None:
                    structure, texture = _structure_texture(x.float(), y.float())
                else:
                    grid = resize_mask(checked, x.shape[-2:])
                    structure, texture = _structure_texture(x.float(), y.float(), _masked_mean(grid))
                    if self.mask_normalization == "image":
                        coverage = grid.mean(dim=(2, 3))
                        structure, texture = structure * coverage, texture * coverage
                structures.append((structure * alpha).sum(dim=1))
                textures.append((texture * beta).sum(dim=1))
            score = sum(structures[1:], structures[0]) + sum(textures[1:], textures[0])
        total = reduce_loss(score, self.reduction)
        if not return_layers:
            return total
        names = ("image", *DISTS_LAYERS)
        return total, {name: reduce_loss(s + t, self.reduction) for name, s, t in zip(names, structures, textures)}

    def extra_repr(self) -> str:
        return (
            f"calibrated={self.calibrated}, reduction={self.reduction!r}, input_range={self.input_range}, "
            f"weights={self.weights!r}"
        )


def _spatial_mean(values: Tensor) -> Tensor:
    """Each channel's mean over the positions, ``(B, C)``."""
    return values.mean(dim=(2, 3))


def _masked_mean(mask: Tensor) -> Callable[[Tensor], Tensor]:
    """Each channel's mean over the positions weighted by ``mask`` (on the grid): ``mean(v m) / mean(m)``, 0 where
    the mask is all zeros."""
    area = mask_area(mask)[:, None]
    return lambda values: (values * mask).mean(dim=(2, 3)) / area


def _structure_texture(x: Tensor, y: Tensor, mean: Callable[[Tensor], Tensor] = _spatial_mean) -> tuple[Tensor, Tensor]:
    """Per-channel structure (means) and texture (variances, covariance) distances of two maps, ``(B, C)``: one
    minus DISTS' similarities, written as squares over sums (``1 - (2ab + c) / (a² + b² + c) = (a - b)² / (a² + b²
    + c)``), so that they are never negative and exactly 0 for identical maps. ``mean`` is the spatial average
    every statistic takes (a masked one for a region)."""
    x_mean, y_mean = mean(x), mean(y)
    structure = (x_mean - y_mean).square() / (x_mean.square() + y_mean.square() + _C1)
    x_centered, y_centered = x - x_mean[..., None, None], y - y_mean[..., None, None]
    x_var, y_var = mean(x_centered.square()), mean(y_centered.square())
    texture = mean((x_centered - y_centered).square()) / (x_var + y_var + _C2)
    return structure, texture
