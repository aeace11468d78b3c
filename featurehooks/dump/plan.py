"""Planning a dump: what the inputs are, what will be computed, and what an existing output allows.

Rank 0 runs these; the ``Plan`` it returns is what every rank follows. ``finish_dump`` writes the index
and the atomic ``"complete"`` manifest once every chunk is committed. For image files, the size and
modification time of every input are kept in ``inputs.npy``, so a resume refuses inputs changed since.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from ..errors import InvalidTypeError, InvalidValueError, OutputExistsError, RunFailedError
from ..images import ImageTransform, image_size, read_image, transform_for
from ..stream.forward import device_of, features_as_arrays
from ..stream.sources import SourceSpec, dataset_layout, inputs_digest, list_images
from .manifest import INDEX, LABELS, InputsRecord, Manifest, Settings, SkippedRow, layer_file_name
from .store import DumpStore, write_npy_atomic

__all__ = ["Inputs", "Plan", "describe_settings", "finish_dump", "plan_dump", "resolve_inputs"]

IDENTITY = "inputs.npy"  # (N, 2) int64: size in bytes and modification time in ns of every input file
_NAMED = 5  # changed inputs named in an error; the rest are counted


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


@dataclass(frozen=True)
class Inputs:
    """The rows of a dump: their names, the dataset (for tensor sources), the prepared image shape, for
    files their identity (size and mtime, to notice files replaced before a resume), and whether the
    dataset's items carry integer labels, and whether images may differ in size (pooled, uncropped files:
    ``image_shape`` is then the first readable image's, which probes the features' shapes)."""

    names: list[str]
    dataset: Dataset | None
    image_shape: tuple[int, ...]
    transform: ImageTransform | None
    identity: np.ndarray | None = None
    labelled: bool = False
    sizes_vary: bool = False


@dataclass(frozen=True)
class Plan:
    """What every rank follows: the manifest as written and the chunks still to compute."""

    manifest: Manifest
    pending: tuple[int, ...]

    @property
    def chunk_size(self) -> int:
        return self.manifest.chunk_size


def file_identity(names: list[str]) -> np.ndarray:
    """``(N, 2)`` size and modification time (ns) of each file; ``-1`` where a file cannot be stat'ed."""
    identity = np.full((len(names), 2), -1, dtype=np.int64)
    for row, name in enumerate(names):
        try:
            info = os.stat(name)
        except OSError:  # reported as an invalid row when it is read
            continue
        identity[row] = (info.st_size, info.st_mtime_ns)
    return identity


def resolve_inputs(extractor: Any, source: SourceSpec, resize_size: Any, crop_size: Any, pool: str | None) -> Inputs:
    """List the rows of ``source`` (sorted files, or a dataset/tensor) and the image shape every row gets."""
    if isinstance(source, Tensor):
        if source.dim() != 4:
            raise InvalidValueError(f"a tensor source must be a batch (N, C, H, W), got shape {tuple(source.shape)}")
        source = TensorDataset(source)
    if isinstance(source, Dataset):
        layout = dataset_layout(source)  # the first readable item: one that raises is an invalid row
        names = [f"dataset[{i}]" for i in range(len(source))]  # type: ignore[arg-type]
        return Inputs(names, source, layout.shape, None, labelled=layout.labelled)
    if not isinstance(source, (str, os.PathLike, list, tuple)):
        raise InvalidTypeError(
            "source must be a folder, glob, path, list of paths, Dataset or (N, C, H, W) tensor, "
            f"not {type(source).__name__}"
        )
    names = list_images(source)
    transform = transform_for(extractor.preprocessing, extractor.input_range, resize_size, crop_size)
    shape = transform.output_shape()
    if shape is None:  # no crop: the first readable image's shape probes the features' shapes
        if pool is None:
            _check_one_size(names, transform)
        for name in names:
            try:
                shape = tuple(transform(read_image(name)).shape)
                break
            except Exception:  # unreadable: it is reported as an invalid row later
                continue
        else:
            raise InvalidValueError(f"none of the {len(names)} inputs could be decoded")
    return Inputs(names, None, shape, transform, file_identity(names), sizes_vary=pool is not None)


