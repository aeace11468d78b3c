"""Joining the parts of a sharded dump (``shard=(i, n)``: one job each, nothing shared) into the dump one run writes:
the same rows in the same order, the arrays byte for byte, the same ``index.csv``, ``inputs.npy`` and manifest.

``merge_dumps`` checks every part before it writes a byte: complete, a shard of one input set, computed alike
(settings, weights, batch size), the parts covering the set once, their arrays, labels, index and input identities
fitting their manifests. It then writes with the dump's own machinery (``plan_dump``, the journal, ``finish_dump``):
the manifest says "running" before any array exists, rows are copied into the preallocated arrays and committed
chunk by chunk, and the index and the "complete" manifest come last. A merge cut short is finished by running it
again, which copies only the chunks not yet committed.
"""

from __future__ import annotations

import csv
import hashlib
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .._stream import Inputs, inputs_digest
from .._stream.sharding import Shard, check_cover
from ..errors import CorruptDumpError, InputNotFoundError, InvalidTypeError, InvalidValueError, OutputExistsError
from .manifest import INDEX, LABELS, START_OVER, Manifest, Settings
from .plan import IDENTITY, finish_dump, plan_dump
from .run import DumpResult
from .store import DumpStore, read_manifest

__all__ = ["merge_dumps"]

_BLOCK_BYTES = 1 << 26  # rows copied per write and commit, at most (one chunk always): bounds the memory of a merge
_AGREE = "the parts of one merge come from one command with one --shard i/N each"


@dataclass(frozen=True)
class _Part:
    """A complete dump of one shard, checked: its manifest, its shard, its rows' names and identities."""

    root: Path
    manifest: Manifest
    shard: Shard
    names: list[str]
    identity: np.ndarray | None


def merge_dumps(
    out_dir: str | os.PathLike[str], parts: Sequence[str | os.PathLike[str]], *, overwrite: bool = False
) -> DumpResult:
    """Join the dumps of the shards of one input set (``dump_features(..., shard=(i, n))``) into ``out_dir``.

    The result is the dump one run over the whole set writes: the rows in the set's order, every array byte for byte,
    the same ``index.csv``, ``labels.npy``, ``inputs.npy`` and ``manifest.json`` (the parts' library versions). The
    parts are checked first, and nothing is written when one is refused. An interrupted merge is finished by calling
    it again with the same parts; a complete one is left as it is.

    Args:
        out_dir: the folder of the merged dump (created if needed).
        parts: the folders the shards' dumps wrote, in any order.
        overwrite: replace another dump that ``out_dir`` holds.

    Returns:
        A ``DumpResult`` of ``out_dir``; ``rows_computed`` counts the rows this call copied.

    Raises:
        InputNotFoundError: a part holds no dump.
        InvalidValueError: naming the parts, an unfinished part (its job still running, or killed), a whole dump,
            parts of another input set, parts computed otherwise (settings, weights, batch size), two parts of one
            shard, parts whose rows overlap, or rows no part holds (the shards missing).
        CorruptDumpError: a part's arrays, labels, index or input identities do not fit its manifest.
        OutputExistsError: ``out_dir`` holds another dump and ``overwrite`` is not set.

    Examples:
        >>> import os, tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> from featurehooks.dump import merge_dumps
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> images, root = torch.rand(5, 3, 8, 8), tempfile.mkdtemp()
        >>> parts = [os.path.join(root, f"part{i}") for i in range(2)]
        >>> for i, part in enumerate(parts):  # each shard in a job of its own, anywhere
        ...     _ = dump_features(ext, images, part, batch_size=2, shard=(i, 2), progress=False)
        >>> merged = merge_dumps(os.path.join(root, "all"), parts)
        >>> whole = dump_features(ext, images, os.path.join(root, "one"), batch_size=2, progress=False)
        >>> same_bytes = merged.path("0").read_bytes() == whole.path("0").read_bytes()
        >>> merged.num_rows, merged.manifest == whole.manifest, same_bytes
        (5, True, True)
    """
    if isinstance(parts, (str, os.PathLike)):
        raise InvalidTypeError(f"parts must be a list of dump folders, not the one path {os.fspath(parts)!r}")
    found = [_read_part(Path(part)) for part in parts]
    if not found:
        raise InvalidValueError("no parts given: pass the folders of the dumps of every shard")
    named = {str(part.root): part for part in found}
    if len(named) < len(found):
        raise InvalidValueError("a part's folder is given twice: pass the folder of each shard's dump once")
    _check_alike(found)
    ordered = [named[name] for name, _ in check_cover([(str(part.root), part.shard) for part in found])]
    names = [name for part in ordered for name in part.names]
    first = ordered[0]
    if inputs_digest(names) != first.shard.set_sha256:
        raise CorruptDumpError(
            f"the paths in the index.csv of the parts are not the rows their manifests name (sha256 of the set); "
            f"a part was edited by hand: {START_OVER} on it"
        )
    identities = [part.identity for part in ordered if part.identity is not None]
    identity = np.concatenate(identities) if len(identities) == len(ordered) else None  # none for a dataset
    if first.manifest.settings.inputs.kind == "generated" and identity is not None:
        _check_one_generator(ordered)
    settings = _whole(first.manifest.settings, first.shard, len(names), identity)
    store = DumpStore(out_dir)
    _check_out(store, settings, overwrite)
    try:
        store.lock()
        rows = Inputs(names, None, (), None, identity)
        planned = plan_dump(
            store, settings, rows, first.manifest.chunk_size, True, overwrite, versions=first.manifest.versions
        )
        if planned.manifest.status == "complete":
            return DumpResult(store.root, planned.manifest)
        copied = _copy(store, ordered, planned.manifest, set(planned.pending))
        return DumpResult(store.root, finish_dump(store, planned.manifest, names), copied)
    finally:
        store.close_journal()
        store.close_arrays()
        store.unlock()


