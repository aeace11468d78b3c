"""``evaluate``: the generative-evaluation numbers of two image sets from one decode of each image.

Each metric needs the vectors of one backbone: FID, KID, PRDC and the Inception Score the FID Inception's pool
features (in the asked FID lineage), FD_DINOv2 DINOv2 ViT-L/14's class token, CMMD CLIP ViT-L/14@336's image
embedding. Every image is read and decoded once, by the input pipeline's workers, at its own size; each backbone
then prepares it as its single-metric function would (its own resize, from the same ``uint8`` pixels) and embeds
it. One pass per set gives a ``FeatureStatistics`` per backbone, with every vector kept where a metric needs
vectors, and the numbers come from those; the statistics of a set serve as its reference in later calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from .._stream import SourceSpec, StreamOptions
from .._stream.forward import pool_features
from .._stream.sources import first_tensor
from ..errors import InvalidTypeError, InvalidValueError, did_you_mean
from ..images import ImageTransform, transform_for
from .clip_mmd import cmmd_extractor, cmmd_of_embeddings
from .collect import _origins, feature_statistics_by_layer
from .dinov2_fd import fd_dinov2_extractor
from .fid import FIDMode, WeightsArg, fid_extractor, fid_network
from .frechet import frechet_distance, kernel_inception_distance
from .isc import inception_score_of_features
from .prdc import precision_recall
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["METRICS", "Evaluation", "evaluate"]

METRICS = ("fid", "fd_dinov2", "cmmd", "is", "kid", "prdc")
"""The numbers ``evaluate`` computes, by name.

Examples:
    >>> from featurehooks.metrics import METRICS
    >>> METRICS
    ('fid', 'fd_dinov2', 'cmmd', 'is', 'kid', 'prdc')
"""

_BACKBONE_OF = {"fid": "inception", "is": "inception", "kid": "inception", "prdc": "inception"}
_BACKBONE_OF |= {"fd_dinov2": "dinov2", "cmmd": "clip"}
_NEED_VECTORS = frozenset({"cmmd", "is", "kid", "prdc"})
_EVERY_VECTOR = 2**53  # a FeatureStatistics keep that keeps every vector (its sample grows as vectors come)


@dataclass(frozen=True)
class Evaluation:
    """What ``evaluate`` found: ``numbers`` by metric name (a float, or ``(mean, std)`` for ``"is"`` and ``"kid"``,
    a ``PRDC`` for ``"prdc"``), and the statistics of each set by backbone (``"inception"``, ``"dinov2"``,
    ``"clip"``), which a later ``evaluate`` takes in place of the images.

    Examples:
        >>> from featurehooks.metrics import Evaluation
        >>> Evaluation(numbers={"fid": 3.2}, real={}, fake={}).numbers["fid"]
        3.2
    """

    numbers: dict[str, Any]
    real: dict[str, FeatureStatistics]
    fake: dict[str, FeatureStatistics]


class _Embedding(nn.Module):
    """One backbone of the pass: prepares each image as its single-metric function does, embeds it, pools it."""

    def __init__(self, extractor: FeatureExtractor, layer: str, pool: str | None, from_uint8: bool) -> None:
        super().__init__()
        self.extractor = extractor
        self.layer, self.pool, self.from_uint8 = layer, pool, from_uint8
        self.transform: ImageTransform = transform_for(extractor.preprocessing, extractor.input_range)

    def forward(self, images: Tensor) -> Tensor:
        pixels = images.detach().cpu()
        if self.from_uint8:  # the pipeline's u / 255, back to the uint8 pixels its single-metric function resizes
            pixels = pixels.mul(255).round_().to(torch.uint8)
        prepared = torch.stack([self.transform(image) for image in pixels]).to(self.extractor.device)
        value = self.extractor(prepared)[self.layer]
        return pool_features(value, self.extractor.output_layouts[self.layer], self.pool, self.layer)  # type: ignore[arg-type]


class _Backbones(nn.Module):
    """The backbones of one pass as one module: a batch in, each backbone's vectors out."""

    def __init__(self, members: Mapping[str, _Embedding]) -> None:
        super().__init__()
        self.members = nn.ModuleDict(members)

    def forward(self, images: Tensor) -> list[Tensor]:
        return [member(images) for member in self.members.values()]


