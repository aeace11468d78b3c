"""Statistics collected from images (streamed through a ``FeatureExtractor``) and from a finished dump.

``feature_statistics`` streams images through a ``FeatureExtractor`` with the input pipeline dumps use
(``featurehooks._stream``: listing, decoding, resize and crop, DataLoader workers, pooling, torchrun ranks) and
writes no feature file; ``feature_statistics_by_layer`` does it for several layers in one pass, and
``fid_statistics`` with pytorch-fid's preprocessing: each builds one ``PassSettings`` (the pool, the kept sample
and the ``StreamOptions``) and forwards it to ``collect``. With ``shard=(i, n)`` (a job of a job array) ``collect``
takes the rows of that shard only and records it on the statistics (``FeatureStatistics.shard``), which
``merge_statistics`` joins. ``statistics_from_dump`` reads the pooled features of a finished dump in memory-mapped
chunks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import Unpack

from .._layout import Pool, as_pool
from .._precision import check_device
from .._stream import (
    Inputs,
    Progress,
    SourceSpec,
    Streaming,
    StreamOptions,
    extract_batches,
    planned_on_main,
    resolve_inputs,
    worker_deaths,
)
from .._stream.sharding import Distributed, shard_of, split_contiguous
from ..backbones.fid_inception import FIDInceptionV3
from ..dump import DumpResult, read_manifest
from ..errors import InputNotFoundError, InvalidValueError, LayerNotFoundError, did_you_mean
from .statistics import FeatureOrigin, FeatureStatistics, check_count

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from ..images import ImageTransform

__all__ = ["feature_statistics", "feature_statistics_by_layer", "statistics_from_dump"]

_NAMED_SKIPS = 3  # unreadable inputs named in the warning; the rest are counted
_DUMP_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class PassSettings:
    """How images stream into statistics: the pool, the sample kept for KID and the ``StreamOptions``,
    checked when built (before any image is read)."""

    pool: Pool | None
    keep: int
    seed: int
    streaming: Streaming
    keep_layers: frozenset[str] | None = None  # the layers whose vectors ``keep`` keeps (None: every layer)

    @classmethod
    def of(cls, pool: Pool | None, keep: int, seed: int, options: Mapping[str, object]) -> PassSettings:
        return cls(as_pool(pool), keep, seed, Streaming.of(options))

    def keep_of(self, layer: str) -> int:
        """How many vectors of ``layer`` the statistics keep."""
        return self.keep if self.keep_layers is None or layer in self.keep_layers else 0

    def __post_init__(self) -> None:
        check_count(self.keep, "keep")
        check_count(self.seed, "seed")


# -- from images ---------------------------------------------------------------------------------------
def _output_names(extractor: FeatureExtractor) -> list[str]:
    """The names an extractor returns (its ``.prefix`` outputs too, when the layouts are known)."""
    try:
        return list(extractor.output_layouts)
    except RuntimeError:  # a model that cannot be traced: its requested names
        return list(extractor.layers)


def _preprocessing(described: Mapping[str, Any]) -> dict[str, Any]:
    """What an origin records of the image transform that ``described`` describes (a dump's manifest too)."""
    return {key: described.get(key) for key in ("resize_size", "crop_size", "interpolation")}


def _origins(
    extractor: FeatureExtractor, layers: list[str], pool: str | None, transform: ImageTransform | None
) -> dict[str, FeatureOrigin]:
    digest = extractor.weights_sha256()  # hashed once for all layers
    preprocessing = _preprocessing(transform.describe() if transform is not None else {})
    network = extractor.backbone
    lineage = network.lineage if isinstance(network, FIDInceptionV3) else None  # the FID Inception's resize
    return {
        layer: FeatureOrigin(
            extractor.backbone_name, layer, pool, extractor.weights, digest, preprocessing, extractor.precision, lineage
        )
        for layer in layers
    }


def _warn_skipped(skipped: list[tuple[str, str]], total: int) -> None:
    if not skipped:
        return
    named = "; ".join(f"{path}: {reason}" for path, reason in skipped[:_NAMED_SKIPS])
    more = f" and {len(skipped) - _NAMED_SKIPS} more" if len(skipped) > _NAMED_SKIPS else ""
    warnings.warn(  # at the call of the public function that called ``collect``
        f"{len(skipped)} of {total} inputs could not be read and are left out of the statistics ({named}{more})",
        stacklevel=4,
    )


def _set_name(source: SourceSpec) -> str | None:
    """What a progress bar calls a set of images (two sets run one after the other for FID): the name of its
    folder, glob or file (the first of a list); ``None`` for a tensor or dataset."""
    items = source if isinstance(source, (list, tuple)) else [source]
    if not items or not isinstance(items[0], (str, os.PathLike)):
        return None
    first = os.fspath(items[0])
    name = os.path.basename(os.path.normpath(first)) or first
    return name if len(items) == 1 else f"{name} and {len(items) - 1} more"


def _accumulate(
    stats: dict[str, FeatureStatistics],
    extractor: FeatureExtractor,
    inputs: Inputs,
    batches: list[list[int]],
    settings: PassSettings,
    rank: int,
    set_name: str | None,
) -> list[tuple[str, str]]:
    """Add the pooled features of ``batches`` (this rank's share of the rows of the set ``set_name``) to
    ``stats``; the rows skipped."""
    skipped: list[tuple[str, str]] = []
    label = "statistics" + (f" of {set_name}" if set_name else "") + (f", rank {rank}" if rank else "")
    streaming = settings.streaming
    with worker_deaths(), Progress(sum(map(len, batches)), streaming.progress, label=label, rank=rank) as bar:
        found = extract_batches(
            extractor, inputs, batches, pool=settings.pool, dtype="float32", streaming=streaming, progress=bar
        )
        with closing(found):
            for batch in found:
                skipped.extend((inputs.names[row], reason) for row, reason in batch.skipped)
                for name, into in stats.items():
                    vectors = batch.arrays[name]
                    if vectors.ndim != 2:
                        raise InvalidValueError(
                            f"layer {name!r} returns features of shape {(len(batch.rows), *vectors.shape[1:])}, "
                            "not vectors; pool them (pool='avg', 'max' or 'cls')"
                        )
                    into.update(vectors[batch.valid])
    return skipped


def _merged(
    shares: list[tuple[dict[str, FeatureStatistics], list[tuple[str, str]]]],
) -> tuple[dict[str, FeatureStatistics], list[tuple[str, str]]]:
    """The statistics and skipped rows of every rank's share, merged in rank order (rank r holds the r-th run)."""
    stats, skipped = shares[0]
    for other, other_skipped in shares[1:]:
        for name in stats:
            stats[name].merge(other[name])
        skipped.extend(other_skipped)
    return stats, skipped


def collect(
    extractor: FeatureExtractor, source: SourceSpec, layers: Sequence[str] | None, settings: PassSettings
) -> dict[str, FeatureStatistics]:
    """``{layer: FeatureStatistics}`` of ``layers`` (``None``: every output) over ``source`` (the rows of the
    streaming options' ``shard`` only, which each statistics records): what the public collection functions
    forward to."""
    available = _output_names(extractor)
    wanted = list(available if layers is None else ([layers] if isinstance(layers, str) else layers))
    if not wanted:
        raise InvalidValueError("no layers given")
    for name in wanted:
        if name not in available:
            raise LayerNotFoundError(
                f"the extractor returns no layer {name!r} (it returns {available}); {did_you_mean(name, available)}"
            )
    check_device(extractor.precision, extractor.device)  # before any file is listed (a forward would refuse it)
    streaming = settings.streaming

    def resolve() -> tuple[None, Inputs]:
        return None, resolve_inputs(extractor, source, streaming.resize_size, streaming.crop_size, settings.pool)

    ranks = Distributed.from_environment(extractor.device)
    try:
        ranks.agree(streaming.shard, "shards: every rank takes the one --shard I/N, which the ranks split")
        _, every = planned_on_main(ranks, source, resolve)
        inputs, shard = shard_of(every, streaming.shard, streaming.batch_size)
        origins = _origins(extractor, wanted, settings.pool, inputs.transform)
        stats = {
            name: FeatureStatistics(keep=settings.keep_of(name), seed=settings.seed, origin=origin)
            for name, origin in origins.items()
        }
        total, size = len(inputs.names), streaming.batch_size
        batches = [list(range(start, min(start + size, total))) for start in range(0, total, size)]
        mine = split_contiguous(batches, ranks.world_size, ranks.rank)
        shares = ranks.each(
            lambda: (stats, _accumulate(stats, extractor, inputs, mine, settings, ranks.rank, _set_name(source))),
            "computing the statistics",
        )
    finally:
        ranks.close()
    stats, skipped = _merged(shares)
    for one in stats.values():
        one.shard = shard
    if ranks.is_main:
        _warn_skipped(skipped, total)
    return stats


def feature_statistics_by_layer(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layers: Sequence[str] | None = None,
    pool: Pool | None = "avg",
    keep: int = 0,
    seed: int = 0,
    **options: Unpack[StreamOptions],
) -> dict[str, FeatureStatistics]:
    """``feature_statistics`` of several layers of one extractor in one pass over the images.

    Args are those of ``feature_statistics``; ``layers`` (default: every output of the extractor)
    replaces ``layer``.

    Returns:
        ``{layer: FeatureStatistics}`` in the order of ``layers``.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics_by_layer
        >>> ext = FeatureExtractor("resnet18", ["layer3", "layer4"], weights=None)
        >>> images = torch.rand(8, 3, 64, 64)  # or a folder, a glob, a list of files, a Dataset
        >>> {name: stats.dim for name, stats in feature_statistics_by_layer(ext, images).items()}
        {'layer3': 256, 'layer4': 512}
    """
    return collect(extractor, source, layers, PassSettings.of(pool, keep, seed, options))


def feature_statistics(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layer: str | None = None,
    pool: Pool | None = "avg",
    keep: int = 0,
    seed: int = 0,
    **options: Unpack[StreamOptions],
) -> FeatureStatistics:
    """Statistics of one layer's pooled features over an image collection; no feature file is written.

    Images are listed, decoded, resized, cropped and batched exactly as ``dump_features`` does (the
    same functions, DataLoader workers included), each batch's output is pooled to vectors with the
    extractor's ``output_layouts`` and added to a ``FeatureStatistics``, so memory does not grow with
    the number of images. Inputs that cannot be decoded are left out, with a warning naming them.

    Args:
        extractor: a ``FeatureExtractor``.
        source: a folder (searched recursively), a glob, an image path, a list of these, a
            ``Dataset`` of prepared image tensors or an ``(N, C, H, W)`` tensor (as for ``dump_features``).
        layer: the output to summarize; ``None`` for an extractor with a single output.
        pool: ``"avg"`` or ``"max"`` over positions (spatial, or patch tokens), ``"cls"`` for the
            class token, or ``None`` for outputs that already are ``(B, C)`` vectors.
        keep: keep a uniform random sample of at most this many vectors (for the kernel inception distance).
        seed: seed of that sample.
        **options: the ``StreamOptions`` (``batch_size``, ``num_workers``, ``batch_pixels``, ``resize_size``,
            ``crop_size``, ``progress``; ``shard=(i, n)``: statistics of shard ``i`` of ``n`` only, a part that
            ``merge_statistics`` joins with the others into the statistics of the whole set).

    Shape:
        the statistics are of ``(N, C)`` vectors: ``C`` the layer's channels, ``N`` the readable inputs.

    Raises:
        LayerNotFoundError: ``layer`` is not an output of the extractor.
        InvalidValueError: bad options, or ``pool=None`` for a layer that returns maps or tokens.
        InputNotFoundError: ``source`` finds no inputs.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> images = torch.rand(8, 3, 64, 64)  # or a folder, a glob, a list of files, a Dataset
        >>> stats = feature_statistics(ext, images, keep=1000)
        >>> stats.count, tuple(stats.covariance.shape)
        (8, (512, 512))

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017). GANs Trained by a Two Time-Scale
        Update Rule Converge to a Local Nash Equilibrium. NeurIPS.
    """
    settings = PassSettings.of(pool, keep, seed, options)
    if layer is None:
        names = _output_names(extractor)
        if len(names) != 1:
            raise InvalidValueError(f"the extractor returns {len(names)} outputs {names}: pass layer=<one of them>")
        layer = names[0]
    return collect(extractor, source, [layer], settings)[layer]


# -- from a dump ---------------------------------------------------------------------------------------
def finished_dump(dump: str | os.PathLike[str] | DumpResult, name: str = "the dump") -> DumpResult:
    """The finished dump ``dump`` (a folder or a ``DumpResult``), refused when there is none or it is unfinished;
    messages call it ``name``."""
    if isinstance(dump, DumpResult):
        result = dump
    else:
        manifest = read_manifest(dump)
        if manifest is None:
            raise InputNotFoundError(f"{name}: no featurehooks dump (manifest.json) in {os.fspath(dump)}")
        result = DumpResult(Path(dump), manifest)
    if result.manifest.status != "complete":
        raise InvalidValueError(
            f"{name} in {result.out_dir} is unfinished (status {result.manifest.status!r}); finish it with "
            "dump_features(..., resume=True) first"
        )
    return result


def statistics_from_dump(
    dump: str | os.PathLike[str] | DumpResult,
    layer: str,
    *,
    keep: int = 0,
    seed: int = 0,
    chunk_rows: int = _DUMP_CHUNK_ROWS,
) -> FeatureStatistics:
    """Statistics of one layer of a finished dump of pooled features, read in memory-mapped chunks.

    Rows the dump marked invalid (inputs that could not be decoded, zero-filled) are left out.
    The origin (backbone, weights, pool, preprocessing) comes from the dump's manifest, so these
    statistics compare with ``feature_statistics`` of the same extractor, layer and pool.

    Args:
        dump: the dump's folder, or the ``DumpResult`` that ``dump_features`` returned.
        layer: the layer to summarize.
        keep: keep a uniform random sample of at most this many vectors.
        seed: seed of that sample.
        chunk_rows: rows read per chunk (bounds the memory, not the result).

    Shape:
        the layer's array must be ``(N, C)`` (dumped with ``pool=``, or a layer of vectors).

    Raises:
        InputNotFoundError: no dump in the folder.
        LayerNotFoundError: the dump has no such layer.
        InvalidValueError: the dump is unfinished, or the layer holds maps or tokens rather than vectors.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> from featurehooks.metrics import statistics_from_dump
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> out = tempfile.mkdtemp()
        >>> _ = dump_features(ext, torch.rand(8, 3, 64, 64), out, pool="avg", progress=False)
        >>> stats = statistics_from_dump(out, "layer4")
        >>> stats.count, stats.dim
        (8, 512)
    """
    check_count(chunk_rows, "chunk_rows", least=1)
    result = finished_dump(dump)
    manifest = result.manifest
    files = manifest.files
    if layer not in files:
        raise LayerNotFoundError(f"the dump in {result.out_dir} has no layer {layer!r}; {did_you_mean(layer, files)}")
    array = result.load(layer)
    if array.ndim != 2:
        raise InvalidValueError(
            f"layer {layer!r} of the dump in {result.out_dir} holds features of shape {array.shape}, not vectors; "
            "dump it with pool='avg' (or 'max', 'cls')"
        )
    invalid = np.zeros(array.shape[0], dtype=bool)
    invalid[[skipped.row for skipped in manifest.skipped or ()]] = True
    settings = manifest.settings
    digest = settings.weights_sha256
    origin = FeatureOrigin(
        backbone=settings.backbone,
        layer=layer,
        pool=settings.pool,
        weights=settings.weights,
        weights_sha256=digest if isinstance(digest, str) else None,  # None: not recorded, or not hashable
        preprocessing=_preprocessing(settings.preprocessing),
        precision=settings.precision,
    )
    stats = FeatureStatistics(array.shape[1], keep=keep, seed=seed, origin=origin)
    for start in range(0, array.shape[0], chunk_rows):
        stop = min(start + chunk_rows, array.shape[0])
        stats.update(np.asarray(array[start:stop][~invalid[start:stop]]))
    return stats
