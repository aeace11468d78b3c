"""``dump_features``: stream the features of an image collection into per-layer ``.npy`` files."""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor
from torch.utils.data import TensorDataset

from .._layout import Pool, as_pool
from .._stream import Inputs, Progress, SourceSpec, check_options, extract_batches, resolve_inputs
from .._stream.sharding import Distributed, chunk_rows, split_contiguous
from ..errors import InvalidValueError, RunFailedError
from .manifest import Manifest
from .plan import Plan, describe_settings, finish_dump, plan_dump
from .store import DumpStore

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from ..images import ImageTransform

__all__ = ["DumpResult", "dump_features"]


@dataclass(frozen=True)
class DumpResult:
    """What a dump wrote: ``out_dir``, its ``manifest`` (as saved), how many rows this call computed
    (0 when ``resume`` found the dump already complete), and helpers to read it back.

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
    """

    out_dir: Path
    manifest: dict[str, Any]
    rows_computed: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Invalid rows (zero-filled): ``{"row", "path", "reason"}`` each."""
        return list(self.manifest["skipped"])

    def path(self, layer: str) -> Path:
        return self.out_dir / self.manifest["files"][layer]

    def load(self, layer: str, mmap: bool = True) -> np.ndarray:
        """The array of ``layer`` (memory-mapped read-only by default)."""
        return np.load(self.path(layer), mmap_mode="r" if mmap else None)

    def labels(self) -> np.ndarray:
        """``(N,)`` int64 labels of an ``(image, label)`` dataset (-1 where a row has none).

        Raises:
            FileNotFoundError: the dump's source carried no integer labels.
        """
        if "labels" not in self.manifest:
            raise FileNotFoundError(f"the dump in {self.out_dir} has no labels: its source items had none")
        return np.load(self.out_dir / self.manifest["labels"])


def dump_features(
    extractor: FeatureExtractor,
    source: SourceSpec,
    out_dir: str | os.PathLike[str],
    *,
    batch_size: int = 64,
    num_workers: int | None = None,
    pool: str | None = None,
    dtype: str = "float32",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    resize_size: int | None | str = "weights",
    crop_size: int | None | str = "weights",
) -> DumpResult:
    """Extract features of every input and write one ``<layer>.npy`` (rows × feature shape) per layer.

    Streams: memory is bounded by the batch, not the dataset. Rows are written in place through
    ``numpy.lib.format.open_memmap`` and committed chunk by chunk, so an interrupted run (Ctrl-C,
    ``kill -9``) finished with ``resume=True`` gives files identical to an uninterrupted one.
    Under ``torchrun`` (``WORLD_SIZE > 1``) every rank takes a contiguous share of the rows and the
    result is identical to a single-process run; on several nodes ``out_dir`` must be on a shared
    filesystem.

    ``out_dir`` receives ``<layer>.npy`` per layer, ``index.csv`` (``row,valid,path``), and
    ``manifest.json`` (backbone, weights and their SHA-256, layers, shapes, dtype, precision, pool, preprocessing,
    library versions, status, skipped inputs with reasons). An input that cannot be decoded keeps its row,
    zero-filled, with ``valid=0`` in ``index.csv`` and an entry under ``"skipped"``; grayscale,
    palette, RGBA (on white), CMYK and 16-bit images are converted.

    Args:
        extractor: a ``FeatureExtractor`` (its ``preprocessing``, ``input_range``, device and ``precision`` are
            used: ``precision="bf16"`` computes in bfloat16, the arrays are stored in ``dtype`` all the same).
        source: a folder (searched recursively), a glob, an image path, a list of these, or a
            ``torch.utils.data.Dataset`` of image tensors ``(C, H, W)`` (or tuples starting with one)
            already prepared: floats in the extractor's ``input_range``, or ``uint8`` 0..255 pixels.
        out_dir: output folder (created if needed).
        batch_size: images per forward, and the unit of commit and resume.
        num_workers: DataLoader processes that decode while the model runs (default: up to 4; at most 4
            per CPU core and one per batch).
        pool: ``"avg"`` or ``"max"`` over each layer's positions (spatial axes, or patch tokens: never
            class/register tokens), ``"cls"`` for the class token of token layers, or ``None`` to keep maps.
        dtype: ``"float32"`` or ``"float16"`` on disk.
        resume: finish an unfinished dump in ``out_dir`` (with the same settings and inputs).
        overwrite: replace whatever dump ``out_dir`` holds.
        progress: show a tqdm bar (images/s) on stderr.
        resize_size: shorter-side resize for image files; ``"weights"`` uses the weights' value, ``None`` none.
        crop_size: center crop for image files; ``"weights"`` uses the weights' value, ``None`` none.

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
        >>> result = dump_features(ext, images, tempfile.mkdtemp(), pool="avg", progress=False)
        >>> result.load("layer4").shape
        (8, 512)
    """
    dtype = check_options(batch_size, num_workers, pool, dtype)
    pooling = as_pool(pool)
    if resume and overwrite:
        raise InvalidValueError(
            "pass either resume=True (finish an unfinished dump) or overwrite=True (start over), not both"
        )
    dist = Distributed.from_environment(extractor.device)
    store = DumpStore(out_dir)
    try:
        plan, inputs = _broadcast_plan(
            dist, store, extractor, source, pooling, dtype, batch_size, resume, overwrite, resize_size, crop_size
        )
        manifest = plan.manifest
        if manifest.status == "complete":
            return DumpResult(store.root, manifest.to_dict())
        mine = split_contiguous(plan.pending, dist.world_size, dist.rank)
        failure: Exception | None = None
        try:
            _compute(extractor, inputs, store, mine, manifest, dist, num_workers, progress)
        except Exception as exc:
            if dist.world_size == 1:
                raise
            failure = exc  # tell the other ranks first, so none waits for this one
        if not dist.all_ok(failure is None):
            if failure is not None:
                raise failure
            raise RunFailedError(
                f"another rank failed while dumping to {store.root} (see its error); "
                "what was committed is kept: rerun with resume=True (--resume) to finish"
            )
        final = finish_dump(store, manifest, inputs.names) if dist.is_main else None
        final = dist.broadcast(final)
        dist.barrier()
        num_rows = len(inputs.names)
        computed = sum(min(plan.chunk_size, num_rows - chunk * plan.chunk_size) for chunk in plan.pending)
        return DumpResult(store.root, final.to_dict(), computed)
    finally:
        store.close_journal()
        store.close_arrays()
        store.unlock()
        dist.close()


def _broadcast_plan(
    dist: Distributed,
    store: DumpStore,
    extractor: FeatureExtractor,
    source: SourceSpec,
    pool: Pool | None,
    dtype: str,
    batch_size: int,
    resume: bool,
    overwrite: bool,
    resize_size: int | str | None,
    crop_size: int | str | None,
) -> tuple[Plan, Inputs]:
    """Rank 0 resolves inputs and prepares the files; the plan (or its error, of the same type) reaches every rank."""
    shared: tuple[Plan, list[str] | None, tuple[int, ...], ImageTransform | None, bool, bool] | None = None
    error: BaseException | None = None
    if dist.is_main:
        try:
            inputs = resolve_inputs(extractor, source, resize_size, crop_size, pool)
            settings = describe_settings(extractor, inputs, pool, dtype)
            store.lock()  # one dump per folder: rank 0 holds it for every rank
            plan = plan_dump(store, settings, inputs, batch_size, resume, overwrite)
            names = inputs.names if inputs.dataset is None else None
            shared = (plan, names, inputs.image_shape, inputs.transform, inputs.labelled, inputs.sizes_vary)
        except Exception as exc:
            if dist.world_size == 1:
                raise
            error = _portable(exc)
    shared, error = dist.broadcast((shared, error))
    if error is not None:
        raise error
    plan, names, image_shape, transform, labelled, sizes_vary = shared  # type: ignore[misc]
    if names is None:  # a dataset: every rank holds its own copy
        dataset = TensorDataset(source) if isinstance(source, Tensor) else source
        count = len(dataset)  # type: ignore[arg-type]
        names = [f"dataset[{i}]" for i in range(count)]
        return plan, Inputs(names, dataset, image_shape, None, labelled=labelled)  # type: ignore[arg-type]
    return plan, Inputs(names, None, image_shape, transform, sizes_vary=sizes_vary)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so other ranks raise the same type), else a RuntimeError saying it."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - exceptions with unusual constructors
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _compute(
    extractor: FeatureExtractor,
    inputs: Inputs,
    store: DumpStore,
    chunks: Sequence[int],
    manifest: Manifest,
    dist: Distributed,
    num_workers: int | None,
    progress: bool,
) -> None:
    """Write and commit this rank's chunks."""
    batches = [list(range(*chunk_rows(c, manifest.chunk_size, len(inputs.names)))) for c in chunks]
    store.open_arrays(manifest.settings.layers)
    store.open_journal(dist.rank)
    if batches:
        settings = manifest.settings
        name = "extract" if dist.world_size == 1 else f"extract rank {dist.rank}"
        with Progress(sum(map(len, batches)), progress, label=name, rank=dist.rank) as bar:
            found = extract_batches(
                extractor,
                inputs,
                batches,
                pool=settings.pool,
                dtype=settings.dtype,
                num_workers=num_workers,
                progress=bar,
            )
            for chunk, batch in zip(chunks, found):
                start, stop = batch.rows[0], batch.rows[-1] + 1
                store.write_rows(start, batch.arrays)
                if inputs.labelled:
                    store.write_labels(start, [-1 if label is None else label for label in batch.labels])
                store.commit(chunk, start, stop, batch.skipped)
    store.close_journal()
    store.close_arrays()