def _read_part(root: Path) -> _Part:
    """The complete dump of one shard in ``root``, its files checked against its manifest."""
    manifest = read_manifest(root)
    if manifest is None:
        raise InputNotFoundError(f"{root} holds no dump (manifest.json): pass the folders the shards' dumps wrote")
    if manifest.status != "complete":
        raise InvalidValueError(
            f"{root} is an unfinished dump (status {manifest.status!r}: its job is still running, or was killed); "
            "finish it (resume=True, --resume), then merge"
        )
    settings = manifest.settings
    if settings.shard is None:
        raise InvalidValueError(
            f"{root} is the dump of a whole input set, not of a shard: merge the dumps of shard=(i, n) (--shard i/N)"
        )
    shard, chunk_size = settings.shard, manifest.chunk_size
    if shard.start % chunk_size or (shard.stop % chunk_size and shard.stop != shard.set_count):
        raise CorruptDumpError(f"{root}: its {shard} are not whole batches of {chunk_size}; {START_OVER}")
    store = DumpStore(root)
    if not store.arrays_match(settings.shapes, settings.dtype):
        raise CorruptDumpError(f"{root}: an array is missing, cut short or not what manifest.json says; {START_OVER}")
    if settings.inputs.labelled and not store.labels_match(settings.inputs.count):
        raise CorruptDumpError(f"{root}: {LABELS} is missing or not what manifest.json says; {START_OVER}")
    names, invalid = _read_index(root / INDEX)
    if inputs_digest(names) != settings.inputs.sha256:
        raise CorruptDumpError(f"{root / INDEX}: its paths are not the rows manifest.json names; {START_OVER}")
    if invalid != {row.row for row in manifest.skipped or ()}:
        raise CorruptDumpError(f"{root / INDEX}: its valid column differs from manifest.json's skipped rows")
    return _Part(root, manifest, shard, names, _identity(root, settings))


