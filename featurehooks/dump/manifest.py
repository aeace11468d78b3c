"""The manifest of a dump (``manifest.json``) as a typed value: what it records, how it is checked, how it is written.

A dump's files are only as trustworthy as the manifest that describes them, so ``Manifest.from_dict`` checks every
field and refuses a manifest that is not fit, with a ``CorruptDumpError`` that names the field; ``Manifest.read``
first bounds the file's size and its nesting, so a hostile file is refused in the same one line. ``to_dict`` gives
back the very dict a manifest was read from, keys in the order dumps have always written them: a resumed dump
writes the bytes an uninterrupted one would, and journal lines keep naming the manifest they were written for.

Schema ``featurehooks.dump/1``. Fields newer than it are optional: ``weights_sha256`` (``UNRECORDED`` when absent),
``inputs.identity_sha256``, ``inputs.labels`` and ``labels``, so dumps begun before them still read and resume;
``precision`` (what the backbone computed in) is written only when it is not ``"float32"``, which it is when absent;
``shard`` only in a part of a sharded dump (``shard=(i, n)``): which rows of which input set it holds.

``read_manifest`` and ``DumpResult.manifest`` hand out a ``Manifest``. For one release it also answers the dict
access of the releases that handed out the JSON dict (``manifest["layers"]``, ``"labels" in manifest``, ``.get``),
with a ``FutureWarning`` that names the attribute to use instead, or ``to_dict()`` for the JSON value.
"""

from __future__ import annotations

import copy
import enum
import json
import os
import warnings
from collections.abc import Callable, Collection, ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, TypeGuard

from .._layout import Pool, as_pool
from .._precision import PRECISIONS
from .._stream.sharding import Shard
from ..errors import CorruptDumpError, InvalidValueError

__all__ = [
    "DTYPES",
    "INDEX",
    "LABELS",
    "MANIFEST",
    "SCHEMA",
    "START_OVER",
    "UNRECORDED",
    "InputsRecord",
    "Manifest",
    "Settings",
    "SkippedRow",
    "is_count",
    "layer_file_name",
]

SCHEMA = "featurehooks.dump/1"  # the manifest's "format"
MANIFEST = "manifest.json"
INDEX = "index.csv"
LABELS = "labels.npy"  # (N,) int64 labels of an (image, label) dataset; -1 for a row without one
DTYPES = ("float16", "float32")
START_OVER = "pass overwrite=True (--overwrite) to start over"
_KINDS = ("files", "dataset", "generated")
_STATUSES = ("running", "complete")
_MAX_BYTES = 1 << 28  # 256 MiB: a manifest is settings plus one short entry per skipped row
_MAX_DEPTH = 16  # nesting of its lists and objects (what dumps write is 4 deep)
_INPUTS_FIELDS = ("kind", "count", "sha256", "labels", "identity_sha256")
_ACCOUNT = ("num_rows", "num_valid", "skipped")  # how a complete dump accounts for its rows
# what a resume must match (``layers`` too: ``shapes`` compare equal in any order)
_COMPARED = (
    "backbone",
    "weights",
    "weights_sha256",
    "layers",
    "shapes",
    "dtype",
    "precision",
    "pool",
    "preprocessing",
    "inputs",
    "shard",
)
_FIELDS = (
    "format",
    "status",
    *_COMPARED,
    "chunk_size",
    "files",
    "labels",
    "index",
    "versions",
    *_ACCOUNT,
)

# manifest.json's fields -> the attribute of a ``Manifest`` that holds each (``format`` and ``index`` are constants)
_ATTRIBUTES = {
    "status": "status",
    **{name: f"settings.{name}" for name in _COMPARED},
    "chunk_size": "chunk_size",
    "files": "files",
    "labels": "settings.inputs.labelled",
    "versions": "versions",
    "num_rows": "num_rows",
    "num_valid": "num_valid",
    "skipped": "skipped",
}


class Unrecorded(enum.Enum):
    """The type of ``UNRECORDED``: a field that a dump begun before the field existed does not have."""

    UNRECORDED = "unrecorded"


