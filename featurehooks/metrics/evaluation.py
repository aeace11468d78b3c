"""``evaluate``: the generative-evaluation numbers of two image sets from one decode of each image.

Each metric needs the vectors of one backbone: FID, KID, PRDC and the Inception Score the FID Inception's pool
features (in the asked FID lineage), sFID that network's spatial features (the same forward), FD_DINOv2 DINOv2
ViT-L/14's class token, CMMD CLIP ViT-L/14@336's image embedding. Every image is read and decoded once, by the
input pipeline's workers, at its own size; each backbone then prepares it as its single-metric function would
(``_one_pass``) and embeds it. One pass per set gives a ``FeatureStatistics`` of each kind of vector, with every
vector kept where a metric needs vectors, and the numbers come from those; the statistics of a set serve as its
reference in later calls. A reference set too large for one job is computed in parts (``shard=(i, n)``, one job
each) that ``merge_statistics_sets`` joins into the statistics one process computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import Unpack

from .._stream import SourceSpec, StreamOptions
from ..errors import InvalidTypeError, InvalidValueError, did_you_mean
from ._one_pass import Vectors, one_pass
from .clip_mmd import cmmd_extractor, cmmd_of_embeddings
from .dinov2_fd import fd_dinov2_extractor
from .fid import FIDMode, WeightsArg, fid_network, inception_extractor
from .frechet import kernel_inception_distance, named_distance
from .isc import inception_score_of_features
from .prdc import precision_recall
from .sfid import spatial_vectors
from .statistics import KEEP_ALL, FeatureStatistics

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["METRICS", "Evaluation", "evaluate"]

METRICS = ("fid", "fd_dinov2", "cmmd", "is", "kid", "prdc", "sfid")
"""The numbers ``evaluate`` computes, by name.

Examples:
    >>> from featurehooks.metrics import METRICS
    >>> METRICS
    ('fid', 'fd_dinov2', 'cmmd', 'is', 'kid', 'prdc', 'sfid')