def _read_index(path: Path) -> tuple[list[str], set[int]]:
    """The paths of ``index.csv`` in row order, and its rows marked invalid (names kept byte for byte)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as handle:
            lines = list(csv.reader(handle))
    except (OSError, csv.Error) as exc:
        raise CorruptDumpError(f"{path} cannot be read ({exc}); {START_OVER}") from None
    if not lines or lines[0] != ["row", "valid", "path"]:
        raise CorruptDumpError(f"{path} does not begin with the line row,valid,path; {START_OVER}")
    for row, line in enumerate(lines[1:]):
        if len(line) != 3 or line[0] != str(row) or line[1] not in ("0", "1"):
            raise CorruptDumpError(f"{path} line {row + 2} is not {row},<0 or 1>,<path>; {START_OVER}")
    return [line[2] for line in lines[1:]], {row for row, line in enumerate(lines[1:]) if line[1] == "0"}


def _identity(root: Path, settings: Settings) -> np.ndarray | None:
    """The part's ``inputs.npy`` (sizes and modification times of its input files), checked against its manifest."""
    recorded = settings.inputs.identity_sha256
    if recorded is None:
        return None
    try:
        identity = np.load(root / IDENTITY, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CorruptDumpError(f"{root / IDENTITY} cannot be read ({type(exc).__name__}); {START_OVER}") from None
    fits = identity.shape == (settings.inputs.count, 2) and identity.dtype == np.int64
    if not fits or hashlib.sha256(np.ascontiguousarray(identity).tobytes()).hexdigest() != recorded:
        raise CorruptDumpError(f"{root / IDENTITY} is not what manifest.json says; {START_OVER}")
    return identity


def _shared(settings: Settings) -> Settings:
    """``settings`` without what differs from shard to shard (its rows), to compare the parts."""
    inputs = replace(settings.inputs, count=0, sha256="", identity_sha256=None)
    return replace(
        settings, shapes={name: shape[1:] for name, shape in settings.shapes.items()}, inputs=inputs, shard=None
    )


def _check_alike(parts: Sequence[_Part]) -> None:
    """Refuse parts of other input sets, or computed otherwise than the first; warn of other library versions."""
    first = parts[0]
    for part in parts[1:]:
        mine, theirs = first.shard, part.shard
        if (mine.set_count, mine.set_sha256) != (theirs.set_count, theirs.set_sha256):
            raise InvalidValueError(
                f"{part.root} is a shard of another input set than {first.root} ({theirs.set_count} rows, sha256 "
                f"{theirs.set_sha256[:12]}... vs {mine.set_count} rows, {mine.set_sha256[:12]}...); {_AGREE}"
            )
        differ = _shared(first.manifest.settings).differences(_shared(part.manifest.settings))
        if part.manifest.chunk_size != first.manifest.chunk_size:
            differ.append(f"batch size ({part.manifest.chunk_size} vs {first.manifest.chunk_size})")
        if differ:
            raise InvalidValueError(
                f"{part.root} was computed with other {', '.join(differ)} than {first.root}; {_AGREE}"
            )
        versions = sorted(set(part.manifest.versions.items()) ^ set(first.manifest.versions.items()))
        if versions:
            names = ", ".join(sorted({name for name, _ in versions}))
            warnings.warn(
                f"{part.root} was computed with other library versions ({names}) than {first.root}; the merged "
                f"manifest records those of {first.root}",
                stacklevel=3,
            )


def _whole(settings: Settings, shard: Shard, count: int, identity: np.ndarray | None) -> Settings:
    """The settings of one run over the whole set of ``count`` rows that ``shard``, of ``settings``, belongs to."""
    digest = None if identity is None else hashlib.sha256(identity.tobytes()).hexdigest()
    inputs = replace(settings.inputs, count=count, sha256=shard.set_sha256, identity_sha256=digest)
    shapes = {name: (count, *shape[1:]) for name, shape in settings.shapes.items()}
    return replace(settings, shapes=shapes, inputs=inputs, shard=None)


def _check_out(store: DumpStore, settings: Settings, overwrite: bool) -> None:
    """Refuse, before anything is written, an ``out_dir`` that holds another dump than this merge's."""
    existing = None if overwrite else store.read_manifest()
    differ = [] if existing is None else existing.settings.differences(settings)
    if differ:
        raise OutputExistsError(
            f"{store.root} holds another dump ({', '.join(differ)} differ from the merged parts'); merge into a new "
            "folder, or pass overwrite=True (--overwrite) to replace it"
        )


def _copy(store: DumpStore, parts: Sequence[_Part], manifest: Manifest, pending: set[int]) -> int:
    """Copy the rows of the ``pending`` chunks from the parts, committing them as a run does; the rows copied."""
    chunk_size, labelled = manifest.chunk_size, manifest.settings.inputs.labelled
    store.open_arrays(manifest.settings.layers)
    store.open_journal(0)
    copied = 0
    for part in parts:
        files = part.manifest.files
        arrays = {layer: np.load(part.root / files[layer], mmap_mode="r") for layer in files}
        labels = np.load(part.root / LABELS, mmap_mode="r") if labelled else None
        invalid = {row.row + part.shard.start: row.reason for row in part.manifest.skipped or ()}
        row_bytes = sum(array[:1].nbytes for array in arrays.values()) or 1
        chunks = [c for c in range(part.shard.start // chunk_size, -(-part.shard.stop // chunk_size)) if c in pending]
        for block in _blocks(chunks, max(1, _BLOCK_BYTES // (row_bytes * chunk_size))):
            start, stop = block[0] * chunk_size, min((block[-1] + 1) * chunk_size, part.shard.stop)
            here = slice(start - part.shard.start, stop - part.shard.start)
            store.write_rows(start, {layer: array[here] for layer, array in arrays.items()})
            if labels is not None:
                store.write_labels(start, labels[here].tolist())
            commits = []
            for chunk in block:
                first, last = chunk * chunk_size, min((chunk + 1) * chunk_size, part.shard.stop)
                commits.append(
                    (chunk, first, last, [(row, invalid[row]) for row in range(first, last) if row in invalid])
                )
            store.commit_chunks(commits)
            copied += stop - start
    store.close_journal()
    store.close_arrays()
    return copied


def _blocks(chunks: Sequence[int], most: int) -> Iterator[list[int]]:
    """``chunks`` in runs of consecutive numbers, ``most`` chunks at most each."""
    block: list[int] = []
    for chunk in chunks:
        if block and (chunk != block[-1] + 1 or len(block) == most):
            yield block
            block = []
        block.append(chunk)
    if block:
        yield block


def _check_one_generator(ordered: list[_Part]) -> None:
    """Refuse parts of a generated set whose generators made other images (their first images' fingerprints,
    recorded in every row, differ)."""
    first = ordered[0]
    for part in ordered[1:]:
        if (
            part.identity is not None
            and first.identity is not None
            and not np.array_equal(part.identity[:1], first.identity[:1])
        ):
            raise InvalidValueError(
                f"{part.root} and {first.root} come from generators that made other images (their first images "
                "differ): the parts of one merge draw from one seeded generator"
            )
