"""FD_DINOv2 as dgm-eval computes it: the Fréchet distance of DINOv2 ViT-L/14 class tokens.

Stein et al. (2023) replace FID's Inception by DINOv2 ViT-L/14 (``torch.hub.load("facebookresearch/dinov2",
"dinov2_vitl14")``); their dgm-eval code, and EDM2's ``calculate_metrics.py`` after it, resize the whole image to
224x224 (bicubic, no crop), normalize with ImageNet's mean and std, and take the hub model's output: the class
token after the final LayerNorm (``x_norm_clstoken``, 1024 features), with the position embeddings interpolated
to the 16x16 grid by DINOv2's own rule. ``fd_dinov2_statistics`` streams images through the ``"dinov2_vitl14"``
backbone built that way (``featurehooks.backbones.dinov2``): files are resized by Pillow's bicubic filter, the
pixels dgm-eval's ``torchvision.transforms.Resize`` makes of the PIL image; the class token of layer ``"norm"``
is summarized in a ``FeatureStatistics``, whose origin names the backbone, so it is never compared with FID's
or another backbone's statistics.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Union

import torch
from typing_extensions import Unpack

from ..backbones.dinov2 import DINOV2_LAYER, DINOV2_MODELS
from ..errors import InvalidValueError, did_you_mean
from ._reuse import distance_of_sets, given_or_built
from .collect import PassSettings, collect
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from .._stream import SourceSpec, StreamOptions
    from ..extractor import FeatureExtractor, Precision

__all__ = ["FD_DINOV2_MODELS", "fd_dinov2", "fd_dinov2_extractor", "fd_dinov2_statistics"]

FD_DINOV2_MODELS = tuple(name.removeprefix("dinov2_") for name in DINOV2_MODELS)
"""The ``model=`` values: dgm-eval's ``--arch`` names of DINOv2's hub entries; ``"vitl14"`` is FD_DINOv2.

Examples:
    >>> from featurehooks.metrics.dinov2_fd import FD_DINOV2_MODELS
    >>> FD_DINOV2_MODELS
    ('vits14', 'vitb14', 'vitl14', 'vitg14')
"""

WeightsArg = Union[str, "os.PathLike[str]", None]
_DEFAULT_MODEL = "vitl14"


def _backbone_name(model: object) -> str:
    if model not in FD_DINOV2_MODELS:
        raise InvalidValueError(
            f"model must be one of {FD_DINOV2_MODELS} (dgm-eval's --arch; 'vitl14' is FD_DINOv2), got {model!r}; "
            f"{did_you_mean(str(model), FD_DINOV2_MODELS)}"
        )
    return f"dinov2_{model}"


def fd_dinov2_extractor(
    model: str = _DEFAULT_MODEL,
    weights: WeightsArg = "DEFAULT",
    *,
    device: str | torch.device | None = None,
    **extractor_options: Any,
) -> FeatureExtractor:
    """A ``FeatureExtractor`` of DINOv2's final norm (layer ``"norm"``, tokens), on ``device``, without a graph.

    Its preprocessing is dgm-eval's: the whole image to 224x224, bicubic, ImageNet mean and std. It computes in
    NCHW and float32, as the hub model does (``memory_format="contiguous"``); ``extractor_options`` change that
    as for any extractor.

    Args:
        model: ``"vitl14"`` (FD_DINOv2), or ``"vits14"``, ``"vitb14"``, ``"vitg14"`` (``FD_DINOV2_MODELS``).
        weights: ``"DEFAULT"`` (the hub release, ``$TORCH_HOME/hub/checkpoints/dinov2_<model>_pretrain.pth``), a
            local copy (hub or timm keys), or ``None`` for random init (not FD_DINOv2).
        device: where it computes; ``None``: CUDA when available, else the CPU.
        **extractor_options: ``FeatureExtractor`` keyword arguments, e.g. ``precision="bf16"`` (faster, but not
            the number papers report).

    Shape:
        input: ``(B, 3, 224, 224)`` in [0, 1]; output: ``{"norm": (B, 257, D)}``, the class token first.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import fd_dinov2_extractor
        >>> ext = fd_dinov2_extractor("vits14", weights=None, device="cpu")  # random init: not FD_DINOv2
        >>> ext(torch.rand(1, 3, 224, 224))["norm"].shape, ext.preprocessing.crop_mode
        (torch.Size([1, 257, 384]), 'squash')
    """
    from ..extractor import FeatureExtractor

    name = _backbone_name(model)
    options = {"mode": "detach", "memory_format": "contiguous", **extractor_options}
    extractor = FeatureExtractor(name, [DINOV2_LAYER], weights=weights, **options)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return extractor.to(device)


def _check_extractor(extractor: FeatureExtractor) -> None:
    """Refuse an extractor that does not return DINOv2's final norm alone, as ``fd_dinov2_extractor`` builds it."""
    taps = list(extractor.taps)
    if extractor.backbone_name not in DINOV2_MODELS or len(taps) != 1 or taps[0].path != DINOV2_LAYER:
        raise InvalidValueError(
            f"extractor= must return layer {DINOV2_LAYER!r} of a DINOv2 backbone ({', '.join(DINOV2_MODELS)}) "
            f"alone, as fd_dinov2_extractor() builds; this one is {extractor.backbone_name!r} with layers "
            f"{extractor.layers}: use feature_statistics for other features"
        )