"""

_VECTORS_OF = {"fid": "inception", "is": "inception", "kid": "inception", "prdc": "inception"}
_VECTORS_OF |= {"sfid": "inception_spatial", "fd_dinov2": "dinov2", "cmmd": "clip"}
_BACKBONE_OF = {"inception": "inception", "inception_spatial": "inception", "dinov2": "dinov2", "clip": "clip"}
_NEED_VECTORS = frozenset({"cmmd", "is", "kid", "prdc"})


@dataclass(frozen=True)
class Evaluation:
    """What ``evaluate`` found: ``numbers`` by metric name (a float, or ``(mean, std)`` for ``"is"`` and ``"kid"``,
    a ``PRDC`` for ``"prdc"``), and the statistics of each set by kind of vector (``"inception"``: the FID
    Inception's pool features, ``"inception_spatial"``: its sFID features, ``"dinov2"``, ``"clip"``), which a later
    ``evaluate`` takes in place of the images.

    Examples:
        >>> from featurehooks.metrics import Evaluation
        >>> Evaluation(numbers={"fid": 3.2}, real={}, fake={}).numbers["fid"]
        3.2
    """

    numbers: dict[str, Any]
    real: dict[str, FeatureStatistics]
    fake: dict[str, FeatureStatistics]

    def statistics_of(self, metric: str) -> tuple[FeatureStatistics, FeatureStatistics]:
        """The statistics of ``real`` and ``fake`` that the number of ``metric`` comes from (e.g. for ``fd_bootstrap``
        of ``"fid"``, from an ``evaluate(..., keep_vectors=True)``).

        Raises:
            InvalidValueError: ``metric`` is no name of ``METRICS``, or was not asked for.
        """
        (name,) = _check_metrics([metric])
        kind = _VECTORS_OF[name]
        if kind not in self.real:
            held = ", ".join(self.real)
            raise InvalidValueError(f"this evaluation holds no statistics of {metric!r} (it holds {held})")
        return self.real[kind], self.fake[kind]


def _builders(
    mode: FIDMode, dinov2_model: str, weights: Mapping[str, WeightsArg], device: str | torch.device | None
) -> dict[str, Callable[[list[str]], tuple[FeatureExtractor, dict[str, Vectors]]]]:
    """How each backbone is built for the kinds of vector asked of it: the extractor, and each kind's ``Vectors``."""
    inception = {"inception": Vectors("avgpool", "avg"), "inception_spatial": spatial_vectors()}

    def fid_inception(kinds: list[str]) -> tuple[FeatureExtractor, dict[str, Vectors]]:
        vectors = {kind: inception[kind] for kind in kinds}
        layers = list(dict.fromkeys(want.layer for want in vectors.values()))
        return inception_extractor(layers, weights.get("inception", "DEFAULT"), mode, device, {}), vectors

    return {
        "inception": fid_inception,
        "dinov2": lambda _: (
            fd_dinov2_extractor(dinov2_model, weights.get("dinov2", "DEFAULT"), device=device),
            {"dinov2": Vectors("norm", "cls")},
        ),
        "clip": lambda _: (
            cmmd_extractor(weights.get("clip", "DEFAULT"), device=device),
            {"clip": Vectors("visual_projection", None)},
        ),
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


def _side(
    value: SourceSpec | Mapping[str, FeatureStatistics],
    what: str,
    kinds: Sequence[str],
    backbones: Callable[[], Mapping[str, tuple[FeatureExtractor, Mapping[str, Vectors]]]],
    kept: Sequence[str],
    options: StreamOptions,
) -> dict[str, FeatureStatistics]:
    """The statistics of one set: computed in one pass over its images, or taken from an earlier evaluation."""
    if not isinstance(value, Mapping):
        return one_pass(value, backbones(), KEEP_ALL, kept, options)
    missing = [kind for kind in kinds if kind not in value]
    if missing:
        raise InvalidValueError(f"{what} holds no statistics of {', '.join(missing)} (it holds {', '.join(value)})")
    for kind in kinds:
        if not isinstance(value[kind], FeatureStatistics):
            raise InvalidTypeError(f"{what}[{kind!r}] must be FeatureStatistics, not {type(value[kind]).__name__}")
    return {kind: value[kind] for kind in kinds}


def evaluate(
    real: SourceSpec | Mapping[str, FeatureStatistics],
    fake: SourceSpec | Mapping[str, FeatureStatistics] | None,
    metrics: Sequence[str] = METRICS,
    *,
    fid_mode: FIDMode = "legacy_pytorch",
    dinov2_model: str = "vitl14",
    weights: Mapping[str, WeightsArg] | None = None,
    device: str | torch.device | None = None,
    kid_subset_size: int = 1000,
    prdc_k: int = 5,
    is_splits: int = 10,
    keep_vectors: bool = False,
    **options: Unpack[StreamOptions],
) -> Evaluation:
    """``metrics`` between ``real`` and ``fake``, each image decoded once for every backbone they need.

    Each number equals its single-metric function on the same images and weights: ``"fid"`` ``fid_statistics`` in
    the lineage ``fid_mode`` and ``frechet_distance``; ``"kid"`` ``kernel_inception_distance`` and ``"prdc"``
    ``precision_recall`` (``k=prdc_k``, ``real`` as the reference) on those pool features; ``"is"`` the Inception
    Score of ``fake`` (``inception_score_of_features``, ``is_splits`` splits) and ``"sfid"`` ``sfid_statistics`` in
    the lineage ``fid_mode``, from the same forward; ``"fd_dinov2"`` ``fd_dinov2`` (DINOv2 ViT-L/14's class token);
    ``"cmmd"`` ``cmmd`` (CLIP ViT-L/14@336). Every vector of a set is kept where a metric needs vectors (CMMD, IS,
    KID, PRDC: ``N x 2048`` float32 for the Inception, ``N x 768`` for CLIP).

    Args:
        real: the reference images (a folder, glob, file list, dataset or tensor, as ``dump_features`` takes), or
            the ``real`` statistics of an earlier ``Evaluation``.
        fake: the generated images, or statistics as for ``real``; ``None`` computes the statistics of ``real`` only
            (no numbers): a reference set to save (``save_statistics(path, found.real)``) and load later; with
            ``shard=(i, n)``, of shard ``i`` of ``n`` of its images only, each statistics recording its shard: a part
            that ``merge_statistics_sets`` joins with the others into the set's (every vector kept, in row order).
        metrics: names from ``METRICS``.
        fid_mode: the FID lineage of the Inception's features (``FID_MODES``).
        dinov2_model: the DINOv2 of ``"fd_dinov2"`` (``FD_DINOV2_MODELS``; ViT-L/14 is the reference's).
        weights: per backbone (``"inception"``, ``"dinov2"``, ``"clip"``), its ``weights`` argument; the others
            ``"DEFAULT"``.
        device: where the backbones compute; ``None``: CUDA when available, else the CPU.
        kid_subset_size: vectors per KID subset (each set needs at least as many).
        prdc_k: the nearest neighbour of PRDC's radii.
        is_splits: the splits of the Inception Score.
        keep_vectors: keep every vector of every kind, not only those the metrics need (for ``fd_bootstrap`` and
            ``fd_infinity`` of the Fréchet distances: ``statistics_of``).
        **options: the ``StreamOptions`` but ``resize_size`` and ``crop_size`` (each backbone prepares its images);
            ``shard`` only where ``fake`` is ``None`` and ``real`` images (numbers compare two whole sets).

    Raises:
        InvalidValueError: an unknown metric, statistics that lack a backbone or come from other features (or hold a
            shard), a set too small for KID's subsets, ``shard`` with ``fake`` or with statistics as ``real``, or bad
            options.

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
    if options.get("shard") is not None and fake is not None:
        raise InvalidValueError(
            "metrics compare two whole sets: shard= is for evaluate(real, None) (a part of a "
            "reference set, merged with merge_statistics_sets)"
        )
    if options.get("shard") is not None and isinstance(real, Mapping):
        raise InvalidValueError(
            "shard= computes a part of the statistics of real's images, and real is statistics already: pass the images"
        )
    if not isinstance(keep_vectors, bool):
        raise InvalidTypeError(f"keep_vectors must be True or False, got {keep_vectors!r}")
    for name in ("resize_size", "crop_size"):
        if name in options:
            raise InvalidValueError(f"evaluate takes no {name}: each backbone prepares the images as its metric does")
    kinds = list(dict.fromkeys(_VECTORS_OF[name] for name in names))
    asked: dict[str, list[str]] = {}
    for kind in kinds:
        asked.setdefault(_BACKBONE_OF[kind], []).append(kind)
    makers = _builders(fid_mode, dinov2_model, weights or {}, device)
    backbones = functools.cache(lambda: {backbone: makers[backbone](of) for backbone, of in asked.items()})
    kept = kinds if keep_vectors else list(dict.fromkeys(_VECTORS_OF[n] for n in names if n in _NEED_VECTORS))
    real_stats = _side(real, "real", kinds, backbones, kept, options)
    if fake is None:
        return Evaluation({}, real_stats, {})
    fake_stats = _side(fake, "fake", kinds, backbones, kept, options)
    numbers: dict[str, Any] = {}
    for name in names:
        a, b = real_stats[_VECTORS_OF[name]], fake_stats[_VECTORS_OF[name]]
        if name in ("fid", "fd_dinov2", "sfid"):
            numbers[name] = named_distance(a, b, ("real", "fake"))
        elif name == "kid":
            numbers[name] = kernel_inception_distance(a, b, subset_size=kid_subset_size)
        elif name == "prdc":
            numbers[name] = precision_recall(a, b, k=prdc_k)
        elif name == "cmmd":
            a.check_matches(b)
            numbers[name] = cmmd_of_embeddings(_every_vector(a, "real", name), _every_vector(b, "fake", name))
        else:
            weight = fid_network(backbones()["inception"][0]).fc.weight
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
