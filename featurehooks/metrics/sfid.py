"""sFID (Nash et al., 2021) as the ADM evaluator computes it: the Fréchet distance of the FID Inception's spatial
features.

The ADM evaluator (``guided-diffusion/evaluations/evaluator.py``) takes TensorFlow's ``mixed_6/conv`` tensor of the
FID Inception graph: the ReLU output of the 1x1 branch of the fourth 17x17 block, ``Mixed_6d.branch1x1`` in the
PyTorch port (192 channels, 17x17 for the graph's 299x299 input), keeps its first 7 channels and flattens each
image's ``(17, 17, 7)`` NHWC map into 2023 features. Its images enter the graph as they are and are resized there
by TensorFlow 1's bilinear rule: the ``"legacy_tensorflow"`` lineage, the default here. The forward stops after
``Mixed_6d.branch1x1``; in ``evaluate`` the FID pass gives sFID's maps on its way to the pool layer.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..backbones._fid_resize import check_lineage
from ..errors import InvalidValueError
from ._one_pass import Vectors, one_pass
from ._reuse import distance_of_sets, given_or_built
from .fid import FIDMode, WeightsArg, fid_mode, fid_network, inception_extractor
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from .._stream import SourceSpec, StreamOptions
    from ..extractor import FeatureExtractor, Precision

__all__ = ["SFID_CHANNELS", "SFID_LAYER", "sfid", "sfid_extractor", "sfid_statistics", "sfid_vectors"]

SFID_LAYER = "Mixed_6d.branch1x1"
"""The FID Inception's layer of sFID: TensorFlow's ``mixed_6/conv``.

Examples:
    >>> from featurehooks.metrics import SFID_LAYER
    >>> SFID_LAYER
    'Mixed_6d.branch1x1'
"""

SFID_CHANNELS = 7
"""The channels of ``SFID_LAYER`` that sFID keeps: the first seven, as the ADM evaluator does.

Examples:
    >>> from featurehooks.metrics import SFID_CHANNELS
    >>> SFID_CHANNELS
    7
