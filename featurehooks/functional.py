"""Pure loss functions: Gram matrices, channel normalization, feature distances, total variation, reductions.

Every function here is stateless and works on plain tensors; the modules in ``featurehooks.losses``
are thin shells around them. Numerically sensitive steps (Gram matrices, channel normalization) run
in float32 with autocast disabled, so they stay finite under fp16/bf16 mixed precision.

Examples:
    >>> import torch
    >>> from featurehooks import functional as F
    >>> features = torch.rand(2, 8, 16, 16)
    >>> F.gram_matrix(features).shape
    torch.Size([2, 8, 8])
    >>> F.reduce_loss(F.feature_distance(features, torch.zeros(1, 8, 16, 16), "l1")).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ._masks import MaskNormalization, check_mask, check_mask_normalization, mask_area, masked_mean, resize_mask
from ._masks import on_positions as _on_positions
from .errors import InvalidTypeError, InvalidValueError

__all__ = [
    "BATCH_DISTANCES",
    "DISTANCES",
    "Distance",
    "GramNormalization",
    "MaskNormalization",
    "Reduction",
    "batch_frobenius",
    "channel_normalize",
    "check_batch",
    "check_images",
    "check_mask",
    "check_mask_normalization",
    "check_reduction",
    "check_rgb_pair",
    "feature_distance",
    "gram_matrix",
    "mask_area",
    "masked_mean",
    "per_sample_mean",
    "reduce_loss",
    "resize_mask",
    "resolve_distance",
    "total_variation",
]

Reduction = Literal["mean", "sum", "none"]
"""How a loss reduces its per-sample values over the batch: their mean, their sum, or none (one per sample).

Examples:
    >>> import typing
    >>> from featurehooks.functional import Reduction
    >>> typing.get_args(Reduction)
    ('mean', 'sum', 'none')
"""
GramNormalization = Literal["chw", "hw", "none"]
"""What a Gram matrix is divided by: ``C * H * W``, ``H * W``, or nothing (see ``gram_matrix``).

Examples:
    >>> import torch
    >>> from featurehooks.functional import gram_matrix
    >>> features = torch.ones(1, 2, 4, 4)  # C = 2, H * W = 16: each entry of F F^T sums 16 ones
    >>> [gram_matrix(features, normalization)[0, 0, 0].item() for normalization in ("chw", "hw", "none")]
    [0.5, 1.0, 16.0]
"""
Distance = Union[str, Callable[[Tensor, Tensor], Tensor]]
"""A name from ``DISTANCES`` (or ``BATCH_DISTANCES`` where a loss takes it), or a callable
``(input, target) -> Tensor`` of elementwise (or per-position) values whose first dimension is the batch.

Examples:
    >>> import torch
    >>> from featurehooks.functional import feature_distance
    >>> x, y = torch.zeros(2, 3, 4, 4), torch.ones(2, 3, 4, 4)
    >>> feature_distance(x, y, "l1"), feature_distance(x, y, lambda a, b: (a - b).abs() ** 3)
    (tensor([1., 1.]), tensor([1., 1.]))
"""

_REDUCTIONS = ("mean", "sum", "none")
_GRAM_NORMALIZATIONS = ("chw", "hw", "none")
_CHARBONNIER_EPS = 1e-3
_COSINE_EPS = 1e-8


def _float32_or_wider(x: Tensor) -> Tensor:
    """``x`` as float32, or unchanged when it already is float32 or float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _no_autocast(x: Tensor) -> AbstractContextManager[None]:
    return torch.autocast(device_type=x.device.type, enabled=False)