def fd_dinov2_statistics(
    source: SourceSpec,
    *,
    model: str = _DEFAULT_MODEL,
    weights: WeightsArg = "DEFAULT",
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    extractor: FeatureExtractor | None = None,
    keep: int = 0,
    seed: int = 0,
    **options: Unpack[StreamOptions],
) -> FeatureStatistics:
    """FD_DINOv2 statistics of an image collection: dgm-eval's DINOv2 representations, streamed.

    ``feature_statistics`` of the class token (``pool="cls"``) of ``fd_dinov2_extractor(model, weights)``'s layer
    ``"norm"`` (DINOv2's ``x_norm_clstoken``): each image file is resized to 224x224 by Pillow's bicubic filter
    (the pixels of dgm-eval's ``Resize`` of the PIL image), normalized, and its class token added to the mean
    and covariance in float64 without keeping the features. Tensors and Datasets are taken as prepared:
    224x224 in [0, 1] (``prepare_image`` makes them so: Pillow for ``uint8``, torch's antialiased bicubic for
    floats, as EDM2's ``resize_mode="torch"``).

    Args:
        source: a folder (searched recursively), a glob, an image path, a list of these, a ``Dataset`` of prepared
            image tensors or an ``(N, 3, 224, 224)`` tensor, as ``feature_statistics`` takes.
        model: see ``fd_dinov2_extractor``.
        weights: see ``fd_dinov2_extractor``.
        device: see ``fd_dinov2_extractor``.
        precision: see ``fd_dinov2_extractor``.
        extractor: a ``fd_dinov2_extractor()`` to reuse (e.g. for two sets); it fixes model, weights, device and
            precision, which must then be left as they are.
        keep: also keep a sample of at most this many feature vectors (for ``kernel_inception_distance``).
        seed: seed of that sample.
        **options: the ``StreamOptions``; ``resize_size`` and ``crop_size`` default to dgm-eval's 224x224.

    Returns:
        ``FeatureStatistics`` of ``(N, D)`` vectors (``D`` = 1024 for ViT-L/14), their origin naming the backbone,
        layer ``"norm"``, pool ``"cls"`` and the weights.

    Raises:
        InvalidValueError: an unknown ``model``, an ``extractor`` that is no FD_DINOv2 extractor or comes with
            ``model``/``weights``/``device``/``precision``, or bad options.
        WeightsUnavailableError: the weights file is neither cached nor downloadable, or unusable.
        InputNotFoundError: ``source`` finds no images.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.dinov2_fd import fd_dinov2_statistics
        >>> _ = torch.manual_seed(0)
        >>> stats = fd_dinov2_statistics(torch.rand(2, 3, 224, 224), model="vits14", weights=None, device="cpu")
        >>> stats.count, stats.dim, stats.origin.backbone, stats.origin.pool
        (2, 384, 'dinov2_vits14', 'cls')

    References:
        Stein, Cresswell, Hosseinzadeh, Sui, Ross, Villecroze, Liu, Caterini, Taylor, Loaiza-Ganem (2023).
        Exposing flaws of generative model evaluation metrics and their unfair treatment of diffusion models.
        NeurIPS. https://github.com/layer6ai-labs/dgm-eval
        Oquab et al. (2024). DINOv2: Learning Robust Visual Features without Supervision. TMLR.
    """
    extractor = given_or_built(
        extractor,
        lambda: fd_dinov2_extractor(model, weights, device=device, precision=precision),
        weights,
        device,
        precision,
        model=model != _DEFAULT_MODEL,
    )
    _check_extractor(extractor)
    return collect(extractor, source, [DINOV2_LAYER], PassSettings.of("cls", keep, seed, options))[DINOV2_LAYER]


def fd_dinov2(
    real: SourceSpec | FeatureStatistics,
    fake: SourceSpec | FeatureStatistics,
    *,
    model: str = _DEFAULT_MODEL,
    weights: WeightsArg = "DEFAULT",
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    **options: Unpack[StreamOptions],
) -> float:
    """FD_DINOv2 between two image collections (or their ``fd_dinov2_statistics``): one extractor, two passes.

    Args:
        real: images as ``fd_dinov2_statistics`` takes them, or statistics it computed earlier (a reference set).
        fake: the same, for the other set.
        model: see ``fd_dinov2_extractor``.
        weights: see ``fd_dinov2_extractor``.
        device: see ``fd_dinov2_extractor``.
        precision: see ``fd_dinov2_extractor``.
        **options: the ``StreamOptions`` for the sets given as images.

    Returns:
        ``frechet_distance`` of the two statistics: the number dgm-eval's ``fd`` metric reports for the same
        images (on 50,000 generated images in the paper: compare only numbers of equal set sizes).

    Raises:
        InvalidValueError: statistics of other features (another backbone, layer, pool or weights), and as
            ``fd_dinov2_statistics``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.dinov2_fd import fd_dinov2
        >>> _ = torch.manual_seed(0)
        >>> real, fake = torch.rand(2, 3, 224, 224), torch.rand(2, 3, 224, 224)  # or folders, globs, file lists
        >>> import warnings
        >>> with warnings.catch_warnings():  # 2 vectors in 384 dimensions: it warns
        ...     warnings.simplefilter("ignore")
        ...     fd_dinov2(real, fake, model="vits14", weights=None, device="cpu") > 0
        True
    """
    return distance_of_sets(
        real,
        fake,
        lambda: fd_dinov2_extractor(model, weights, device=device, precision=precision),
        lambda images, extractor: fd_dinov2_statistics(images, extractor=extractor, **options),
    )
