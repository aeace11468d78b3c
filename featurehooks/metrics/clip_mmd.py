"""CMMD: the maximum mean discrepancy with a Gaussian RBF kernel between CLIP ViT-L/14@336 image embeddings.

As Jayasumana et al. define it (google-research's JAX code, and cmmd-pytorch, its port): each image's
``image_embeds`` (the projection output of CLIP's image tower) scaled to unit length, the biased (minimum-variance)
estimator of MMD² with ``k(a, b) = exp(-||a - b||² / (2 σ²))``, ``σ = 10``, times 1000. Here the kernel sums run in
float64 in blocks (the references sum in float32, which loses the last digits of the small difference of three
means near 1), so 30,000 × 30,000 kernels never sit in memory at once.

Images are prepared as CLIP prepares them (``load_backbone("clip_vit_l14_336")``): the shorter side resized
bicubic to 336 by Pillow, then the center 336 × 336, CLIP's mean and std. The references crop the largest centered
square first and resize it to 336: the same pixels for square images; for others the sampling grid differs by up
to a pixel, and the value with it, so compare CMMDs of non-square sets only with featurehooks' own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from typing_extensions import Unpack

from ..backbones.clip import EMBEDDING_LAYER
from ..errors import InvalidTypeError, InvalidValueError
from ._reuse import given_or_built
from .collect import PassSettings, collect
from .statistics import KEEP_ALL

if TYPE_CHECKING:
    import os

    from .._stream import SourceSpec, StreamOptions
    from ..extractor import FeatureExtractor

__all__ = ["CMMD_BACKBONE", "cmmd", "cmmd_embeddings", "cmmd_extractor", "cmmd_of_embeddings"]

CMMD_BACKBONE = "clip_vit_l14_336"
"""The backbone CMMD is defined on: OpenAI's CLIP ViT-L/14 at 336 pixels (``openai/clip-vit-large-patch14-336``).

Examples:
    >>> from featurehooks.backbones.clip import CLIP_TOWERS
    >>> from featurehooks.metrics import CMMD_BACKBONE
    >>> CLIP_TOWERS[CMMD_BACKBONE].repo
    'openai/clip-vit-large-patch14-336'
"""
SIGMA = 10.0
SCALE = 1000.0
_BLOCK = 2048  # rows a side per block of kernel values: 32 MiB of float64


def _embeddings(value: Any, name: str) -> Tensor:
    """``value`` as ``(N, D)`` float64 rows of unit length (on its device), refused unless non-empty and finite."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, Tensor):
        raise InvalidTypeError(f"{name} must be an (N, D) torch.Tensor or numpy array, not {type(value).__name__}")
    if not value.is_floating_point():
        raise InvalidTypeError(f"{name} must hold floating-point embeddings, got {value.dtype}")
    if value.dim() != 2 or value.shape[0] == 0 or value.shape[1] == 0:
        raise InvalidValueError(f"{name} must be (N, D) embeddings with N, D >= 1, got shape {tuple(value.shape)}")
    rows = value.detach().to(torch.float64)
    bad = int((~torch.isfinite(rows)).any(dim=1).sum())
    if bad:
        raise InvalidValueError(f"{name} holds NaN or infinite values in {bad} of {rows.shape[0]} embeddings")
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
    zero = int((norms == 0).sum())
    if zero:
        raise InvalidValueError(f"{name} holds {zero} all-zero embeddings, which have no direction to compare")
    return rows / norms


def _kernel_sum(a: Tensor, b: Tensor, *, same: bool) -> Tensor:
    """Sum of ``exp(-||a_i - b_j||² / (2 σ²))`` over all pairs, block by block; ``same``: ``b`` is ``a``, so each
    block above the diagonal stands for its mirror image too."""
    gamma = 1.0 / (2.0 * SIGMA**2)
    norms_a, norms_b = (a * a).sum(dim=1), (b * b).sum(dim=1)
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, a.shape[0], _BLOCK):
        for j in range(i if same else 0, b.shape[0], _BLOCK):
            squared = torch.addmm(norms_b[None, j : j + _BLOCK], a[i : i + _BLOCK], b[j : j + _BLOCK].T, alpha=-2.0)
            squared.add_(norms_a[i : i + _BLOCK, None]).clamp_(min=0.0)
            block = squared.mul_(-gamma).exp_().sum()
            total += block if not same or i == j else 2.0 * block
    return total