def gram_matrix(
    features: Tensor,
    normalization: GramNormalization = "chw",
    mask: Tensor | None = None,
    mask_normalization: MaskNormalization = "mask",
) -> Tensor:
    r"""Batched Gram matrix ``G = F F^\top`` of feature maps, in float32 with autocast disabled.

    Under autocast ``bmm`` would run in float16 and overflow for large activations, so the inputs
    are upcast to float32 (float64 stays float64) and the result keeps that dtype.

    With a ``mask`` on the features' grid (see ``resize_mask``), the Gram matrix of the masked region, as
    masked style-transfer code computes it: the features are multiplied by the mask, ``(F m)(F m)^\top``
    (a position of weight ``m`` counts ``m^2``; a binary mask counts each masked position once), and
    with ``mask_normalization="mask"`` the ``H * W`` of ``normalization`` becomes the mask's area
    ``\sum m`` (``"image"`` keeps ``H * W``; ``"none"`` divides by neither). An all-ones mask gives the
    unmasked matrix bitwise; an all-zeros mask a zero matrix.

    Args:
        features: feature maps; every dimension after the channel dimension is flattened.
        normalization: ``"chw"`` divides by ``C * H * W`` (Johnson et al. 2016), ``"hw"`` by ``H * W``,
            ``"none"`` leaves the raw sums (Gatys et al. 2016; piq's ``StyleLoss``).
        mask: weights in [0, 1] on the features' positions, or None (every position).
        mask_normalization: ``"mask"`` (default) or ``"image"``, see above.

    Returns:
        The Gram matrices.

    Shape:
        features: ``(B, C, H, W)`` or ``(B, C, N)``; mask: ``(B, 1, H, W)`` or ``(1, 1, H, W)`` (maps only);
        output: ``(B, C, C)``, float32 or float64.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import gram_matrix
        >>> gram_matrix(torch.ones(2, 4, 8, 8)).shape
        torch.Size([2, 4, 4])

    References:
        Gatys, Ecker, Bethge (2016). Image Style Transfer Using Convolutional Neural Networks. CVPR.
        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV.
    """
    if not isinstance(features, Tensor):
        raise InvalidTypeError(f"features must be a Tensor, got {type(features).__name__}")
    if features.dim() < 3:
        raise InvalidValueError(f"features must have shape (B, C, H, W) or (B, C, N), got {tuple(features.shape)}")
    if normalization not in _GRAM_NORMALIZATIONS:
        raise InvalidValueError(f"normalization must be one of {_GRAM_NORMALIZATIONS}, not {normalization!r}")
    if mask is not None:
        check_mask_normalization(mask_normalization)
    with _no_autocast(features):
        wide = _float32_or_wider(features)
        if mask is not None:
            wide = wide * _on_positions(mask, wide)
        batch, channels = wide.shape[:2]
        flat = wide.reshape(batch, channels, -1)
        gram = torch.bmm(flat, flat.transpose(1, 2))
    positions = flat.shape[-1]
    if normalization == "chw":
        gram = gram / (channels * positions)
    elif normalization == "hw":
        gram = gram / positions
    if mask is not None and mask_normalization == "mask" and normalization != "none":
        gram = gram / mask_area(mask).view(-1, 1, 1)
    return gram


def channel_normalize(features: Tensor, dim: int = 1, eps: float = 1e-10) -> Tensor:
    r"""Scale each feature vector to unit length: ``x / \sqrt{\sum_c x_c^2 + \epsilon}``.

    ``eps`` sits inside the square root, so an all-zero feature vector maps to zero with a finite
    gradient (lpips and piq put it outside, where ``sqrt``'s gradient at zero is infinite and the
    backward pass yields NaN). Computed in float32 (float64 stays float64) with autocast disabled.

    Args:
        features: feature maps.
        dim: the channel dimension.
        eps: added to the squared norm before the square root.

    Returns:
        Features of unit norm along ``dim`` (zero where the input is zero).

    Shape:
        features: ``(B, C, H, W)`` (any shape); output: the same shape, float32 or float64.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import channel_normalize
        >>> channel_normalize(torch.tensor([[[[3.0]], [[4.0]]]])).flatten().tolist()
        [0.6000000238418579, 0.800000011920929]

    References:
        Zhang, Isola, Efros, Shechtman, Wang (2018). The Unreasonable Effectiveness of Deep Features
        as a Perceptual Metric. CVPR.
    """
    if eps <= 0:
        raise InvalidValueError(f"eps must be positive (it keeps the gradient at zero finite), got {eps}")
    with _no_autocast(features):
        x = _float32_or_wider(features)
        return x * torch.rsqrt(x.pow(2).sum(dim=dim, keepdim=True) + eps)