def _builders(
    mode: FIDMode, dinov2_model: str, weights: Mapping[str, WeightsArg], device: str | torch.device | None
) -> dict[str, Callable[[], tuple[FeatureExtractor, str, str | None]]]:
    """How each backbone is built: the extractor, the layer and the pool whose vectors the metrics take."""
    return {
        "inception": lambda: (
            fid_extractor(weights.get("inception", "DEFAULT"), mode=mode, device=device),
            "avgpool",
            "avg",
        ),
        "dinov2": lambda: (
            fd_dinov2_extractor(dinov2_model, weights.get("dinov2", "DEFAULT"), device=device),
            "norm",
            "cls",
        ),
        "clip": lambda: (cmmd_extractor(weights.get("clip", "DEFAULT"), device=device), "visual_projection", None),
    }


def _check_metrics(metrics: Sequence[str]) -> list[str]:
    names = [metrics] if isinstance(metrics, str) else list(metrics)
    if not names:
        raise InvalidValueError(f"no metrics asked for; choose from {', '.join(METRICS)}")
    for name in names:
        if name not in METRICS:
            raise InvalidValueError(
                f"unknown metric {name!r} (the metrics are {', '.join(METRICS)}); {did_you_mean(name, METRICS)}"
            )
    return list(dict.fromkeys(names))


def _pixels_are_uint8(source: SourceSpec) -> bool:
    """Whether the pipeline makes ``source``'s images from ``uint8`` pixels (files, ``uint8`` tensors and datasets)."""
    if isinstance(source, Tensor):
        return source.dtype == torch.uint8
    if isinstance(source, torch.utils.data.Dataset):
        try:
            return first_tensor(source[0]).dtype == torch.uint8
        except Exception:  # noqa: BLE001 - an unreadable first item: the pipeline reports it as an invalid row
            return False
    return True


def _statistics(
    source: SourceSpec, built: Mapping[str, tuple[FeatureExtractor, str, str | None]], keep: int, options: StreamOptions
) -> dict[str, FeatureStatistics]:
    """One pass over ``source``: the statistics of each backbone's vectors, with the origin its own function records."""
    from ..extractor import FeatureExtractor

    uint8 = _pixels_are_uint8(source)
    members = {name: _Embedding(ext, layer, pool, uint8) for name, (ext, layer, pool) in built.items()}
    passing = FeatureExtractor(_Backbones(members), [f"members.{name}" for name in members], mode="detach")
    native: StreamOptions = {**options, "resize_size": None, "crop_size": None}  # each backbone resizes its own
    found = feature_statistics_by_layer(passing, source, layers=passing.layers, pool="avg", keep=keep, **native)
    stats = {}
    for name, member in members.items():
        one = found[f"members.{name}"]
        one.origin = _origins(member.extractor, [member.layer], member.pool, member.transform)[member.layer]
        stats[name] = one
    return stats


def _side(
    value: SourceSpec | Mapping[str, FeatureStatistics],
    what: str,
    needed: Sequence[str],
    backbone: Callable[[str], tuple[FeatureExtractor, str, str | None]],
    keep: int,
    options: StreamOptions,
) -> dict[str, FeatureStatistics]:
    """The statistics of one set: computed in one pass over its images, or taken from an earlier evaluation."""
    if not isinstance(value, Mapping):
        return _statistics(value, {name: backbone(name) for name in needed}, keep, options)
    missing = [name for name in needed if name not in value]
    if missing:
        raise InvalidValueError(f"{what} holds no statistics of {', '.join(missing)} (it holds {', '.join(value)})")
    for name in needed:
        if not isinstance(value[name], FeatureStatistics):
            raise InvalidTypeError(f"{what}[{name!r}] must be FeatureStatistics, not {type(value[name]).__name__}")
    return {name: value[name] for name in needed}