def _check_one_size(names: list[str], transform: ImageTransform) -> None:
    """Spatial maps of every row share one shape: refuse, while planning, images that would differ."""
    first: tuple[str, tuple[int, int]] | None = None
    for name in names:
        try:
            size = transform.prepared_size(*image_size(name))
        except Exception:  # unreadable: an invalid row later
            continue
        if first is None:
            first = (name, size)
        elif size != first[1]:
            raise InvalidValueError(
                f"images of different sizes cannot share one array of feature maps: {first[0]} is "
                f"{first[1][1]}x{first[1][0]} and {name} is {size[1]}x{size[0]} once prepared; set a resize "
                "and a crop (resize_size=, crop_size=; --resize, --crop) or pool the features (pool='avg', --pool avg)"
            )


def weights_digest(extractor: Any) -> str | None:
    """SHA-256 of the backbone's state dict (names, dtypes, shapes and bytes), or ``None`` without one.

    ``weights`` alone cannot tell two checkpoints of a user's module (or two seeds of a random init) apart.
    """
    model = getattr(extractor, "backbone", None)
    if not isinstance(model, torch.nn.Module):
        return None
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}\n".encode())
        digest.update(value.reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return digest.hexdigest()


def describe_settings(extractor: Any, inputs: Inputs, pool: str | None, dtype: str) -> Settings:
    """What the dump computes, as its manifest records it (compared on resume)."""
    probe = torch.zeros((1, *inputs.image_shape), device=device_of(extractor))
    low = extractor.input_range[0] if hasattr(extractor, "input_range") else 0.0
    range_checked = getattr(extractor, "_range_checked", None)
    shapes = {
        name: (len(inputs.names), *value.shape[1:])
        for name, value in features_as_arrays(extractor, probe + low, pool, dtype).items()
    }
    if range_checked is False:  # the probe is in range by construction: let the first real batch be checked
        extractor._range_checked = False
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
    identity = inputs.identity
    return Settings(
        backbone=extractor.backbone_name,
        weights=extractor.weights,
        weights_sha256=weights_digest(extractor),
        shapes=shapes,
        dtype=dtype,
        pool=pool,
        preprocessing=json.loads(json.dumps(preprocessing)),  # tuples -> lists, as they come back from disk
        inputs=InputsRecord(
            kind="dataset" if inputs.dataset is not None else "files",
            count=len(inputs.names),
            sha256=inputs_digest(inputs.names),
            labelled=inputs.labelled,
            identity_sha256=None if identity is None else hashlib.sha256(identity.tobytes()).hexdigest(),
        ),
    )


def _check_identity(store: DumpStore, earlier: InputsRecord, now: InputsRecord, inputs: Inputs) -> None:
    """Refuse a resume whose input files changed (size or mtime) since the dump began, naming them."""
    identity = inputs.identity
    if identity is None or earlier.identity_sha256 is None or earlier.identity_sha256 == now.identity_sha256:
        return
    try:
        earlier_identity = np.load(store.root / IDENTITY)
    except (OSError, ValueError) as exc:
        raise InvalidValueError(
            f"cannot resume the dump in {store.root}: the input files changed since it began, and {IDENTITY} "
            f"({type(exc).__name__}) cannot tell which; overwrite=True (--overwrite) starts over"
        ) from exc
    if earlier_identity.shape != identity.shape:
        changed = list(range(len(inputs.names)))
    else:
        changed = np.flatnonzero((earlier_identity != identity).any(axis=1)).tolist()
    named = ", ".join(inputs.names[row] for row in changed[:_NAMED])
    more = f" and {len(changed) - _NAMED} more" if len(changed) > _NAMED else ""
    raise InvalidValueError(
        f"cannot resume the dump in {store.root}: {len(changed)} input file(s) changed (size or modification "
        f"time) since it began: {named}{more}; restore them, or overwrite=True (--overwrite) to start over"
    )


def _save_identity(store: DumpStore, identity: np.ndarray | None) -> None:
    """Write ``inputs.npy`` atomically (or remove a stale one) before any row is computed."""
    path = store.root / IDENTITY
    if identity is None:
        path.unlink(missing_ok=True)
        return
    write_npy_atomic(path, identity)


def plan_dump(
    store: DumpStore, settings: Settings, inputs: Inputs, batch_size: int, resume: bool, overwrite: bool
) -> Plan:
    """Rank 0: decide what to compute, and prepare the files for it. Returns the plan every rank follows."""
    out = store.root
    labelled = settings.inputs.labelled
    files: dict[str, str] = {LABELS: "the labels"} if labelled else {}
    for layer in settings.layers:  # "a/b" and "a_b" (or "A" and "a" on macOS) would share one file
        other = files.setdefault(layer_file_name(layer).lower(), layer)
        if other != layer:
            raise InvalidValueError(
                f"layers {other!r} and {layer!r} would both be written to {layer_file_name(layer)}; rename one "
                "(FeatureExtractor(..., layers={'module.path': 'output_name'}))"
            )
    existing = store.read_manifest() if not overwrite else _read_quietly(store)
    num_rows = settings.inputs.count
    if existing is not None and not overwrite:
        differ = settings.differences(existing.settings)
        if existing.status == "complete" and not resume:
            raise OutputExistsError(
                f"{out} already holds a complete dump ({existing.num_rows} rows); "
                "pass overwrite=True (--overwrite) to replace it"
            )
        if not resume:
            raise OutputExistsError(
                f"{out} holds an unfinished dump; pass resume=True (--resume) to finish it "
                "or overwrite=True (--overwrite) to start over"
            )
        if differ == ["inputs"] and existing.settings.inputs.sha256 == settings.inputs.sha256:
            _check_identity(store, existing.settings.inputs, settings.inputs, inputs)
        if differ:
            raise InvalidValueError(
                f"cannot resume the dump in {out}: {', '.join(differ)} differ from the earlier run; "
                "use the same settings and inputs, or overwrite=True (--overwrite) to start over"
            )
        if existing.status == "complete":
            return Plan(existing, ())
        if store.arrays_match(settings.shapes, settings.dtype) and (not labelled or store.labels_match(num_rows)):
            num_chunks = -(-num_rows // existing.chunk_size)
            done = store.committed()
            return Plan(existing, tuple(c for c in range(num_chunks) if c not in done))
        batch_size = existing.chunk_size  # the arrays were never fully created: start over with the same chunks
    elif existing is None and not overwrite:
        clash = [p.name for p in (store.layer_path(n) for n in settings.layers) if p.exists()]
        if (out / INDEX).exists():
            clash.append(INDEX)
        if clash:
            raise OutputExistsError(
                f"{out} already has {', '.join(clash)} but no manifest; "
                "pass overwrite=True (--overwrite) to replace them"
            )
    manifest = Manifest(settings, chunk_size=batch_size, versions=_versions())
    out.mkdir(parents=True, exist_ok=True)
    store.reset_journal()  # before the new manifest: a kill in between must not pair it with an old journal
    store.write_manifest(manifest)  # "running" before any array exists
    old_layers = existing.settings.layers if existing else ()
    store.remove_outputs([*old_layers, *settings.layers])
    _save_identity(store, inputs.identity)
    store.create_arrays(settings.shapes, settings.dtype)
    if labelled:
        store.create_labels(num_rows)
    return Plan(manifest, tuple(range(-(-num_rows // batch_size))))


def _read_quietly(store: DumpStore) -> Manifest | None:
    try:
        return store.read_manifest()
    except ValueError:
        return None


def finish_dump(store: DumpStore, manifest: Manifest, names: list[str]) -> Manifest:
    """Rank 0, after every rank wrote its rows: index, skipped list, then the atomic "complete"."""
    num_rows = len(names)
    done = store.committed()
    missing = [c for c in range(-(-num_rows // manifest.chunk_size)) if c not in done]
    if missing:
        raise RunFailedError(f"chunks {missing[:5]} of {store.root} were not committed; rerun with resume=True")
    invalid = {row: reason for skipped in done.values() for row, reason in skipped}
    store.write_index(names, invalid)
    final = manifest.completed(SkippedRow(row, names[row], invalid[row]) for row in sorted(invalid))
    store.write_manifest(final)
    store.remove_journal()
    return final