def per_sample_mean(values: Tensor) -> Tensor:
    """Mean over every dimension except the first (the batch).

    Shape:
        values: ``(B, ...)``; output: ``(B,)``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import per_sample_mean
        >>> per_sample_mean(torch.arange(6.0).reshape(2, 3))
        tensor([1., 4.])
    """
    check_batch(values, "values")
    return values.reshape(values.shape[0], -1).mean(dim=1)


def check_batch(values: Tensor, name: str) -> None:
    """Raise unless ``values`` starts with a non-empty batch dimension; ``name`` says which argument it is.

    An empty batch has no loss to average (its mean is NaN), and a 0-D tensor has no batch at all.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import check_batch
        >>> check_batch(torch.zeros(2, 3), "features")  # fine: a batch of two
        >>> check_batch(torch.zeros(0, 3), "features")
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: features is an empty batch, shape (0, 3); pass at least one sample
    """
    if values.dim() == 0:
        raise InvalidValueError(f"{name} is a 0-D tensor; expected a batch of shape (B, ...)")
    if values.shape[0] == 0:
        raise InvalidValueError(f"{name} is an empty batch, shape {tuple(values.shape)}; pass at least one sample")


def check_images(images: object, name: str) -> None:
    """Raise unless ``images`` is a non-empty ``(B, C, H, W)`` tensor; ``name`` is the argument's name.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import check_images
        >>> check_images(torch.zeros(2, 3, 8, 8), "input")  # fine
        >>> check_images(torch.zeros(3, 8, 8), "input")
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: input must be (B, C, H, W) images, got shape (3, 8, 8)
    """
    if not isinstance(images, Tensor):
        raise InvalidTypeError(f"{name} must be a Tensor, got {type(images).__name__}")
    if images.dim() != 4:
        raise InvalidValueError(f"{name} must be (B, C, H, W) images, got shape {tuple(images.shape)}")
    check_batch(images, name)


def check_rgb_pair(input: Tensor, target: Tensor, metric: str) -> None:
    """Raise unless ``input`` and ``target`` are RGB images of one size on one device, the target's batch 1 or the
    input's: what a full-reference metric (LPIPS, DISTS) compares; ``metric`` names it in the message.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import check_rgb_pair
        >>> check_rgb_pair(torch.zeros(2, 3, 8, 8), torch.zeros(1, 3, 8, 8), "LPIPS")  # fine: one target for all
        >>> check_rgb_pair(torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 8), "LPIPS")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: input must have 3 channels (RGB), got shape (2, 1, 8, 8); repeat ...
    """
    check_images(input, "input")
    check_images(target, "target")
    for name, images in (("input", input), ("target", target)):
        if images.shape[1] != 3:
            hint = "; repeat grayscale with images.expand(-1, 3, -1, -1)" if images.shape[1] == 1 else ""
            raise InvalidValueError(f"{name} must have 3 channels (RGB), got shape {tuple(images.shape)}{hint}")
    if input.shape[1:] != target.shape[1:] or target.shape[0] not in (1, input.shape[0]):
        raise InvalidValueError(
            f"input {tuple(input.shape)} and target {tuple(target.shape)} do not match: {metric} compares images "
            "of one size, and the target's batch must be 1 or the input's"
        )
    if input.device != target.device:
        raise InvalidValueError(f"input is on {input.device} but target on {target.device}; move one of them")


def reduce_loss(values: Tensor, reduction: Reduction = "mean") -> Tensor:
    """Reduce per-sample losses over the batch: ``"mean"``, ``"sum"`` or ``"none"`` (unchanged).

    Shape:
        values: ``(B,)``; output: scalar, or ``(B,)`` for ``"none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import reduce_loss
        >>> values = torch.tensor([1.0, 2.0, 6.0])
        >>> reduce_loss(values), reduce_loss(values, "sum"), reduce_loss(values, "none")
        (tensor(3.), tensor(9.), tensor([1., 2., 6.]))
    """
    check_reduction(reduction)
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    return values