def evaluate(
    real: SourceSpec | Mapping[str, FeatureStatistics],
    fake: SourceSpec | Mapping[str, FeatureStatistics],
    metrics: Sequence[str] = METRICS,
    *,
    fid_mode: FIDMode = "legacy_pytorch",
    dinov2_model: str = "vitl14",
    weights: Mapping[str, WeightsArg] | None = None,
    device: str | torch.device | None = None,
    kid_subset_size: int = 1000,
    prdc_k: int = 5,
    is_splits: int = 10,
    **options: Unpack[StreamOptions],
) -> Evaluation:
    """``metrics`` between ``real`` and ``fake``, each image decoded once for every backbone they need.

    Each number equals its single-metric function on the same images and weights: ``"fid"`` ``fid_statistics`` in
    the lineage ``fid_mode`` and ``frechet_distance``; ``"kid"`` ``kernel_inception_distance`` and ``"prdc"``
    ``precision_recall`` (``k=prdc_k``, ``real`` as the reference) on those pool features; ``"is"`` the Inception
    Score of ``fake`` (``inception_score_of_features``, ``is_splits`` splits) from the same forward;
    ``"fd_dinov2"`` ``fd_dinov2`` (DINOv2 ViT-L/14's class token); ``"cmmd"`` ``cmmd`` (CLIP ViT-L/14@336). Every
    vector of a set is kept where a metric needs vectors (CMMD, IS, KID, PRDC: ``N x 2048`` float32 for the
    Inception, ``N x 1024`` for DINOv2, ``N x 768`` for CLIP).

    Args:
        real: the reference images (a folder, glob, file list, dataset or tensor, as ``dump_features`` takes), or
            the ``real`` statistics of an earlier ``Evaluation``.
        fake: the generated images, or statistics as for ``real``.
        metrics: names from ``METRICS``.
        fid_mode: the FID lineage of the Inception's features (``FID_MODES``).
        dinov2_model: the DINOv2 of ``"fd_dinov2"`` (``FD_DINOV2_MODELS``; ViT-L/14 is the reference's).
        weights: per backbone (``"inception"``, ``"dinov2"``, ``"clip"``), its ``weights`` argument; the others
            ``"DEFAULT"``.
        device: where the backbones compute; ``None``: CUDA when available, else the CPU.
        kid_subset_size: vectors per KID subset (each set needs at least as many).
        prdc_k: the nearest neighbour of PRDC's radii.
        is_splits: the splits of the Inception Score.
        **options: the ``StreamOptions`` but ``resize_size`` and ``crop_size`` (each backbone prepares its images).

    Raises:
        InvalidValueError: an unknown metric, statistics that lack a backbone or come from other features, a set
            too small for KID's subsets, or bad options.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import evaluate
        >>> _ = torch.manual_seed(0)
        >>> real, fake = torch.rand(6, 3, 40, 40), torch.rand(6, 3, 40, 40)
        >>> found = evaluate(real, fake, ["fid", "kid"], weights={"inception": None}, device="cpu", kid_subset_size=3)
        >>> sorted(found.numbers), sorted(found.real)
        (['fid', 'kid'], ['inception'])
    """
    names = _check_metrics(metrics)
    for name in ("resize_size", "crop_size"):
        if name in options:
            raise InvalidValueError(f"evaluate takes no {name}: each backbone prepares the images as its metric does")
    needed = list(dict.fromkeys(_BACKBONE_OF[name] for name in names))
    makers = _builders(fid_mode, dinov2_model, weights or {}, device)
    built: dict[str, tuple[FeatureExtractor, str, str | None]] = {}

    def backbone(name: str) -> tuple[FeatureExtractor, str, str | None]:
        if name not in built:
            built[name] = makers[name]()
        return built[name]

    keep = _EVERY_VECTOR if _NEED_VECTORS & set(names) else 0
    real_stats = _side(real, "real", needed, backbone, keep, options)
    fake_stats = _side(fake, "fake", needed, backbone, keep, options)
    numbers: dict[str, Any] = {}
    for name in names:
        a, b = real_stats[_BACKBONE_OF[name]], fake_stats[_BACKBONE_OF[name]]
        if name in ("fid", "fd_dinov2"):
            numbers[name] = frechet_distance(a, b)
        elif name == "kid":
            numbers[name] = kernel_inception_distance(a, b, subset_size=kid_subset_size)
        elif name == "prdc":
            numbers[name] = precision_recall(a, b, k=prdc_k)
        elif name == "cmmd":
            a.check_matches(b)
            numbers[name] = cmmd_of_embeddings(_every_vector(a, "real", name), _every_vector(b, "fake", name))
        else:
            weight = fid_network(backbone("inception")[0]).fc.weight
            numbers[name] = inception_score_of_features(_every_vector(b, "fake", name), weight, is_splits)
    return Evaluation(numbers, real_stats, fake_stats)


def _every_vector(stats: FeatureStatistics, what: str, metric: str) -> Tensor:
    """The vectors ``stats`` kept, refused unless it kept every one (``metric`` is a function of them all)."""
    kept = stats.features
    if kept.shape[0] < stats.count:
        raise InvalidValueError(
            f"{metric} needs every vector of {what}, whose statistics kept {kept.shape[0]} of {stats.count}; "
            "pass the images, or statistics of an evaluate that asked for it"
        )
    return kept
