"""Statistics collected from images (streamed through a ``FeatureExtractor``) and from a finished dump.

``feature_statistics`` streams images through a ``FeatureExtractor`` with the input pipeline dumps use
(``featurehooks._stream``: listing, decoding, resize and crop, DataLoader workers, pooling, torchrun ranks) and
writes no feature file; ``feature_statistics_by_layer`` does it for several layers in one pass, and
``fid_statistics`` with pytorch-fid's preprocessing: each builds one ``PassSettings`` of the keywords they share and
forwards it to ``collect``. ``statistics_from_dump`` reads the pooled features of a finished dump in memory-mapped
chunks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._layout import Pool
from .._stream import Inputs, Progress, SourceSpec, check_options, extract_batches, resolve_inputs
from .._stream.sharding import Distributed, split_contiguous
from ..dump import DumpResult, read_manifest
from ..errors import InputNotFoundError, InvalidValueError, LayerNotFoundError, RunFailedError, did_you_mean
from .statistics import FeatureOrigin, FeatureStatistics, check_count

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from ..images import ImageTransform

__all__ = ["feature_statistics", "feature_statistics_by_layer", "statistics_from_dump"]

_NAMED_SKIPS = 3  # unreadable inputs named in the warning; the rest are counted
_DUMP_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class PassSettings:
    """How images stream into statistics: the keywords the collection functions share, in their order, checked
    when built (before any image is read)."""

    pool: Pool | None
    batch_size: int
    num_workers: int | None
    resize_size: int | None | str
    crop_size: int | None | str
    keep: int
    seed: int
    progress: bool

    def __post_init__(self) -> None:
        check_options(self.batch_size, self.num_workers, self.pool, "float32")
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
    return {
        layer: FeatureOrigin(
            extractor.backbone_name, layer, pool, extractor.weights, digest, preprocessing, extractor.precision
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


def _accumulate(
    stats: dict[str, FeatureStatistics],
    extractor: FeatureExtractor,
    inputs: Inputs,
    batches: list[list[int]],
    settings: PassSettings,
    rank: int,
) -> list[tuple[str, str]]:
    """Add the pooled features of ``batches`` (this rank's share of the rows) to ``stats``; the rows skipped."""
    skipped: list[tuple[str, str]] = []
    label = "statistics" if rank == 0 else f"statistics rank {rank}"
    with Progress(sum(map(len, batches)), settings.progress, label=label, rank=rank) as bar:
        found = extract_batches(
            extractor,
            inputs,
            batches,
            pool=settings.pool,
            dtype="float32",
            num_workers=settings.num_workers,
            progress=bar,
        )
        for batch in found:
            skipped.extend((inputs.names[row], reason) for row, reason in batch.skipped)
            for name, into in stats.items():
                vectors = batch.arrays[name]
                if vectors.ndim != 2:
                    raise InvalidValueError(
                        f"layer {name!r} returns features of shape {(len(batch.rows), *vectors.shape[1:])}, not "
                        "vectors; pool them (pool='avg', 'max' or 'cls')"
                    )
                into.update(vectors[batch.valid])
    return skipped


def _on_ranks(
    stats: dict[str, FeatureStatistics],
    extractor: FeatureExtractor,
    inputs: Inputs,
    batches: list[list[int]],
    settings: PassSettings,
) -> tuple[dict[str, FeatureStatistics], list[tuple[str, str]], bool]:
    """``_accumulate`` of each torchrun rank's run of ``batches``, merged in rank order (one rank: this one's);
    the rows skipped, and whether this is the main rank."""
    ranks = Distributed.from_environment(extractor.device)
    try:
        try:
            mine = split_contiguous(batches, ranks.world_size, ranks.rank)
            skipped = _accumulate(stats, extractor, inputs, mine, settings, ranks.rank)
        except Exception as exc:
            if ranks.world_size > 1:  # the other ranks wait for this one's share: tell them why it is missing
                ranks.all_gather(f"{type(exc).__name__}: {exc}")
            raise
        shares = ranks.all_gather((stats, skipped))  # in rank order: rank r holds the r-th run of rows
    finally:
        ranks.close()
    failed = [f"rank {rank}: {share}" for rank, share in enumerate(shares) if isinstance(share, str)]
    if failed:
        raise RunFailedError(f"the statistics failed on {'; '.join(failed)}")
    stats, skipped = shares[0]
    for other, other_skipped in shares[1:]:
        for name in stats:
            stats[name].merge(other[name])
        skipped.extend(other_skipped)
    return stats, skipped, ranks.is_main


def collect(
    extractor: FeatureExtractor, source: SourceSpec, layers: Sequence[str] | None, settings: PassSettings
) -> dict[str, FeatureStatistics]:
    """``{layer: FeatureStatistics}`` of ``layers`` (``None``: every output) over ``source``: what the public
    collection functions forward to."""
    available = _output_names(extractor)
    wanted = list(available if layers is None else ([layers] if isinstance(layers, str) else layers))
    if not wanted:
        raise InvalidValueError("no layers given")
    for name in wanted:
        if name not in available:
            raise LayerNotFoundError(
                f"the extractor returns no layer {name!r} (it returns {available}); {did_you_mean(name, available)}"
            )
    inputs = resolve_inputs(extractor, source, settings.resize_size, settings.crop_size, settings.pool)
    origins = _origins(extractor, wanted, settings.pool, inputs.transform)
    stats = {name: FeatureStatistics(keep=settings.keep, seed=settings.seed, origin=origins[name]) for name in wanted}
    total, size = len(inputs.names), settings.batch_size
    batches = [list(range(start, min(start + size, total))) for start in range(0, total, size)]
    stats, skipped, is_main = _on_ranks(stats, extractor, inputs, batches, settings)
    if is_main:
        _warn_skipped(skipped, total)
    return stats


def feature_statistics_by_layer(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layers: Sequence[str] | None = None,
    pool: Pool | None = "avg",
    batch_size: int = 64,
    num_workers: int | None = None,
    resize_size: int | None | str = "weights",
    crop_size: int | None | str = "weights",
    keep: int = 0,
    seed: int = 0,
    progress: bool = False,
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
    settings = PassSettings(pool, batch_size, num_workers, resize_size, crop_size, keep, seed, progress)
    return collect(extractor, source, layers, settings)


def feature_statistics(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layer: str | None = None,
    pool: Pool | None = "avg",
    batch_size: int = 64,
    num_workers: int | None = None,
    resize_size: int | None | str = "weights",
    crop_size: int | None | str = "weights",
    keep: int = 0,
    seed: int = 0,
    progress: bool = False,
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
        batch_size: images per forward.
        num_workers: DataLoader processes that decode while the model runs (default: up to 4).
        resize_size: shorter-side resize; ``"weights"`` for the weights' own, ``None`` for none.
        crop_size: center crop; ``"weights"`` for the weights' own, ``None`` for none.
        keep: keep a uniform random sample of at most this many vectors (for the kernel inception distance).
        seed: seed of that sample.
        progress: show a tqdm bar on stderr.

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
    if layer is None:
        names = _output_names(extractor)
        if len(names) != 1:
            raise InvalidValueError(f"the extractor returns {len(names)} outputs {names}: pass layer=<one of them>")
        layer = names[0]
    settings = PassSettings(pool, batch_size, num_workers, resize_size, crop_size, keep, seed, progress)
    return collect(extractor, source, [layer], settings)[layer]


# -- from a dump ---------------------------------------------------------------------------------------
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
    if isinstance(dump, DumpResult):
        result = dump
    else:
        manifest = read_manifest(dump)
        if manifest is None:
            raise InputNotFoundError(f"no featurehooks dump (manifest.json) in {os.fspath(dump)}")
        result = DumpResult(Path(dump), manifest)
    manifest = result.manifest
    if manifest.get("status") != "complete":
        raise InvalidValueError(
            f"the dump in {result.out_dir} is unfinished (status {manifest.get('status')!r}); finish it with "
            "dump_features(..., resume=True) first"
        )
    files = manifest["files"]
    if layer not in files:
        raise LayerNotFoundError(f"the dump in {result.out_dir} has no layer {layer!r}; {did_you_mean(layer, files)}")
    array = result.load(layer)
    if array.ndim != 2:
        raise InvalidValueError(
            f"layer {layer!r} of the dump in {result.out_dir} holds features of shape {array.shape}, not vectors; "
            "dump it with pool='avg' (or 'max', 'cls')"
        )
    invalid = np.zeros(array.shape[0], dtype=bool)
    invalid[[int(entry["row"]) for entry in manifest.get("skipped", [])]] = True
    preprocessing = _preprocessing(manifest.get("preprocessing", {}))
    origin = FeatureOrigin(
        backbone=manifest["backbone"],
        layer=layer,
        pool=manifest.get("pool"),
        weights=manifest.get("weights"),
        weights_sha256=manifest.get("weights_sha256"),
        preprocessing=preprocessing,
        precision=manifest.get("precision", "float32"),  # written only when not float32
    )
    stats = FeatureStatistics(array.shape[1], keep=keep, seed=seed, origin=origin)
    for start in range(0, array.shape[0], chunk_rows):
        stop = min(start + chunk_rows, array.shape[0])
        stats.update(np.asarray(array[start:stop][~invalid[start:stop]]))
    return stats
