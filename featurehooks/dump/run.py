"""``dump_features``: stream the features of an image collection into per-layer ``.npy`` files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import closing
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import Unpack

from .._layout import as_pool
from .._precision import check_device
from .._stream import (
    Inputs,
    Progress,
    SourceSpec,
    Streaming,
    StreamOptions,
    dtype_name,
    extract_batches,
    planned_on_main,
    resolve_inputs,
    worker_deaths,
)
from .._stream.sharding import Distributed, chunk_rows, shard_of, split_contiguous
from ..errors import InvalidValueError
from .manifest import LABELS, Manifest
from .plan import Plan, describe_settings, finish_dump, plan_dump
from .store import DumpStore

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["DumpResult", "dump_features"]


@dataclass(frozen=True)
class DumpResult:
    """What a dump wrote: ``out_dir``, its ``manifest`` (a ``Manifest``, as saved), how many rows this call
    computed (0 when ``resume`` found the dump already complete), and helpers to read it back.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> images, out = torch.rand(2, 3, 8, 8), tempfile.mkdtemp()
        >>> result = dump_features(ext, images, out, progress=False)
        >>> result.num_rows, result.rows_computed, result.skipped, result.path("0").name
        (2, 2, [], '0.npy')
        >>> dump_features(ext, images, out, resume=True, progress=False).rows_computed  # already complete
        0
        >>> result.manifest.settings.layers, result.manifest.num_valid
        (('0',), 2)
    """

    out_dir: Path
    manifest: Manifest
    rows_computed: int = 0

    @property
    def num_rows(self) -> int:
        return self.manifest.num_rows

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Invalid rows (zero-filled): ``{"row", "path", "reason"}`` each."""
        return [asdict(row) for row in self.manifest.skipped or ()]

    def path(self, layer: str) -> Path:
        return self.out_dir / self.manifest.files[layer]

    def load(self, layer: str, mmap: bool = True) -> np.ndarray:
        """The array of ``layer`` (memory-mapped read-only by default)."""
        return np.load(self.path(layer), mmap_mode="r" if mmap else None)

    def labels(self) -> np.ndarray:
        """``(N,)`` int64 labels of an ``(image, label)`` dataset (-1 where a row has none).

        Raises:
            FileNotFoundError: the dump's source carried no integer labels.
        """
        if not self.manifest.settings.inputs.labelled:
            raise FileNotFoundError(f"the dump in {self.out_dir} has no labels: its source items had none")
        return np.load(self.out_dir / LABELS)


