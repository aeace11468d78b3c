"""Planning a dump: what the inputs are, what will be computed, and what an existing output allows.

Rank 0 runs these; the ``Plan`` it returns is what every rank follows. ``finish_dump`` writes the index
and the atomic ``"complete"`` manifest once every chunk is committed. For image files, the size and
modification time of every input are kept in ``inputs.npy``, so a resume refuses inputs changed since; for
generated images, the fingerprint of the generator's first batch, so a resume refuses other images.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._layout import Pool
from .._stream import Inputs, inputs_digest, row_shapes
from .._stream.sharding import Shard
from .._version import __version__
from ..errors import InvalidValueError, OutputExistsError, RunFailedError
from .manifest import INDEX, LABELS, InputsRecord, Manifest, Settings, SkippedRow, layer_file_name
from .store import DumpStore, write_npy_atomic

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["Plan", "describe_settings", "finish_dump", "plan_dump"]

IDENTITY = "inputs.npy"  # (N, 2) int64: size and modification time (ns) of every file; a generator's fingerprint
_NAMED = 5  # changed inputs named in an error; the rest are counted


def _versions() -> dict[str, str]:
    import PIL
    import torchvision

    return {
        "featurehooks": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": np.__version__,
        "pillow": PIL.__version__,
        "python": platform.python_version(),
    }


@dataclass(frozen=True)
class Plan:
    """What every rank follows: the manifest as written and the chunks still to compute."""

    manifest: Manifest
    pending: tuple[int, ...]

    @property
    def chunk_size(self) -> int:
        return self.manifest.chunk_size


def describe_settings(
    extractor: FeatureExtractor, inputs: Inputs, pool: Pool | None, dtype: str, shard: Shard | None = None
) -> Settings:
    """What the dump computes, as its manifest records it (compared on resume); ``inputs`` are the rows of ``shard``
    in a part of a sharded dump."""
    shapes = {
        name: (len(inputs.names), *shape) for name, shape in row_shapes(extractor, inputs.image_shape, pool).items()
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
    identity = inputs.identity
    return Settings(
        backbone=extractor.backbone_name,
        weights=extractor.weights,
        weights_sha256=extractor.weights_sha256(),
        shapes=shapes,
        dtype=dtype,
        pool=pool,
        preprocessing=json.loads(json.dumps(preprocessing)),  # tuples -> lists, as they come back from disk
        inputs=InputsRecord(
            kind="generated" if inputs.generated else "dataset" if inputs.dataset is not None else "files",
            count=len(inputs.names),
            sha256=inputs_digest(inputs.names),
            labelled=inputs.labelled,
            identity_sha256=None if identity is None else hashlib.sha256(identity.tobytes()).hexdigest(),
        ),
        precision=extractor.precision,
        shard=shard,
    )


def _check_identity(store: DumpStore, earlier: InputsRecord, now: InputsRecord, inputs: Inputs) -> None:
    """Refuse a resume whose input files changed (size or mtime) since the dump began, naming them; or whose
    generator's first image differs from the earlier run's."""
    identity = inputs.identity
    if identity is None or earlier.identity_sha256 is None or earlier.identity_sha256 == now.identity_sha256:
        return
    if inputs.generated:
        raise InvalidValueError(
            f"cannot resume the dump in {store.root}: the generator's first image differs from the earlier run's "
            "(SHA-256 of its pixels), so its images are not the same; seed it to make the same images on every "
            "pass, or overwrite=True to start over"
        )
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
    store: DumpStore,
    settings: Settings,
    inputs: Inputs,
    batch_size: int,
    resume: bool,
    overwrite: bool,
    versions: Mapping[str, str] | None = None,
) -> Plan:
    """Rank 0: decide what to compute, and prepare the files for it. Returns the plan every rank follows.

    ``versions``: the library versions a new manifest records (default: this process's; a merge passes its parts').
    """
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
    manifest = Manifest(settings, chunk_size=batch_size, versions=dict(versions or _versions()))
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