UNRECORDED = Unrecorded.UNRECORDED
"""What ``Settings.weights_sha256`` is in a dump begun before featurehooks recorded the weights' hash.

Such a dump still resumes: the hash is left out of the comparison.

Examples:
    >>> import tempfile, torch
    >>> from featurehooks import FeatureExtractor, dump_features
    >>> from featurehooks.dump import UNRECORDED
    >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
    >>> result = dump_features(ext, torch.rand(1, 3, 8, 8), tempfile.mkdtemp(), progress=False)
    >>> sha256 = result.manifest.settings.weights_sha256
    >>> "unrecorded" if sha256 is UNRECORDED else len(sha256)  # this featurehooks records it
    64
"""


def layer_file_name(layer: str) -> str:
    """File name of a layer's array: ``relu3_3.npy``, ``layer4.1.npy`` (path separators replaced)."""
    safe = "".join("_" if ch in '/\\:*?"<>|' else ch for ch in layer)
    return f"{safe}.npy"


def is_count(value: Any, least: int = 0) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class InputsRecord:
    """What a dump's rows are: ``"files"``, a ``"dataset"`` (or tensor) or ``"generated"`` (``GeneratedImages``), how
    many, and the SHA-256 of their names; whether the items carried labels; the SHA-256 of ``inputs.npy``: for files
    their sizes and modification times, for a generator its first image's fingerprint; ``None`` for a dataset and
    in dumps begun before it was recorded.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> result = dump_features(ext, torch.rand(3, 3, 8, 8), tempfile.mkdtemp(), progress=False)
        >>> inputs = result.manifest.settings.inputs
        >>> inputs.kind, inputs.count, inputs.labelled
        ('dataset', 3, False)
    """

    kind: Literal["files", "dataset", "generated"]
    count: int
    sha256: str
    labelled: bool = False
    identity_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``"inputs"`` object of ``manifest.json`` (``labels`` and ``identity_sha256`` only when set)."""
        record: dict[str, Any] = {"kind": self.kind, "count": self.count, "sha256": self.sha256}
        if self.labelled:  # only then: manifests of unlabelled dumps compare equal to earlier ones
            record["labels"] = True
        if self.identity_sha256 is not None:
            record["identity_sha256"] = self.identity_sha256
        return record


@dataclass(frozen=True)
class Settings:
    """What a dump computes; a resume must match it field by field (``differences``).

    ``shapes``: per layer, in request order, ``(rows, *feature shape)``. ``weights_sha256``: the backbone's
    state dict hashed, ``None`` without an ``nn.Module``, ``UNRECORDED`` in dumps begun before it was recorded.
    ``preprocessing``: the JSON values the image transform describes itself with. ``precision``: what the
    backbone computed in (``FeatureExtractor.precision``); ``dtype`` is what the arrays are stored in. ``shard``: in
    a part of a sharded dump, which rows of which input set its rows are (``None`` in a whole dump).

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> result = dump_features(ext, torch.rand(2, 3, 8, 8), tempfile.mkdtemp(), pool="avg", progress=False)
        >>> settings = result.manifest.settings
        >>> settings.backbone, settings.layers, settings.shapes, settings.dtype, settings.pool
        ('Sequential', ('0',), {'0': (2, 4)}, 'float32', 'avg')
    """

    backbone: str
    weights: str | None
    weights_sha256: str | None | Literal[Unrecorded.UNRECORDED]
    shapes: Mapping[str, tuple[int, ...]]
    dtype: str
    pool: Pool | None
    preprocessing: Mapping[str, Any]
    inputs: InputsRecord
    precision: str = "float32"
    shard: Shard | None = None

    @property
    def layers(self) -> tuple[str, ...]:
        """The layers, in request order."""
        return tuple(self.shapes)

    def differences(self, earlier: Settings) -> list[str]:
        """The fields, named as in ``manifest.json``, in which these settings differ from ``earlier`` ones.

        A field ``earlier`` did not record (``weights_sha256``, ``inputs.identity_sha256``) is left out, so a
        dump begun before it existed is compared on the rest.
        """
        mine = self
        if earlier.weights_sha256 is UNRECORDED:
            mine = replace(mine, weights_sha256=UNRECORDED)
        if earlier.inputs.identity_sha256 is None:
            mine = replace(mine, inputs=replace(mine.inputs, identity_sha256=None))
        return [name for name in _COMPARED if getattr(earlier, name) != getattr(mine, name)]

    def to_dict(self) -> dict[str, Any]:
        """The fields of ``manifest.json`` these settings fill, in its order."""
        fields: dict[str, Any] = {"backbone": self.backbone, "weights": self.weights}
        if self.weights_sha256 is not UNRECORDED:
            fields["weights_sha256"] = self.weights_sha256
        fields["layers"] = list(self.layers)
        fields["shapes"] = {layer: list(shape) for layer, shape in self.shapes.items()}
        fields["dtype"] = self.dtype
        if self.precision != "float32":  # only then: manifests of float32 dumps stay what they always were
            fields["precision"] = self.precision
        fields["pool"] = self.pool
        fields["preprocessing"] = copy.deepcopy(dict(self.preprocessing))
        fields["inputs"] = self.inputs.to_dict()
        if self.shard is not None:  # only then: manifests of whole dumps stay what they always were
            fields["shard"] = self.shard.to_dict()
        return fields


@dataclass(frozen=True)
class SkippedRow:
    """An input that could not be read: its row (zero-filled, ``valid=0`` in ``index.csv``), its path, and why.

    Examples:
        >>> import os, tempfile, torch
        >>> from PIL import Image
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> folder = tempfile.mkdtemp()
        >>> Image.new("RGB", (8, 8)).save(os.path.join(folder, "fine.png"))
        >>> _ = open(os.path.join(folder, "broken.png"), "wb").write(b"not an image")
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> result = dump_features(ext, folder, tempfile.mkdtemp(), num_workers=0, progress=False)
        >>> [(row.row, os.path.basename(row.path), row.reason[:22]) for row in result.manifest.skipped]
        [(0, 'broken.png', 'UnidentifiedImageError')]
    """

    row: int
    path: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says about a dump: its settings, its rows per commit, the library versions that
    began it, and its ``status``: ``"running"`` until every row is committed, then ``"complete"``.

    ``skipped`` lists the rows that could not be read once the dump is complete (``num_rows`` and ``num_valid``
    follow from it and from the settings); it is ``None`` before. ``to_dict()`` is the JSON of ``manifest.json``.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features, read_manifest
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> out = tempfile.mkdtemp()
        >>> _ = dump_features(ext, torch.rand(2, 3, 8, 8), out, pool="avg", progress=False)
        >>> manifest = read_manifest(out)
        >>> manifest.status, manifest.num_rows, manifest.num_valid, manifest.skipped, manifest.files
        ('complete', 2, 2, (), {'0': '0.npy'})
        >>> manifest.settings.shapes, manifest.to_dict()["shapes"]  # typed, and as manifest.json writes it
        ({'0': (2, 4)}, {'0': [2, 4]})
    """

    settings: Settings
    chunk_size: int
    versions: Mapping[str, str]
    status: Literal["running", "complete"] = "running"
    skipped: tuple[SkippedRow, ...] | None = None

    @property
    def num_rows(self) -> int:
        """Rows of every array: one per input."""
        return self.settings.inputs.count

    @property
    def num_valid(self) -> int | None:
        """Rows that hold an input's features (the others are zero-filled), or ``None`` before the dump is complete."""
        return None if self.skipped is None else self.num_rows - len(self.skipped)

    @property
    def files(self) -> dict[str, str]:
        """Each layer's array file, relative to the dump's folder."""
        return {layer: layer_file_name(layer) for layer in self.settings.layers}

    def completed(self, skipped: Iterable[SkippedRow]) -> Manifest:
        """This manifest once every row is committed, ``skipped`` being the rows that could not be read."""
        return replace(self, status="complete", skipped=tuple(skipped))

    def to_dict(self) -> dict[str, Any]:
        """The content of ``manifest.json``: equal to the dict ``from_dict`` was given, keys in the written order."""
        data: dict[str, Any] = {"format": SCHEMA, "status": self.status, **self.settings.to_dict()}
        data["chunk_size"] = self.chunk_size
        data["files"] = self.files
        if self.settings.inputs.labelled:
            data["labels"] = LABELS
        data["index"] = INDEX
        data["versions"] = dict(self.versions)
        if self.skipped is not None:
            data["num_rows"] = self.num_rows
            data["num_valid"] = self.num_valid
            data["skipped"] = [{"row": s.row, "path": s.path, "reason": s.reason} for s in self.skipped]
        return data

    def to_json(self) -> str:
        """The text of ``manifest.json`` (two-space indent, ASCII, a final newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    # -- the dict that read_manifest and DumpResult.manifest were before: for one release, with a warning ----------
    def __getitem__(self, key: str) -> Any:
        """Deprecated: the attribute that holds the field, or ``to_dict()[key]``."""
        return self._as_dict(lambda manifest: f"{manifest}[{key!r}]", key)[key]

    def __contains__(self, key: object) -> bool:
        """Deprecated: ``key in to_dict()``."""
        return key in self._as_dict(lambda manifest: f"{key!r} in {manifest}", key)

    def get(self, key: str, default: Any = None) -> Any:
        """Deprecated: the attribute that holds the field, or ``to_dict().get(key, default)``."""
        return self._as_dict(lambda manifest: f"{manifest}.get({key!r})", key).get(key, default)

    def __iter__(self) -> Iterator[str]:
        """Deprecated: ``iter(to_dict())``."""
        return iter(self._as_dict(lambda manifest: f"iter({manifest})"))

    def keys(self) -> KeysView[str]:
        """Deprecated: ``to_dict().keys()``."""
        return self._as_dict(lambda manifest: f"{manifest}.keys()").keys()

    def values(self) -> ValuesView[Any]:
        """Deprecated: ``to_dict().values()``."""
        return self._as_dict(lambda manifest: f"{manifest}.values()").values()

    def items(self) -> ItemsView[str, Any]:
        """Deprecated: ``to_dict().items()``."""
        return self._as_dict(lambda manifest: f"{manifest}.items()").items()

    def _as_dict(self, spelled: Callable[[str], str], key: object = None) -> dict[str, Any]:
        """``to_dict()``, warning the caller of a dict access (``spelled`` on a name; of field ``key``) what to
        write instead."""
        attribute = _ATTRIBUTES.get(key) if isinstance(key, str) else None
        typed = f"manifest.{attribute} (typed), or " if attribute else ""
        warnings.warn(
            f"{spelled('manifest')}: a dump's manifest is a featurehooks.dump.Manifest, no longer a dict, and its "
            f"dict access stops working in the next release; use {typed}{spelled('manifest.to_dict()')} (the JSON "
            "of manifest.json)",
            FutureWarning,
            stacklevel=3,
        )
        return self.to_dict()

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Manifest | None:
        """The manifest in the file ``path``, or ``None`` when there is no such file.

        Raises:
            CorruptDumpError: the file cannot be read or parsed, or ``from_dict`` refuses its content.
        """
        path = Path(path)
        if not path.is_file():
            return None
        try:
            size = path.stat().st_size
            if size > _MAX_BYTES:
                raise _Unfit(f"it is {size:,} bytes, more than a manifest holds ({_MAX_BYTES:,})")
            data = json.loads(path.read_text(encoding="utf-8"))
            _check_depth(data)
        except RecursionError:  # json's own limit, far above _MAX_DEPTH
            raise CorruptDumpError(
                f"{path} is not a readable manifest (it nests more than {_MAX_DEPTH} levels deep); {START_OVER}"
            ) from None
        except (OSError, ValueError, _Unfit) as exc:
            raise CorruptDumpError(f"{path} is not a readable manifest ({exc}); {START_OVER}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Any, source: str | os.PathLike[str] = MANIFEST) -> Manifest:
        """Check ``data``, a parsed ``manifest.json``, and build the manifest it describes.

        Raises:
            CorruptDumpError: ``data`` is not a manifest of this schema, or a field is missing, unknown, mistyped
                or inconsistent with the others (rows per layer and ``inputs.count``, ``files`` and ``layers``,
                the row accounting of a complete dump); the message names ``source`` and the field.
        """
        schema = data.get("format") if isinstance(data, dict) else None
        if isinstance(schema, str) and schema != SCHEMA and schema.startswith("featurehooks.dump/"):
            raise CorruptDumpError(
                f"{os.fspath(source)} is a dump manifest of schema {schema!r}, but this featurehooks reads {SCHEMA!r}; "
                f"use the featurehooks that wrote it, or {START_OVER}"
            )
        if schema != SCHEMA:
            raise CorruptDumpError(f"{os.fspath(source)} is not a featurehooks dump manifest; {START_OVER}")
        try:
            return _parse(data)
        except _Unfit as exc:
            raise CorruptDumpError(f"{os.fspath(source)}: {exc} (edited by hand?); {START_OVER}") from None


class _Unfit(Exception):
    """Why a manifest's content is unfit; ``Manifest.from_dict`` turns it into a ``CorruptDumpError``."""