def check_reduction(reduction: str) -> None:
    """Raise ``InvalidValueError`` (a ``ValueError``) unless ``reduction`` is ``"mean"``, ``"sum"`` or ``"none"``.

    Examples:
        >>> from featurehooks.functional import check_reduction
        >>> check_reduction("sum")
        >>> check_reduction("max")
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: reduction must be one of ('mean', 'sum', 'none'), not 'max'
    """
    if reduction not in _REDUCTIONS:
        raise InvalidValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")


def _squared(x: Tensor, y: Tensor) -> Tensor:
    return (x - y).pow(2)


def _absolute(x: Tensor, y: Tensor) -> Tensor:
    return (x - y).abs()


def _smooth_l1(x: Tensor, y: Tensor) -> Tensor:
    x, y = torch.broadcast_tensors(x, y)
    return F.smooth_l1_loss(x, y, reduction="none", beta=1.0)


def _charbonnier(x: Tensor, y: Tensor) -> Tensor:
    return torch.sqrt((x - y).pow(2) + _CHARBONNIER_EPS**2)


def _cosine(x: Tensor, y: Tensor) -> Tensor:
    return 1 - F.cosine_similarity(x, y, dim=1, eps=_COSINE_EPS)


DISTANCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mse": _squared,
    "l2": _squared,
    "l1": _absolute,
    "mae": _absolute,
    "smooth_l1": _smooth_l1,
    "charbonnier": _charbonnier,
    "cosine": _cosine,
}
"""Named distances. ``"mse"``/``"l2"``: squared difference; ``"l1"``/``"mae"``: absolute difference;
``"smooth_l1"``: Huber with beta 1; ``"charbonnier"``: ``\\sqrt{d^2 + 10^{-6}}``; ``"cosine"``:
one minus the cosine similarity over the channel dimension (dim 1), ``1 - F.cosine_similarity(x, y, dim=1,
eps=1e-8)``: one value per position (DINO/CLIP feature losses), which losses average over the positions as they
average the elementwise distances over channels and positions.

Examples:
    >>> import torch
    >>> from featurehooks.functional import DISTANCES
    >>> sorted(DISTANCES)
    ['charbonnier', 'cosine', 'l1', 'l2', 'mae', 'mse', 'smooth_l1']
    >>> DISTANCES["l1"](torch.tensor([1.0, -2.0]), torch.zeros(2))
    tensor([1., 2.])
"""


def batch_frobenius(input: Tensor, target: Tensor) -> Tensor:
    """One Frobenius norm of the whole batch's difference, as BasicSR's ``criterion: fro`` computes it.

    It has no per-sample value: losses that use it (``distance="fro"``) return it with ``reduction="mean"``.

    Shape:
        input: ``(B, ...)``; target: the same or ``(1, ...)``; output: scalar.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import batch_frobenius
        >>> batch_frobenius(torch.full((2, 2), 3.0), torch.full((2, 2), 1.0))
        tensor(4.)
    """
    return torch.norm(input - target, p="fro")


BATCH_DISTANCES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"fro": batch_frobenius}
"""Named distances over the whole batch at once (no per-sample values): ``"fro"``, BasicSR's Frobenius norm.

Examples:
    >>> from featurehooks.functional import BATCH_DISTANCES
    >>> list(BATCH_DISTANCES)
    ['fro']
"""


def resolve_distance(distance: Distance) -> Callable[[Tensor, Tensor], Tensor]:
    """The elementwise function for a distance name, or the callable itself.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import resolve_distance
        >>> resolve_distance("mse")(torch.tensor([3.0]), torch.tensor([1.0]))
        tensor([4.])
        >>> resolve_distance("fro")
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: distance='fro' is one norm over the whole batch, ...
    """
    if callable(distance):
        return distance
    if isinstance(distance, str) and distance in DISTANCES:
        return DISTANCES[distance]
    if isinstance(distance, str) and distance in BATCH_DISTANCES:
        raise InvalidValueError(
            f"distance={distance!r} is one norm over the whole batch, with no per-sample value: "
            "PerceptualLoss and StyleLoss take it (with reduction='mean'); here use one of "
            f"{sorted(DISTANCES)} or a callable"
        )
    raise InvalidValueError(
        f"distance must be one of {sorted(DISTANCES) + sorted(BATCH_DISTANCES)} or a callable, not {distance!r}"
    )