def cmmd_of_embeddings(x: Tensor | np.ndarray, y: Tensor | np.ndarray) -> float:
    """CMMD of two sets of CLIP image embeddings: ``1000 × MMD²`` (biased estimator, RBF kernel with ``σ = 10``).

    Each row is scaled to unit length first (as CMMD defines it; rows already of unit length stay as they are), then
    ``mean k(x, x') + mean k(y, y') - 2 mean k(x, y)`` over all pairs, diagonals included, in float64 on ``x``'s device,
    in blocks of 2048 rows a side. The sets may differ in size; identical sets give 0 up to rounding.

    Shape:
        x: ``(N, D)``; y: ``(M, D)``.

    Raises:
        InvalidValueError: an empty set, other ``D``s, NaN or infinite values, an all-zero row.
        InvalidTypeError: not a floating-point tensor or array.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import cmmd_of_embeddings
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(100, 768)
        >>> cmmd_of_embeddings(x, x) == 0.0, cmmd_of_embeddings(x, torch.randn(80, 768) + 0.1) > 0.1
        (True, True)

    References:
        Jayasumana, Ramalingam, Veit, Glasner, Chakrabarti, Kumar (2024). Rethinking FID: Towards a Better
        Evaluation Metric for Image Generation. CVPR.
        Gretton, Borgwardt, Rasch, Schölkopf, Smola (2012). A Kernel Two-Sample Test. JMLR (Eq. 5).
    """
    a, b = _embeddings(x, "x"), _embeddings(y, "y")
    if a.shape[1] != b.shape[1]:
        raise InvalidValueError(f"x has {a.shape[1]} dimensions per embedding and y {b.shape[1]}: they must match")
    b = b.to(a.device)
    n, m = a.shape[0], b.shape[0]
    xx, yy, xy = _kernel_sum(a, a, same=True), _kernel_sum(b, b, same=True), _kernel_sum(a, b, same=False)
    return float(SCALE * (xx / (n * n) + yy / (m * m) - 2.0 * xy / (n * m)))