def _check_depth(data: Any) -> None:
    """Refuse JSON ``data`` whose lists and objects nest deeper than ``_MAX_DEPTH`` (walked without recursion)."""
    level: list[Any] = [data]
    for _ in range(_MAX_DEPTH):
        level = [item for value in level for item in _children(value)]
        if not level:
            return
    raise _Unfit(f"it nests more than {_MAX_DEPTH} levels deep")


def _children(value: Any) -> Iterable[Any]:
    """The items of a JSON list or the values of a JSON object; nothing for a scalar."""
    if isinstance(value, dict):
        return value.values()
    return value if isinstance(value, list) else ()


def _field(data: Mapping[str, Any], key: str, where: str = "") -> Any:
    """``data[key]``, which must be there (``where`` prefixes the field's name in the message)."""
    if key not in data:
        raise _Unfit(f"{where}{key} is missing")
    return data[key]


def _text(data: Mapping[str, Any], key: str, *, nullable: bool = False, where: str = "") -> Any:
    """``data[key]``, which must be a string (or ``None`` when ``nullable``)."""
    value = _field(data, key, where)
    if not isinstance(value, str) and not (nullable and value is None):
        raise _Unfit(f"{where}{key} {value!r} is not a string{' or null' if nullable else ''}")
    return value


def _pool(data: Mapping[str, Any]) -> Pool | None:
    """``data["pool"]``: null, "avg", "max" or "cls"."""
    try:
        return as_pool(_text(data, "pool", nullable=True))
    except InvalidValueError as exc:
        raise _Unfit(str(exc)) from None


