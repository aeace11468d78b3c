"""Sources of the input pipeline: what the rows of a source are (listed image files, rows of container files, the
items of a dataset or tensor, or a generator's images) and how one row is decoded (reading files lives in
``featurehooks.images``, rows of ZIP archives, tar shards and arrays in ``members``, a generator's in ``generated``).

Every input becomes one row. A file that cannot be decoded still owns its row (zero-filled and
marked invalid), so row numbers depend only on the sorted input list, never on which files failed.
``resolve_inputs`` turns a source into ``Inputs``: the rows, the shape every row gets, the transform.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from ..errors import InputNotFoundError, InvalidTypeError, InvalidValueError
from ..images import ImageTransform, check_input_size, to_input_range, transform_for
from .archives import IMAGE_SUFFIXES, TarShard
from .generated import GeneratedImages, GeneratedRows, fingerprint, row_names
from .members import container_of, identity_path, opened, read_row, row_size

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from .sharding import Distributed

__all__ = [
    "IMAGE_SUFFIXES",
    "DatasetLayout",
    "ImageFiles",
    "Inputs",
    "Sample",
    "SourceSpec",
    "TensorRows",
    "dataset_layout",
    "file_identity",
    "first_tensor",
    "generated_inputs",
    "inputs_digest",
    "item_label",
    "list_images",
    "planned_on_main",
    "resolve_inputs",
]

SourceSpec = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Dataset, Tensor, GeneratedImages]
_GLOB_CHARS = set("*?[")
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
_MAX_EXPANDED = 1_000_000  # names one brace pattern may stand for
_PROBE_LIMIT = 64  # dataset items tried for the image shape before the dump is refused
_INT64 = (-(2**63), 2**63 - 1)


@dataclass
class Sample:
    """One decoded row number ``row``: ``image`` (C, H, W) float, or a placeholder with ``reason`` saying why the
    row is invalid (zeros, or ``None`` when nothing is to be computed for it).

    ``label`` is the integer label of an ``(image, label)`` dataset item, ``None`` without one or for an invalid row.
    """

    row: int
    image: Tensor | None
    reason: str
    label: int | None = None


def _glob(pattern: str) -> list[str]:
    """Entries but folders matching ``pattern``, like ``glob.glob`` without following symlinked folders for ``**``.

    ``glob.glob`` follows them, so a symlink cycle lists every file dozens of times, and two make it
    run for ever. As in ``glob``, hidden names match only a pattern that names a hidden part itself.
    """
    parts = Path(pattern).parts
    literal = next(i for i, part in enumerate(parts) if _GLOB_CHARS & set(part))
    root, rest = Path(*parts[:literal]), parts[literal:]
    if rest[-1] == "**":  # glob's "dir/**" lists the files below dir; pathlib's only the folders
        rest = (*rest, "*")
    hidden_ok = any(part.startswith(".") for part in rest)
    return sorted(
        str(path)
        for path in root.glob(str(Path(*rest)))
        if not path.is_dir() and (hidden_ok or not any(p.startswith(".") for p in path.relative_to(root).parts))
    )


def expand_braces(pattern: str) -> list[str]:
    """``pattern`` with each ``{a,b}`` and ``{000..009}`` group expanded, left to right, as bash and WebDataset
    (``braceexpand``) expand them: a range keeps the zero padding of its bounds, and counts down when they do.

    ``shards/{000000..000002}.tar`` is three names; a group of neither form stays as written.
    """
    for group in _BRACES.finditer(pattern):
        span = _RANGE.fullmatch(group[1])
        if span:
            first, last = int(span[1]), int(span[2])
            padded = any(bound.lstrip("-").startswith("0") and len(bound.lstrip("-")) > 1 for bound in span.groups())
            width = max(len(span[1]), len(span[2])) if padded else 0
            step = 1 if last >= first else -1
            numbers = range(first, last + step, step)
            if len(numbers) > _MAX_EXPANDED:
                raise _too_many(pattern)
            choices = [f"{number:0{width}d}" for number in numbers]
        elif "," in group[1]:
            choices = group[1].split(",")
        else:
            continue
        head, tail = pattern[: group.start()], pattern[group.end() :]
        names: list[str] = []
        for choice in choices:
            names.extend(expand_braces(head + choice + tail))
            if len(names) > _MAX_EXPANDED:
                raise _too_many(pattern)
        return names
    return [pattern]


def _too_many(pattern: str) -> InvalidValueError:
    return InvalidValueError(f"{pattern!r} stands for more than {_MAX_EXPANDED} names")


def _expand(item: str | os.PathLike[str]) -> list[str]:
    """The absolute names of the rows ``item`` stands for (see ``list_images``)."""
    text = os.fspath(item)
    found = container_of(text)
    if found is not None:
        return _container_rows(*found)
    if not os.path.exists(text):
        names = expand_braces(text)
        if names != [text]:
            return [row for name in names for row in _expand(name)]
    if _GLOB_CHARS & set(text) and not os.path.exists(text):  # "photo [1].jpg" is a file, not a pattern
        matched = _glob(text)
        if not matched:
            raise InputNotFoundError(f"no files match {text!r}")
        return [row for name in matched for row in _matched(name)]
    path = Path(text)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and not p.is_dir())
        if not files:
            raise InputNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES[:4])}, ...) under {text}")
        return [os.path.abspath(file) for file in files]
    if not path.exists():
        raise InputNotFoundError(f"no such file or folder: {text}")
    return [os.path.abspath(text)]


def _matched(name: str) -> list[str]:
    """What a glob's match stands for: a container's rows, else the entry itself (whatever it is)."""
    found = container_of(name)
    return _container_rows(*found) if found is not None else [os.path.abspath(name)]


def _container_rows(path: str, inner: str | None) -> list[str]:
    """The names of the rows of container ``path`` that ``inner`` names (all of them for ``None``)."""
    container = opened(path)
    if isinstance(container, TarShard) and container.truncated_at is not None and inner is None:
        warnings.warn(
            f"{path} is truncated at byte {container.truncated_at}: the samples after it are not listed",
            stacklevel=2,
        )
    return [f"{path}/{name}" for name in container.names(inner)]


def list_images(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Absolute paths of the images in ``source``, in a deterministic order.

    ``source`` is a folder (searched recursively for common image suffixes), a glob pattern, a file,
    a container file, a brace pattern (``shards/{000000..000009}.tar``), or a list of any of these. Each
    folder or glob is sorted; the items keep the order given.
    Files listed explicitly are kept whatever their suffix (an unreadable one is reported later).
    Every entry but a folder is listed, so what is not a regular file (a FIFO, a socket, a device, a
    dangling link) becomes an invalid row that names why (``read_image`` never opens it), not a lost one.
    A path that exists is taken literally even if it contains ``*?[{`` (``photo [1].jpg``). Neither
    folders nor ``**`` follow symlinked folders, so a symlink cycle cannot repeat files or run for ever.

    A container file, given or matched by a glob (not found in a folder), stands for its rows, each named
    ``<container>/<inner>``: the image members of a ZIP archive (``x.zip/dir/a.png``, sorted), the samples
    of a WebDataset tar shard (``s.tar/<key>``, in the shard's order), the images of a ``.npy`` array
    (``x.npy/<row>``) or of one array of an ``.npz`` (``x.npz/<key>/<row>``; ``arr_0`` unless the source names
    another, ``x.npz/<key>``). A source may name part of a container (``x.zip/dir``, ``x.zip/dir/a.png``,
    ``s.tar/<key>``, ``x.npy/3``), so a list of row names lists those rows again.

    Examples:
        >>> import pathlib, tempfile
        >>> from featurehooks.dump import list_images
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("b.png", "a/c.JPG", "notes.txt"):
        ...     (root / name).parent.mkdir(exist_ok=True)
        ...     _ = (root / name).write_bytes(b"")
        >>> [pathlib.Path(path).relative_to(root).as_posix() for path in list_images(root)]
        ['a/c.JPG', 'b.png']
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise InvalidValueError("no inputs given: pass a folder, a glob pattern or a list of image paths")
    paths: list[str] = []
    for item in items:
        paths.extend(_expand(item))
    return paths


def inputs_digest(names: Sequence[str]) -> str:
    """SHA-256 of the input list, to check that a resumed dump sees the same inputs in the same order."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(eq=False)