def feature_distance(
    input: Tensor,
    target: Tensor,
    distance: Distance = "mse",
    mask: Tensor | None = None,
    mask_normalization: MaskNormalization = "mask",
) -> Tensor:
    """Per-sample distance between two feature maps: the mean of the elementwise distance over C, H, W.

    The target's batch dimension may be 1 (it broadcasts over the input's batch). With a ``mask`` on the
    features' grid, the mean is ``masked_mean``'s: each position weighs its mask value, and the sum is
    divided by the mask's area (``"mask"``) or the grid's (``"image"``).

    Args:
        input: features of the input.
        target: features of the target.
        distance: a name from ``DISTANCES`` or a callable ``(input, target) -> Tensor`` whose result
            has the batch as its first dimension (it is averaged over all other dimensions; with a
            mask, its last dimensions must be the mask's grid).
        mask: weights in [0, 1] on the features' positions (``resize_mask`` brings an image's mask there).
        mask_normalization: ``"mask"`` (default) or ``"image"``; see ``MaskNormalization``.

    Returns:
        One value per sample.

    Shape:
        input: ``(B, C, H, W)``; target: ``(B, C, H, W)`` or ``(1, C, H, W)``; mask: ``(B, 1, H, W)`` or
        ``(1, 1, H, W)``; output: ``(B,)``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import feature_distance
        >>> features = torch.zeros(2, 8, 4, 4)
        >>> feature_distance(features, torch.ones(1, 8, 4, 4))  # the target broadcasts over the batch
        tensor([1., 1.])
        >>> feature_distance(features, features + 2, "l1")
        tensor([2., 2.])
    """
    values = resolve_distance(distance)(input, target)
    if mask is None:
        return per_sample_mean(values)
    return masked_mean(values, mask, mask_normalization)


def total_variation(images: Tensor, norm: Literal["l1", "l2"] = "l1", reduction: Reduction = "mean") -> Tensor:
    r"""Total variation: how much neighbouring pixels differ, a smoothness prior for generated images.

    Per sample, the mean over channels and positions of the vertical neighbour differences plus the
    same mean of the horizontal ones; ``"l1"`` takes their absolute values (anisotropic TV),
    ``"l2"`` their squares (Mahendran and Vedaldi's ``\beta = 2``). Being means, values do not
    grow with the image size.

    Args:
        images: a batch of images (or feature maps).
        norm: ``"l1"`` or ``"l2"``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` over the batch.

    Returns:
        The total variation.

    Shape:
        images: ``(B, C, H, W)`` with ``H, W >= 2``; output: scalar, or ``(B,)`` for ``"none"``.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import total_variation
        >>> float(total_variation(torch.zeros(1, 3, 8, 8)))
        0.0

    References:
        Rudin, Osher, Fatemi (1992). Nonlinear total variation based noise removal algorithms.
        Mahendran, Vedaldi (2015). Understanding Deep Image Representations by Inverting Them. CVPR.
    """
    if not isinstance(images, Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise InvalidValueError(f"images must have shape (B, C, H, W), got {shape}")
    check_batch(images, "images")
    if images.shape[-1] < 2 or images.shape[-2] < 2:
        raise InvalidValueError(f"total variation needs H and W of at least 2, got {tuple(images.shape)}")
    if norm not in ("l1", "l2"):
        raise InvalidValueError(f"norm must be 'l1' or 'l2', not {norm!r}")
    check_reduction(reduction)
    x = _float32_or_wider(images)
    dy = x[:, :, 1:, :] - x[:, :, :-1, :]
    dx = x[:, :, :, 1:] - x[:, :, :, :-1]
    if norm == "l1":
        dy, dx = dy.abs(), dx.abs()
    else:
        dy, dx = dy.pow(2), dx.pow(2)
    return reduce_loss(per_sample_mean(dy) + per_sample_mean(dx), reduction)