def _known(data: Mapping[str, Any], known: Collection[str], where: str = "") -> None:
    """Refuse fields this schema does not have: ``to_dict`` could not give them back."""
    unknown = [f"{where}{key}" for key in data if key not in known]
    if unknown:
        raise _Unfit(f"unknown field(s) {', '.join(map(repr, unknown))}")


def _parse(data: dict[str, Any]) -> Manifest:
    """The manifest ``data`` describes (its ``format`` checked), or ``_Unfit``."""
    status = _field(data, "status")
    if status not in _STATUSES:
        raise _Unfit(f"status {status!r} is neither 'running' nor 'complete'")
    chunk_size = _field(data, "chunk_size")
    if not is_count(chunk_size, 1):
        raise _Unfit(f"chunk_size {chunk_size!r} is not a positive integer")
    raw_inputs = _field(data, "inputs")
    count = raw_inputs.get("count") if isinstance(raw_inputs, dict) else None
    if not is_count(count, 1):
        raise _Unfit(f"inputs.count {count!r} is not a positive integer")
    shapes = _shapes(data, count)
    if _field(data, "files") != {layer: layer_file_name(layer) for layer in shapes}:
        raise _Unfit("files does not map each layer to its <layer>.npy")
    dtype = _field(data, "dtype")
    if dtype not in DTYPES:
        raise _Unfit(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    precision = data.get("precision", "float32")
    if "precision" in data and precision not in PRECISIONS[1:]:
        raise _Unfit(f"precision {precision!r} is not one of {', '.join(PRECISIONS[1:])} (float32 is not written)")
    accounted = status == "complete" or any(key in data for key in _ACCOUNT)  # kept when marked running again
    skipped = _skipped(data, count) if accounted else None
    inputs = _inputs(raw_inputs, count)
    weights_sha256 = data.get("weights_sha256", UNRECORDED)
    if weights_sha256 is not UNRECORDED:
        _text(data, "weights_sha256", nullable=True)
    preprocessing = _field(data, "preprocessing")
    if not isinstance(preprocessing, dict):
        raise _Unfit(f"preprocessing is a {type(preprocessing).__name__}, not an object")
    settings = Settings(
        backbone=_text(data, "backbone"),
        weights=_text(data, "weights", nullable=True),
        weights_sha256=weights_sha256,
        shapes=shapes,
        dtype=dtype,
        pool=_pool(data),
        preprocessing=copy.deepcopy(preprocessing),
        inputs=inputs,
        precision=precision,
        shard=_shard(data["shard"], count) if "shard" in data else None,
    )
    labels = data.get("labels")
    if inputs.labelled and labels != LABELS:
        raise _Unfit(f"labels {labels!r} is not {LABELS!r}, though inputs.labels is true")
    if not inputs.labelled and "labels" in data:
        raise _Unfit(f"labels {labels!r} is set, though inputs.labels is not")
    if _field(data, "index") != INDEX:
        raise _Unfit(f"index {data['index']!r} is not {INDEX!r}")
    versions = _field(data, "versions")
    if not isinstance(versions, dict) or not all(isinstance(value, str) for value in versions.values()):
        raise _Unfit("versions is not an object of version strings")
    _known(data, _FIELDS)
    return Manifest(settings, chunk_size, dict(versions), status, skipped)


def _shapes(data: Mapping[str, Any], count: int) -> dict[str, tuple[int, ...]]:
    """Each layer's shape, ``layers`` and ``shapes`` checked against each other and ``count`` rows."""
    layers = _field(data, "layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(name, str) for name in layers):
        raise _Unfit(f"layers {layers!r} is not a list of names")
    if len(set(layers)) < len(layers):
        raise _Unfit(f"layers {layers!r} repeats a name")
    shapes = _field(data, "shapes")
    if not isinstance(shapes, dict) or list(shapes) != layers:
        raise _Unfit(f"shapes does not list the layers {layers}")
    for layer, shape in shapes.items():
        if not isinstance(shape, list) or not shape or shape[0] != count or not all(is_count(n) for n in shape):
            raise _Unfit(f"shapes[{layer!r}] {shape!r} is not [{count}, ...] (inputs.count rows, then sizes)")
    return {layer: tuple(shape) for layer, shape in shapes.items()}


def _inputs(raw: dict[str, Any], count: int) -> InputsRecord:
    """The ``"inputs"`` object, its ``count`` already checked."""
    kind = _field(raw, "kind", "inputs.")
    if kind not in _KINDS:
        raise _Unfit(f"inputs.kind {kind!r} is neither 'files' nor 'dataset'")
    digest = _text(raw, "sha256", where="inputs.")
    labelled = raw.get("labels", False)
    if "labels" in raw and labelled is not True:
        raise _Unfit(f"inputs.labels {labelled!r} is not true (the field is written only for labelled items)")
    identity = raw.get("identity_sha256")
    if "identity_sha256" in raw:
        _text(raw, "identity_sha256", where="inputs.")
    _known(raw, _INPUTS_FIELDS, "inputs.")
    return InputsRecord(kind, count, digest, labelled, identity)


def _shard(raw: Any, count: int) -> Shard:
    """The ``"shard"`` object of a part, its rows ``inputs.count``."""
    try:
        shard = Shard.from_dict(raw)
    except InvalidValueError as exc:
        raise _Unfit(str(exc)) from None
    if shard.stop - shard.start != count:
        raise _Unfit(f"shard rows {shard.start}:{shard.stop} are not inputs.count ({count}) rows")
    return shard


def _skipped(data: Mapping[str, Any], count: int) -> tuple[SkippedRow, ...]:
    """The skipped rows, ``num_rows`` and ``num_valid`` checked against them and ``count``."""
    num_rows, skipped = data.get("num_rows"), data.get("skipped")
    if not is_count(num_rows) or num_rows != count:
        raise _Unfit(f"num_rows {num_rows!r} is not inputs.count ({count})")
    if not isinstance(skipped, list) or not all(_is_skipped_row(entry, count) for entry in skipped):
        raise _Unfit("skipped is not a list of {row, path, reason} within the rows")
    if len({entry["row"] for entry in skipped}) < len(skipped):
        raise _Unfit("skipped lists a row twice")
    num_valid = data.get("num_valid")
    if not is_count(num_valid) or num_valid != count - len(skipped):
        raise _Unfit(f"num_valid {num_valid!r} is not num_rows minus the skipped rows")
    return tuple(SkippedRow(entry["row"], entry["path"], entry["reason"]) for entry in skipped)


def _is_skipped_row(entry: Any, count: int) -> bool:
    """Whether ``entry`` is a ``{row, path, reason}`` of one of ``count`` rows (and nothing else)."""
    return (
        isinstance(entry, dict)
        and set(entry) == {"row", "path", "reason"}
        and is_count(entry["row"])
        and entry["row"] < count
        and isinstance(entry["path"], str)
        and isinstance(entry["reason"], str)
    )