class ImageFiles(Dataset):
    """Rows of image files, decoded and prepared by ``transform``; failures become invalid rows.

    Every row must come out as ``shape``, unless ``any_size`` (pooled features need no common size).
    """

    paths: Sequence[str]
    transform: ImageTransform
    shape: tuple[int, ...]
    any_size: bool = False

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Sample:
        try:
            image = self.transform(read_row(self.paths[index]))
        except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
            return Sample(index, torch.zeros(self.shape), _describe(exc))
        if tuple(image.shape) != self.shape and not self.any_size:
            reason = f"size {tuple(image.shape)} differs from {self.shape}; set a crop"
            return Sample(index, torch.zeros(self.shape), reason)
        return Sample(index, image, "")


@dataclass(eq=False)
class TensorRows(Dataset):
    """Rows of a user's dataset of image tensors (or tuples whose first item is one, and second the label).

    Float tensors are taken as they are (already in ``input_range``); ``uint8`` tensors hold 0..255
    pixels, as ``torchvision.io.decode_image`` returns them, and are scaled to ``input_range`` like image files.
    With ``labelled``, every row carries its item's integer label (a row without one is invalid). An item that
    raises is an invalid row, unless ``strict``: a generator's error stops the run (its stream cannot go on).
    """

    dataset: Dataset
    shape: tuple[int, ...]
    input_range: tuple[float, float] = (0.0, 1.0)
    labelled: bool = False
    strict: bool = False

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Sample:
        try:
            item = self.dataset[index]
            image = first_tensor(item)
            _check_pixel_dtype(image)
            label = item_label(item) if self.labelled else None
        except Exception as exc:  # a user's dataset may raise anything for a bad item
            if self.strict:
                raise
            return Sample(index, torch.zeros(self.shape), _describe(exc))
        if tuple(image.shape) != self.shape:
            return Sample(index, torch.zeros(self.shape), f"shape {tuple(image.shape)} differs from {self.shape}")
        if image.dtype == torch.uint8:
            return Sample(index, to_input_range(image, self.input_range), "", label)
        return Sample(index, image.float(), "", label)