"""

_RULE = "first7_nhwc"  # what the statistics' origin records as the vectors' pool: sFID's own rule


def sfid_vectors(maps: Tensor) -> Tensor:
    """sFID's vectors of ``SFID_LAYER``'s maps: the first ``SFID_CHANNELS`` channels, flattened in NHWC order.

    Shape:
        maps: ``(B, C, H, W)`` with ``C >= 7``; output: ``(B, H * W * 7)`` (2023 features for a 17x17 map).

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import sfid_vectors
        >>> maps = torch.arange(2 * 8 * 2 * 2.0).reshape(2, 8, 2, 2)
        >>> sfid_vectors(maps).shape, sfid_vectors(maps)[0, :3].tolist()  # pixel (0, 0) of channels 0, 1, 2
        (torch.Size([2, 28]), [0.0, 4.0, 8.0])
    """
    if maps.dim() != 4 or maps.shape[1] < SFID_CHANNELS:
        raise InvalidValueError(f"sFID takes (B, C >= {SFID_CHANNELS}, H, W) maps, got shape {tuple(maps.shape)}")
    return maps[:, :SFID_CHANNELS].permute(0, 2, 3, 1).flatten(1)


def sfid_extractor(
    weights: WeightsArg = "DEFAULT",
    *,
    mode: FIDMode = "legacy_tensorflow",
    device: str | torch.device | None = None,
    **extractor_options: Any,
) -> FeatureExtractor:
    """A ``FeatureExtractor`` of the FID Inception's ``SFID_LAYER`` (its maps: ``sfid_vectors`` makes them sFID's).

    Args:
        weights: see ``fid_extractor``.
        mode: the FID lineage of the resize to 299 inside the network; ``"legacy_tensorflow"``: the ADM
            evaluator's (TensorFlow's graph).
        device: see ``fid_extractor``.
        **extractor_options: ``FeatureExtractor`` keyword arguments, as for ``fid_extractor``.

    Shape:
        input: ``(B, 3, H, W)`` in [0, 1], any size; output: ``{"Mixed_6d.branch1x1": (B, 192, 17, 17)}``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import sfid_extractor
        >>> ext = sfid_extractor(weights=None, device="cpu")  # random init: not the FID network
        >>> ext(torch.rand(1, 3, 64, 64))["Mixed_6d.branch1x1"].shape
        torch.Size([1, 192, 17, 17])
    """
    return inception_extractor([SFID_LAYER], weights, mode, device, extractor_options)


def sfid_statistics(
    source: SourceSpec,
    *,
    weights: WeightsArg = "DEFAULT",
    mode: FIDMode | None = None,
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    extractor: FeatureExtractor | None = None,
    **options: Unpack[StreamOptions],
) -> FeatureStatistics:
    """sFID statistics of an image collection: the mean and covariance of its ``sfid_vectors``, streamed.

    Each image enters the FID Inception at its own size, as for ``fid_statistics``, and its 2023 spatial features
    are added to the mean and covariance in float64 without being kept.

    Args:
        source: images, as ``fid_statistics`` takes them.
        weights: see ``fid_extractor``.
        mode: the FID lineage; ``None``: that of ``extractor``, else ``"legacy_tensorflow"`` (the ADM evaluator's).
        device: see ``fid_extractor``.
        precision: see ``fid_extractor``.
        extractor: an ``sfid_extractor()`` to reuse (e.g. for two sets with one random init); it fixes weights,
            mode, device and precision.
        **options: the ``StreamOptions`` but ``resize_size`` and ``crop_size`` (the network resizes each image).

    Returns:
        ``FeatureStatistics`` of ``(N, 2023)`` vectors, their origin naming the FID Inception, ``SFID_LAYER``, the
        rule, the weights and the lineage: they compare only with sFID statistics of the same lineage.

    Raises:
        InvalidValueError: ``mode`` no lineage, ``extractor`` no ``sfid_extractor()`` or one of another ``mode``, or
            given with ``weights``/``device``/``precision``; bad options.
        WeightsUnavailableError: the weights file is neither cached nor downloadable, or unusable.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import sfid_statistics
        >>> _ = torch.manual_seed(0)
        >>> stats = sfid_statistics(torch.rand(3, 3, 48, 48), weights=None, device="cpu")  # random init
        >>> stats.count, stats.dim, stats.origin.lineage
        (3, 2023, 'legacy_tensorflow')

    References:
        Nash, Menick, Dieleman, Battaglia (2021). Generating Images with Sparse Representations. ICML.
        Dhariwal, Nichol (2021). Diffusion Models Beat GANs on Image Synthesis. NeurIPS.
        https://github.com/openai/guided-diffusion/tree/main/evaluations
    """
    if mode is not None:
        check_lineage(mode)
    for name in ("resize_size", "crop_size"):
        if name in options:
            raise InvalidValueError(f"sFID takes no {name}: the network resizes each image to 299x299 itself")
    build = functools.partial(
        sfid_extractor, weights, mode=mode or "legacy_tensorflow", device=device, precision=precision
    )
    extractor = given_or_built(extractor, build, weights, device, precision, mode=False)
    fid_network(extractor)  # refuses another network
    if [tap.path for tap in extractor.taps] != [SFID_LAYER] or (mode is not None and mode != fid_mode(extractor)):
        raise InvalidValueError(
            f"extractor= must be an sfid_extractor() (layer {SFID_LAYER!r}) of mode {mode or fid_mode(extractor)!r}; "
            f"this one returns {extractor.layers} in mode {fid_mode(extractor)!r}"
        )
    backbones = {"inception": (extractor, {"sfid": spatial_vectors()})}
    return one_pass(source, backbones, 0, (), options)["sfid"]


def spatial_vectors() -> Vectors:
    """sFID's vectors of an Inception in a pass of several metrics (``evaluate``)."""
    return Vectors(SFID_LAYER, _RULE, sfid_vectors)


def sfid(
    real: SourceSpec | FeatureStatistics,
    fake: SourceSpec | FeatureStatistics,
    *,
    weights: WeightsArg = "DEFAULT",
    mode: FIDMode = "legacy_tensorflow",
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    **options: Unpack[StreamOptions],
) -> float:
    """sFID between two image collections (or their ``sfid_statistics``): the ADM evaluator's ``sFID`` line.

    Args:
        real: images as ``sfid_statistics`` takes them, or statistics it computed earlier (a reference set).
        fake: the same, for the other set.
        weights: see ``fid_extractor``.
        mode: the FID lineage (``"legacy_tensorflow"``: the ADM evaluator's).
        device: see ``fid_extractor``.
        precision: see ``fid_extractor``.
        **options: the ``StreamOptions`` for the sets given as images.

    Raises:
        InvalidValueError: statistics of other features (another layer, rule, weights or lineage), and as
            ``sfid_statistics``.

    Examples:
        >>> import torch, warnings
        >>> from featurehooks.metrics import sfid
        >>> _ = torch.manual_seed(0)
        >>> real, fake = torch.rand(3, 3, 40, 40), torch.rand(3, 3, 40, 40)  # or folders, globs, file lists
        >>> with warnings.catch_warnings():  # 3 vectors in 2023 dimensions: it warns
        ...     warnings.simplefilter("ignore")
        ...     sfid(real, fake, weights=None, device="cpu") > 0
        True
    """
    return distance_of_sets(
        real,
        fake,
        lambda: sfid_extractor(weights, mode=mode, device=device, precision=precision),
        lambda images, extractor: sfid_statistics(images, extractor=extractor, **options),
    )