def dump_features(
    extractor: FeatureExtractor,
    source: SourceSpec,
    out_dir: str | os.PathLike[str],
    *,
    pool: str | None = None,
    dtype: str = "float32",
    resume: bool = False,
    overwrite: bool = False,
    **options: Unpack[StreamOptions],
) -> DumpResult:
    """Extract features of every input and write one ``<layer>.npy`` (rows × feature shape) per layer.

    Streams: memory is bounded by the batch, not the dataset. Rows are written in place through
    ``numpy.lib.format.open_memmap`` and committed chunk by chunk, so an interrupted run (Ctrl-C,
    ``kill -9``) finished with ``resume=True`` gives files identical to an uninterrupted one.
    Under ``torchrun`` (``WORLD_SIZE > 1``) rank 0 lists the inputs for every rank, every rank takes a
    contiguous share of the rows, and the result is identical to a single-process run; on several nodes
    ``out_dir`` must be on a shared filesystem. Without one, jobs that share nothing each dump one shard
    (``shard=(i, n)``: a dump of its rows only, whose manifest names the shard and its input set) and
    ``merge_dumps`` joins the parts into the dump one run writes, byte for byte.

    ``out_dir`` receives ``<layer>.npy`` per layer, ``index.csv`` (``row,valid,path``), and
    ``manifest.json`` (backbone, weights and their SHA-256, layers, shapes, dtype, precision, pool, preprocessing,
    library versions, status, skipped inputs with reasons). An input that cannot be decoded keeps its row,
    zero-filled, with ``valid=0`` in ``index.csv`` and an entry under ``"skipped"``; grayscale,
    palette, RGBA (on white), CMYK and 16-bit images are converted.

    Args:
        extractor: a ``FeatureExtractor`` (its ``preprocessing``, ``input_range``, device and ``precision`` are
            used: ``precision="bf16"`` computes in bfloat16, the arrays are stored in ``dtype`` all the same).
        source: a folder (searched recursively), a glob, an image path, a list of these, a
            ``torch.utils.data.Dataset`` of image tensors ``(C, H, W)`` (or tuples starting with one)
            already prepared: floats in the extractor's ``input_range``, or ``uint8`` 0..255 pixels; or a
            ``GeneratedImages``: a generator's batches, drawn as they are dumped (one that raises leaves the batches
            before committed; ``resume=True`` with a seeded generator finishes the dump as one run writes it).
        out_dir: output folder (created if needed).
        pool: ``"avg"`` or ``"max"`` over each layer's positions (spatial axes, or patch tokens: never
            class/register tokens), ``"cls"`` for the class token of token layers, or ``None`` to keep maps.
        dtype: ``"float32"`` or ``"float16"`` on disk.
        resume: finish an unfinished dump in ``out_dir`` (with the same settings and inputs).
        overwrite: replace whatever dump ``out_dir`` holds.
        **options: the ``StreamOptions`` (``batch_size``, also the unit of commit and resume; ``num_workers``;
            ``batch_pixels``, which may cut a batch's forward, not its commit; ``resize_size`` and ``crop_size``
            of image files; ``progress``; ``shard``).

    Returns:
        A ``DumpResult`` with the output folder and the manifest.

    Raises:
        FileExistsError: ``out_dir`` holds a dump and neither ``resume`` nor ``overwrite`` was given.
        ValueError: bad options, or a resume whose settings differ from the earlier run.
        FileNotFoundError: a folder, file or glob of ``source`` finds nothing.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> images = torch.rand(8, 3, 64, 64)  # or a folder, a glob, a list of files, a Dataset
        >>> result = dump_features(ext, images, tempfile.mkdtemp(), pool="avg")
        >>> result.load("layer4").shape
        (8, 512)
    """
    streaming = Streaming.of(options)
    check_device(extractor.precision, extractor.device)  # before any file is listed (a forward would refuse it)
    dtype = dtype_name(dtype)
    pooling = as_pool(pool)
    if resume and overwrite:
        raise InvalidValueError(
            "pass either resume=True (finish an unfinished dump) or overwrite=True (start over), not both"
        )
    dist = Distributed.from_environment(extractor.device)
    store = DumpStore(out_dir)
    try:
        dist.agree(streaming.shard, "shards: every rank takes the one --shard I/N, which the ranks split")

        def plan() -> tuple[Plan, Inputs]:
            every = resolve_inputs(extractor, source, streaming.resize_size, streaming.crop_size, pooling)
            inputs, shard = shard_of(every, streaming.shard, streaming.batch_size)
            settings = describe_settings(extractor, inputs, pooling, dtype, shard)
            store.lock()  # one dump per folder: rank 0 holds it for every rank
            return plan_dump(store, settings, inputs, streaming.batch_size, resume, overwrite), every

        planned, every = planned_on_main(dist, source, plan)
        inputs, _ = shard_of(every, streaming.shard, streaming.batch_size)  # every rank: the rows of the shard
        manifest = planned.manifest
        if manifest.status == "complete":
            return DumpResult(store.root, manifest)
        mine = split_contiguous(planned.pending, dist.world_size, dist.rank)
        dist.each(
            partial(_compute, extractor, inputs, store, mine, manifest, dist, streaming),
            f"while dumping to {store.root}",
            "what was committed is kept: rerun with resume=True (--resume) to finish",
        )
        final = finish_dump(store, manifest, inputs.names) if dist.is_main else None
        final = dist.broadcast(final)
        dist.barrier()
        num_rows = len(inputs.names)
        computed = sum(min(planned.chunk_size, num_rows - chunk * planned.chunk_size) for chunk in planned.pending)
        return DumpResult(store.root, final, computed)
    finally:
        store.close_journal()
        store.close_arrays()
        store.unlock()
        dist.close()


def _compute(
    extractor: FeatureExtractor,
    inputs: Inputs,
    store: DumpStore,
    chunks: Sequence[int],
    manifest: Manifest,
    dist: Distributed,
    streaming: Streaming,
) -> None:
    """Write this rank's chunks, committing each once all its rows are written (a chunk the pixel budget cut comes
    back in several pieces)."""
    batches = [list(range(*chunk_rows(c, manifest.chunk_size, len(inputs.names)))) for c in chunks]
    store.open_arrays(manifest.settings.layers)
    store.open_journal(dist.rank)
    if batches:
        settings = manifest.settings
        name = "extract" if dist.world_size == 1 else f"extract rank {dist.rank}"
        pending = iter(zip(chunks, batches))
        chunk, rows = next(pending)
        skipped: list[tuple[int, str]] = []
        with worker_deaths(), Progress(sum(map(len, batches)), streaming.progress, label=name, rank=dist.rank) as bar:
            found = extract_batches(
                extractor, inputs, batches, pool=settings.pool, dtype=settings.dtype, streaming=streaming, progress=bar
            )
            with closing(found):
                for piece in found:
                    store.write_rows(piece.rows[0], piece.arrays)
                    if inputs.labelled:
                        store.write_labels(piece.rows[0], [-1 if label is None else label for label in piece.labels])
                    skipped.extend(piece.skipped)
                    if piece.rows[-1] == rows[-1]:
                        store.commit(chunk, rows[0], rows[-1] + 1, skipped)
                        chunk, rows = next(pending, (chunk, rows))
                        skipped = []
    store.close_journal()
    store.close_arrays()