@dataclass(frozen=True)
class DatasetLayout:
    """What every row of a dataset shares: the image shape, and whether items carry integer labels."""

    shape: tuple[int, ...]
    labelled: bool


def dataset_layout(dataset: Dataset) -> DatasetLayout:
    """The layout of the first item that can be read (items that raise are skipped: they become invalid rows).

    Raises:
        ValueError: the dataset is empty, or none of its first items could be read.
        TypeError: an item is not an image tensor (or a tuple starting with one) of ``uint8`` or floats;
            that is true of every row, so the dump is refused at once.
    """
    count = len(dataset)  # type: ignore[arg-type]
    if count == 0:
        raise InvalidValueError("the dataset is empty")
    errors: list[str] = []
    for index in range(min(count, _PROBE_LIMIT)):
        try:
            item = dataset[index]
        except Exception as exc:  # a user's dataset may raise anything for a bad item
            errors.append(f"item {index}: {_describe(exc)}")
            continue
        image = first_tensor(item)
        _check_pixel_dtype(image)
        return DatasetLayout(tuple(image.shape), _has_label(item))
    raise InvalidValueError(f"none of the first {len(errors)} dataset items could be read ({errors[0]})")


def first_tensor(item: Any) -> Tensor:
    """The image tensor of a dataset item: the item itself, or the first element of a tuple/list."""
    if isinstance(item, (tuple, list)) and item:
        item = item[0]
    if not isinstance(item, Tensor):
        raise InvalidTypeError(f"dataset items must be image tensors (C, H, W), got {type(item).__name__}")
    return item


def _check_pixel_dtype(image: Tensor) -> None:
    """Refuse integer images other than ``uint8``: their scale is unknown (0..255? 0..65535?)."""
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise InvalidTypeError(f"dataset images must be uint8 pixels or floats in input_range, got {image.dtype}")