def cmmd_extractor(
    weights: str | os.PathLike[str] | None = "DEFAULT", *, device: str | torch.device | None = None
) -> FeatureExtractor:
    """A ``FeatureExtractor`` of ``"clip_vit_l14_336"``'s embedding layer (``"visual_projection"``), without a graph.

    Args:
        weights: ``"DEFAULT"`` (OpenAI's, from the Hugging Face cache), a local file, or ``None`` for random init
            (the architecture, not CLIP).
        device: where it computes; ``None``: CUDA when available, else the CPU.

    Shape:
        input: ``(B, 3, 336, 336)`` in [0, 1]; output: ``{"visual_projection": (B, 768)}``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import cmmd_extractor
        >>> ext = cmmd_extractor(weights=None, device="cpu")  # random init: the architecture, not CLIP
        >>> ext.backbone_name, ext.layers, ext.preprocessing.crop_size
        ('clip_vit_l14_336', ['visual_projection'], 336)
    """
    from ..extractor import FeatureExtractor

    extractor = FeatureExtractor(CMMD_BACKBONE, [EMBEDDING_LAYER], weights=weights, mode="detach")
    # CMMD's reference cuts the centered square, then resizes it (CLIP's own processor resizes, then crops)
    extractor.preprocessing = dataclasses.replace(extractor.preprocessing, crop_mode="square")
    return extractor.to(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def _embed(extractor: FeatureExtractor, source: SourceSpec, settings: PassSettings) -> Tensor:
    """Every ``(N, D)`` embedding of ``source`` (float32, in the order of its rows), from ``extractor``'s one output."""
    layers = list(extractor.layers)
    if len(layers) != 1:
        raise InvalidValueError(f"the extractor returns {len(layers)} outputs {layers}: CMMD needs one embedding layer")
    return collect(extractor, source, layers, settings)[layers[0]].features


def cmmd_embeddings(source: SourceSpec, extractor: FeatureExtractor, **options: Unpack[StreamOptions]) -> Tensor:
    """The ``image_embeds`` of every readable image of ``source``, as ``(N, D)`` float32 (not scaled to unit length).

    Keep a reference set's embeddings (``torch.save``/``np.save``) and pass them to ``cmmd_of_embeddings`` later:
    what cmmd-pytorch's ``--ref_embed_file`` does. Images stream as for every statistic (``StreamOptions``);
    unreadable ones are left out with a warning.

    Args:
        source: a folder (searched recursively), a glob, an image path, a list of these, a ``Dataset`` of image
            tensors or an ``(N, 3, H, W)`` tensor.
        extractor: ``cmmd_extractor()``, or any extractor with one output of ``(B, D)`` vectors (another CLIP
            tower gives a CMMD-like number, not CMMD).
        **options: the ``StreamOptions``.

    Raises:
        InputNotFoundError: ``source`` finds no images.
        InvalidValueError: bad options, or an extractor whose output is not one layer of vectors.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import cmmd_embeddings
        >>> toy = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 8))
        >>> ext = FeatureExtractor(toy, ["2"])  # a stand-in for cmmd_extractor(), which reads CLIP's weights
        >>> cmmd_embeddings(torch.rand(5, 3, 32, 32), ext).shape  # or a folder, a glob, a list of files
        torch.Size([5, 8])
    """
    return _embed(extractor, source, PassSettings.of(None, KEEP_ALL, 0, options))


def cmmd(
    real: SourceSpec,
    fake: SourceSpec,
    *,
    weights: str | os.PathLike[str] | None = "DEFAULT",
    device: str | torch.device | None = None,
    extractor: FeatureExtractor | None = None,
    **options: Unpack[StreamOptions],
) -> float:
    """CMMD between two image collections: ``cmmd_of_embeddings`` of their CLIP ViT-L/14@336 embeddings.

    Both sets stream through one ``cmmd_extractor(weights, device=device)``; the embeddings (3 KiB an image) stay
    in memory and the kernel sums run on the extractor's device. Lower is closer; papers report it on 30,000 images
    a set.

    Args:
        real: the reference images (any source ``cmmd_embeddings`` takes).
        fake: the images to evaluate.
        weights: see ``cmmd_extractor``.
        device: see ``cmmd_extractor``.
        extractor: a ``cmmd_extractor()`` to reuse across calls (it fixes weights and device, which must then be
            left as they are), or another extractor of one vector output (a CMMD-like number, not CMMD).
        **options: the ``StreamOptions`` (``batch_size``, ``num_workers``, ``progress``, ...).

    Raises:
        WeightsUnavailableError: the CLIP weights are not in the Hugging Face cache (nothing is downloaded).
        MissingDependencyError: transformers is not installed.
        InputNotFoundError: a source finds no images.
        InvalidValueError: bad options, or ``extractor`` given with ``weights`` or ``device``.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import cmmd
        >>> _ = torch.manual_seed(0)
        >>> toy = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 8))
        >>> ext = FeatureExtractor(toy, ["2"])  # a stand-in for cmmd_extractor(), which reads CLIP's weights
        >>> images = torch.rand(6, 3, 32, 32)  # or folders, globs, file lists
        >>> cmmd(images, images, extractor=ext), cmmd(images, images.flip(-1) ** 2, extractor=ext) > 0
        (0.0, True)
    """
    settings = PassSettings.of(None, KEEP_ALL, 0, options)  # bad options fail before the model is read
    if settings.streaming.shard is not None:
        raise InvalidValueError("CMMD is of two whole sets: shard= is for cmmd_embeddings of a part of one")
    extractor = given_or_built(extractor, lambda: cmmd_extractor(weights, device=device), weights, device, None)
    x, y = (_embed(extractor, source, settings).to(extractor.device) for source in (real, fake))
    return cmmd_of_embeddings(x, y)
