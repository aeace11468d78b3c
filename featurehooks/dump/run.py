"""``dump_features``: stream the features of an image collection into per-layer ``.npy`` files."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .sharding import Distributed, chunk_rows, split_contiguous
from .sources import ImageFiles, SourceSpec, TensorRows, collate, decode_image, first_tensor, inputs_digest, list_images
from .store import FORMAT, INDEX, DumpStore, layer_file_name
from .transform import ImageTransform, transform_for

__all__ = ["DumpResult", "dump_features"]

_DTYPES = ("float16", "float32")
_POOLS = (None, "avg", "max")
# Settings that must match for a resume to continue an earlier run.
_RESUME_KEYS = ("backbone", "weights", "layers", "shapes", "dtype", "pool", "preprocessing", "inputs")


@dataclass(frozen=True)
class DumpResult:
    """What a dump wrote: ``out_dir``, its ``manifest`` (as saved) and helpers to read it back."""

    out_dir: Path
    manifest: dict[str, Any]

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


class _PlanError(Exception):
    """Carries an error found on rank 0 to every rank."""


def _check_options(batch_size: int, num_workers: int | None, pool: str | None, dtype: Any) -> str:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 0):
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    if pool not in _POOLS:
        raise ValueError(f"pool must be None, 'avg' or 'max', not {pool!r}")
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'float16' or 'float32', not {dtype!r}")
    return name


def _default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return min(4, max(cores - 1, 0))


def _pool(feature: Tensor, pool: str | None) -> Tensor:
    if pool is None or feature.dim() <= 2:
        return feature
    dims = (1,) if feature.dim() == 3 else tuple(range(2, feature.dim()))  # tokens (B, T, C) or maps (B, C, ...)
    return feature.mean(dim=dims) if pool == "avg" else feature.amax(dim=dims)


def _versions() -> dict[str, str]:
    import PIL
    import torchvision

    from .. import __version__

    return {
        "featurehooks": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
    }


def _device_of(extractor: torch.nn.Module) -> torch.device:
    for tensor in extractor.buffers():
        return tensor.device
    backbone = getattr(extractor, "backbone", extractor)
    for tensor in backbone.parameters():
        return tensor.device
    return torch.device("cpu")


def _features(extractor: Any, images: Tensor, pool: str | None, dtype: str) -> dict[str, np.ndarray]:
    with torch.no_grad():
        outputs = extractor(images)
    arrays = {}
    for name, value in outputs.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"layer {name!r} returned a {type(value).__name__}, not a tensor; it cannot be dumped")
        arrays[name] = _pool(value.detach(), pool).to(getattr(torch, dtype)).cpu().numpy()
    return arrays


@dataclass
class _Inputs:
    names: list[str]
    dataset: Dataset | None
    image_shape: tuple[int, ...]
    transform: ImageTransform | None


def _resolve_inputs(extractor: Any, source: SourceSpec, resize_size: Any, crop_size: Any) -> _Inputs:
    if isinstance(source, Tensor):
        if source.dim() != 4:
            raise ValueError(f"a tensor source must be a batch (N, C, H, W), got shape {tuple(source.shape)}")
        source = TensorDataset(source)
    if isinstance(source, Dataset):
        count = len(source)  # type: ignore[arg-type]
        if count == 0:
            raise ValueError("the dataset is empty")
        shape = tuple(first_tensor(source[0]).shape)
        return _Inputs([f"dataset[{i}]" for i in range(count)], source, shape, None)
    if not isinstance(source, (str, os.PathLike, list, tuple)):
        raise TypeError(
            "source must be a folder, glob, path, list of paths, Dataset or (N, C, H, W) tensor, "
            f"not {type(source).__name__}"
        )
    names = list_images(source)
    transform = transform_for(extractor.preprocessing, extractor.input_range, resize_size, crop_size)
    shape = transform.output_shape()
    if shape is None:  # no crop: every image must have the size of the first readable one
        for name in names:
            try:
                shape = tuple(transform(decode_image(name)).shape)
                break
            except Exception:  # unreadable: it is reported as an invalid row later
                continue
        else:
            raise ValueError(f"none of the {len(names)} inputs could be decoded")
    return _Inputs(names, None, shape, transform)


def _settings(extractor: Any, inputs: _Inputs, pool: str | None, dtype: str) -> dict[str, Any]:
    """The manifest fields that describe what is computed (compared on resume)."""
    probe = torch.zeros((1, *inputs.image_shape), device=_device_of(extractor))
    low = extractor.input_range[0] if hasattr(extractor, "input_range") else 0.0
    shapes = {
        name: [len(inputs.names), *value.shape[1:]]
        for name, value in _features(extractor, probe + low, pool, dtype).items()
    }
    pre = extractor.preprocessing
    preprocessing: dict[str, Any] = {
        "mean": list(pre.mean) if pre.mean is not None else None,
        "std": list(pre.std) if pre.std is not None else None,
    }
    if inputs.transform is not None:
        preprocessing.update(inputs.transform.describe())
    else:
        preprocessing.update(
            resize_size=None, crop_size=None, interpolation=None, input_range=list(extractor.input_range)
        )
    preprocessing["image_shape"] = list(inputs.image_shape)
    settings = {
        "backbone": extractor.backbone_name,
        "weights": extractor.weights,
        "layers": list(shapes),
        "shapes": shapes,
        "dtype": dtype,
        "pool": pool,
        "preprocessing": preprocessing,
        "inputs": {
            "kind": "dataset" if inputs.dataset is not None else "files",
            "count": len(inputs.names),
            "sha256": inputs_digest(inputs.names),
        },
    }
    return json.loads(json.dumps(settings))  # tuples -> lists, as they come back from disk


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return [key for key in _RESUME_KEYS if old.get(key) != new.get(key)]


def _plan(store: DumpStore, settings: dict[str, Any], batch_size: int, resume: bool, overwrite: bool) -> dict[str, Any]:
    """Rank 0: decide what to compute, and prepare the files for it. Returns the plan every rank follows."""
    out = store.root
    existing = store.read_manifest() if not overwrite else _read_quietly(store)
    num_rows = settings["inputs"]["count"]
    if existing is not None and not overwrite:
        differ = _differences(existing, settings)
        status = existing.get("status")
        if status == "complete" and not resume:
            raise FileExistsError(
                f"{out} already holds a complete dump ({existing.get('num_rows')} rows); "
                "pass overwrite=True (--overwrite) to replace it"
            )
        if not resume:
            raise FileExistsError(
                f"{out} holds an unfinished dump; pass resume=True (--resume) to finish it "
                "or overwrite=True (--overwrite) to start over"
            )
        if differ:
            raise ValueError(
                f"cannot resume the dump in {out}: {', '.join(differ)} differ from the earlier run; "
                "use the same settings and inputs, or overwrite=True (--overwrite) to start over"
            )
        if status == "complete":
            return {"manifest": existing, "pending": [], "chunk_size": existing["chunk_size"]}
        chunk_size = int(existing["chunk_size"])
        if store.arrays_match(settings["shapes"], settings["dtype"]):
            num_chunks = -(-num_rows // chunk_size)
            done = store.committed()
            pending = [c for c in range(num_chunks) if c not in done]
            return {"manifest": existing, "pending": pending, "chunk_size": chunk_size}
        batch_size = chunk_size  # the arrays were never fully created: start over with the same chunks
    elif existing is None and not overwrite:
        clash = [p.name for p in (store.layer_path(n) for n in settings["layers"]) if p.exists()]
        if (out / INDEX).exists():
            clash.append(INDEX)
        if clash:
            raise FileExistsError(
                f"{out} already has {', '.join(clash)} but no manifest; "
                "pass overwrite=True (--overwrite) to replace them"
            )
    manifest = {"format": FORMAT, "status": "running", **settings, "chunk_size": batch_size}
    manifest["files"] = {name: layer_file_name(name) for name in settings["layers"]}
    manifest["index"] = INDEX
    manifest["versions"] = _versions()
    out.mkdir(parents=True, exist_ok=True)
    store.write_manifest(manifest)  # "running" before any array exists
    old_layers = existing.get("layers", []) if existing else []
    store.remove_outputs([*old_layers, *settings["layers"]])
    store.reset_journal()
    store.create_arrays(settings["shapes"], settings["dtype"])
    return {"manifest": manifest, "pending": list(range(-(-num_rows // batch_size))), "chunk_size": batch_size}


def _read_quietly(store: DumpStore) -> dict[str, Any] | None:
    try:
        return store.read_manifest()
    except ValueError:
        return None


def _finish(store: DumpStore, manifest: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Rank 0, after every rank wrote its rows: index, skipped list, then the atomic "complete"."""
    num_rows = len(names)
    chunk_size = int(manifest["chunk_size"])
    done = store.committed()
    missing = [c for c in range(-(-num_rows // chunk_size)) if c not in done]
    if missing:
        raise RuntimeError(f"chunks {missing[:5]} of {store.root} were not committed; rerun with resume=True")
    invalid = {row: reason for skipped in done.values() for row, reason in skipped}
    store.write_index(names, invalid)
    manifest = dict(manifest)
    manifest["status"] = "complete"
    manifest["num_rows"] = num_rows
    manifest["num_valid"] = num_rows - len(invalid)
    manifest["skipped"] = [{"row": row, "path": names[row], "reason": invalid[row]} for row in sorted(invalid)]
    store.write_manifest(manifest)
    store.remove_journal()
    return manifest


def _loader(inputs: _Inputs, batches: list[list[int]], num_workers: int, pin: bool) -> DataLoader:
    if inputs.dataset is not None:
        rows: Dataset = TensorRows(inputs.dataset, inputs.image_shape)
    else:
        rows = ImageFiles(inputs.names, inputs.transform, inputs.image_shape)
    return DataLoader(
        rows,
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=pin,
        prefetch_factor=2 if num_workers > 0 else None,
    )


def _progress(total: int, rank: int, world_size: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    desc = "extract" if world_size == 1 else f"extract rank {rank}"
    return tqdm(
        total=total, unit="img", desc=desc, position=rank, disable=not enabled, file=sys.stderr, dynamic_ncols=True
    )


def dump_features(
    extractor: Any,
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
    ``manifest.json`` (backbone, weights, layers, shapes, dtype, pool, preprocessing, library
    versions, status, skipped inputs with reasons). An input that cannot be decoded keeps its row,
    zero-filled, with ``valid=0`` in ``index.csv`` and an entry under ``"skipped"``; grayscale,
    palette, RGBA (on white), CMYK and 16-bit images are converted.

    Args:
        extractor: a ``FeatureExtractor`` (its ``preprocessing``, ``input_range`` and device are used).
        source: a folder (searched recursively), a glob, an image path, a list of these, or a
            ``torch.utils.data.Dataset`` of image tensors ``(C, H, W)`` (or tuples starting with one)
            already prepared and in the extractor's ``input_range``.
        out_dir: output folder (created if needed).
        batch_size: images per forward, and the unit of commit and resume.
        num_workers: DataLoader processes that decode while the model runs (default: up to 4).
        pool: ``"avg"`` or ``"max"`` over the spatial (or token) axes, or ``None`` to keep maps.
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

    Example:
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)  # doctest: +SKIP
        >>> dump_features(ext, "images/", "out/", pool="avg").load("layer4").shape  # doctest: +SKIP
        (8, 512)
    """
    dtype = _check_options(batch_size, num_workers, pool, dtype)
    if resume and overwrite:
        raise ValueError("pass either resume=True (finish an unfinished dump) or overwrite=True (start over), not both")
    workers = _default_workers() if num_workers is None else num_workers
    device = _device_of(extractor)
    dist = Distributed.from_environment(device)
    store = DumpStore(out_dir)
    try:
        plan = _broadcast_plan(
            dist, store, extractor, source, pool, dtype, batch_size, resume, overwrite, resize_size, crop_size
        )
        inputs, manifest = plan["inputs"], plan["manifest"]
        if manifest.get("status") == "complete":
            return DumpResult(store.root, manifest)
        mine = split_contiguous(plan["pending"], dist.world_size, dist.rank)
        _compute(extractor, inputs, store, mine, int(plan["chunk_size"]), manifest, dist, workers, device, progress)
        ok = dist.all_ok(True)
        final = _finish(store, manifest, inputs.names) if dist.is_main and ok else None
        final = dist.broadcast(final)
        dist.barrier()
        return DumpResult(store.root, final)
    finally:
        store.close_journal()
        store.close_arrays()
        dist.close()


def _broadcast_plan(
    dist: Distributed,
    store: DumpStore,
    extractor: Any,
    source: SourceSpec,
    pool: str | None,
    dtype: str,
    batch_size: int,
    resume: bool,
    overwrite: bool,
    resize_size: Any,
    crop_size: Any,
) -> dict[str, Any]:
    """Rank 0 resolves inputs and prepares the files; the plan (or its error) reaches every rank."""
    plan: dict[str, Any] | None = None
    error: tuple[str, str] | None = None
    if dist.is_main:
        try:
            inputs = _resolve_inputs(extractor, source, resize_size, crop_size)
            settings = _settings(extractor, inputs, pool, dtype)
            plan = _plan(store, settings, batch_size, resume, overwrite)
            names = inputs.names if inputs.dataset is None else None
            plan["inputs"] = (names, inputs.image_shape, inputs.transform)
        except (OSError, ValueError, TypeError, LookupError) as exc:
            if dist.world_size == 1:
                raise
            error = (type(exc).__name__, str(exc))
    plan, error = dist.broadcast((plan, error))
    if error is not None:
        kinds = {"FileExistsError": FileExistsError, "FileNotFoundError": FileNotFoundError, "TypeError": TypeError}
        raise kinds.get(error[0], ValueError)(error[1])
    names, image_shape, transform = plan["inputs"]
    if names is None:  # a dataset: every rank holds its own copy
        dataset = TensorDataset(source) if isinstance(source, Tensor) else source
        count = len(dataset)  # type: ignore[arg-type]
        plan["inputs"] = _Inputs([f"dataset[{i}]" for i in range(count)], dataset, image_shape, None)  # type: ignore[arg-type]
    else:
        plan["inputs"] = _Inputs(names, None, image_shape, transform)
    return plan


def _compute(
    extractor: Any,
    inputs: _Inputs,
    store: DumpStore,
    chunks: Sequence[int],
    chunk_size: int,
    manifest: dict[str, Any],
    dist: Distributed,
    workers: int,
    device: torch.device,
    progress: bool,
) -> None:
    """Write and commit this rank's chunks."""
    num_rows = len(inputs.names)
    ranges = [chunk_rows(c, chunk_size, num_rows) for c in chunks]
    store.open_arrays(manifest["layers"])
    store.open_journal(dist.rank)
    if not ranges:
        store.close_journal()
        store.close_arrays()
        return
    loader = _loader(inputs, [list(range(a, b)) for a, b in ranges], workers, pin=device.type == "cuda")
    with _progress(sum(b - a for a, b in ranges), dist.rank, dist.world_size, progress) as bar:
        for chunk, (start, stop), (images, reasons) in zip(chunks, ranges, loader):
            arrays = _features(extractor, images.to(device, non_blocking=True), manifest["pool"], manifest["dtype"])
            skipped = [(start + i, reason) for i, reason in enumerate(reasons) if reason]
            for row, _ in skipped:
                for value in arrays.values():
                    value[row - start] = 0
            store.write_rows(start, arrays)
            store.commit(chunk, start, stop, skipped)
            bar.update(stop - start)
    store.close_journal()
    store.close_arrays()