def item_label(item: Any) -> int:
    """The label of an ``(image, label)`` item: an int (numpy's too) or a one-element integer tensor."""
    if not isinstance(item, (tuple, list)) or len(item) < 2:
        raise InvalidValueError("the item has no label; expected (image, label)")
    label = item[1]
    if isinstance(label, Tensor) and label.numel() == 1 and not (label.is_floating_point() or label.is_complex()):
        label = label.item()
    if not isinstance(label, numbers.Integral):
        raise InvalidTypeError(f"a label must be an int or a one-element integer tensor, got {type(label).__name__}")
    value = int(label)
    if not _INT64[0] <= value <= _INT64[1]:
        raise InvalidValueError(f"label {value} does not fit in int64")
    return value


def _has_label(item: Any) -> bool:
    """Whether ``item`` is ``(image, label)`` with an integer label (other targets, e.g. boxes, are not stored)."""
    try:
        item_label(item)
    except (TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Inputs:
    """The rows of a source: their names, the dataset (for tensor sources and generators), the prepared image
    shape, their identity (for files size and mtime, to notice files replaced before a resume; for a generator its
    first image's ``fingerprint`` in every row, to notice other images), whether the dataset's items carry integer
    labels, whether images may differ in size (pooled, uncropped files: ``image_shape`` is then the first readable
    image's, which gives the features' shapes), and whether a generator makes them (``generated``: read in this
    process, in order, an error stopping the run)."""

    names: list[str]
    dataset: Dataset | None
    image_shape: tuple[int, ...]
    transform: ImageTransform | None
    identity: np.ndarray | None = None
    labelled: bool = False
    sizes_vary: bool = False
    generated: bool = False

    def rows(self, input_range: tuple[float, float]) -> ImageFiles | TensorRows:
        """The dataset that decodes row ``i`` into a ``Sample`` (``uint8`` tensors scaled to ``input_range``)."""
        if self.dataset is not None:
            return TensorRows(
                self.dataset, self.image_shape, input_range, labelled=self.labelled, strict=self.generated
            )
        return ImageFiles(self.names, self.transform, self.image_shape, any_size=self.sizes_vary)  # type: ignore[arg-type]

    def pixels(self, row: int) -> int:
        """Height × width of row ``row`` once prepared: ``image_shape``'s, or where sizes vary, the file header's
        through the transform (0 for a file whose header cannot be read: it becomes an invalid row)."""
        if not self.sizes_vary or self.transform is None:
            return self.image_shape[-2] * self.image_shape[-1]
        try:
            height, width = self.transform.prepared_size(*row_size(self.names[row]))
        except Exception:  # noqa: BLE001 - unreadable: reported as an invalid row when it is decoded
            return 0
        return height * width


def _dataset_names(dataset: Dataset) -> list[str]:
    """The rows' names of a dataset source: its indices."""
    return [f"dataset[{i}]" for i in range(len(dataset))]  # type: ignore[arg-type]


T = TypeVar("T")  # what rank 0 plans beside the inputs (a dump's plan)


@dataclass(frozen=True)
class _SharedInputs:
    """What rank 0 sends the other ranks of ``Inputs``: the file names it listed (``None`` for a dataset or a
    generator, which every rank holds itself), the image shape and transform; for a generator, the range its
    floats are checked against."""

    names: list[str] | None
    image_shape: tuple[int, ...]
    transform: ImageTransform | None
    labelled: bool
    sizes_vary: bool
    generated_range: tuple[float, float] | None = None

    def inputs(self, source: SourceSpec) -> Inputs:
        if isinstance(source, GeneratedImages) and self.generated_range is not None:
            rows = GeneratedRows(source, self.generated_range, self.image_shape)  # each rank draws its own rows
            return Inputs(row_names(len(source)), rows, self.image_shape, None, generated=True)
        if self.names is not None:
            return Inputs(self.names, None, self.image_shape, self.transform, sizes_vary=self.sizes_vary)
        dataset = TensorDataset(source) if isinstance(source, Tensor) else source
        return Inputs(_dataset_names(dataset), dataset, self.image_shape, None, labelled=self.labelled)  # type: ignore[arg-type]


def planned_on_main(ranks: Distributed, source: SourceSpec, plan: Callable[[], tuple[T, Inputs]]) -> tuple[T, Inputs]:
    """``plan()`` (which resolves ``source``) on rank 0 only, its value and inputs on every rank: the ranks
    share one listing of the files, so a folder that changes meanwhile cannot give them different rows."""

    def on_main() -> tuple[T, _SharedInputs]:
        value, inputs = plan()
        names = inputs.names if inputs.dataset is None else None
        generated_range = inputs.dataset.input_range if isinstance(inputs.dataset, GeneratedRows) else None
        shared = _SharedInputs(
            names, inputs.image_shape, inputs.transform, inputs.labelled, inputs.sizes_vary, generated_range
        )
        return value, shared

    if ranks.world_size == 1:
        return plan()
    value, shared = ranks.from_main(on_main)
    return value, shared.inputs(source)


def file_identity(names: list[str]) -> np.ndarray:
    """``(N, 2)`` size and modification time (ns) of each file, of its container for a container's row (so a
    replaced archive changes every row of it); ``-1`` where a file cannot be stat'ed."""
    identity = np.full((len(names), 2), -1, dtype=np.int64)
    is_file = functools.lru_cache(maxsize=None)(os.path.isfile)  # one stat per container, not per row
    stamps: dict[str, tuple[int, int] | None] = {}
    for row, name in enumerate(names):
        path = identity_path(name, is_file)
        if path not in stamps:
            try:
                info = os.stat(path)
                stamps[path] = (info.st_size, info.st_mtime_ns)
            except OSError:  # reported as an invalid row when it is read
                stamps[path] = None
        stamp = stamps[path]
        if stamp is not None:
            identity[row] = stamp
    return identity


def resolve_inputs(
    extractor: FeatureExtractor,
    source: SourceSpec,
    resize_size: int | str | None,
    crop_size: int | str | None,
    pool: str | None,
) -> Inputs:
    """List the rows of ``source`` (sorted files, a dataset/tensor, or generated images) and the image shape every
    row gets."""
    if isinstance(source, GeneratedImages):
        return generated_inputs(source, extractor.input_range)
    if isinstance(source, Tensor):
        if source.dim() != 4:
            raise InvalidValueError(f"a tensor source must be a batch (N, C, H, W), got shape {tuple(source.shape)}")
        source = TensorDataset(source)
    if isinstance(source, Dataset):
        layout = dataset_layout(source)  # the first readable item: one that raises is an invalid row
        return Inputs(_dataset_names(source), source, layout.shape, None, labelled=layout.labelled)
    if not isinstance(source, (str, os.PathLike, list, tuple)):
        raise InvalidTypeError(
            "source must be a folder, glob, path, list of paths, Dataset, (N, C, H, W) tensor or GeneratedImages, "
            f"not {type(source).__name__}"
        )
    names = list_images(source)
    transform = transform_for(extractor.preprocessing, extractor.input_range, resize_size, crop_size)
    shape: tuple[int, ...] | None = transform.output_shape()
    if shape is None:  # no crop: the first readable image's shape gives the features' shapes
        if pool is None:
            _check_one_size(names, transform)
        for name in names:
            try:
                shape = tuple(transform(read_row(name)).shape)
                break
            except Exception:  # unreadable: it is reported as an invalid row later
                continue
        else:
            raise InvalidValueError(f"none of the {len(names)} inputs could be decoded")
    if transform.crop_size is not None or pool is None:  # one size for every row
        check_input_size(extractor, shape[-2:])
    return Inputs(names, None, shape, transform, file_identity(names), sizes_vary=pool is not None)


def generated_inputs(source: GeneratedImages, input_range: tuple[float, float]) -> Inputs:
    """The rows of a generator: its first batch (drawn once, kept for the rows) gives the image shape, and the
    ``fingerprint`` of its first image (two int64 in every row of ``identity``; the image, not the batch, so that
    a generator drawing batches of another size names the same images) what a resume checks."""
    first = source.first_batch()
    stamp = np.frombuffer(bytes.fromhex(fingerprint(first[:1]))[:16], dtype="<i8")
    identity = np.tile(stamp.astype(np.int64), (len(source), 1))
    shape = tuple(first.shape[1:])
    rows = GeneratedRows(source, input_range, shape)
    return Inputs(row_names(len(source)), rows, shape, None, identity, generated=True)


def _check_one_size(names: list[str], transform: ImageTransform) -> None:
    """Spatial maps of every row share one shape: refuse, while planning, images that would differ."""
    first: tuple[str, tuple[int, int]] | None = None
    for name in names:
        try:
            size = transform.prepared_size(*row_size(name))
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
