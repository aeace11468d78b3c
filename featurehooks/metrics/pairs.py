"""Scoring pairs of images from two folders with a pairwise metric such as LPIPS or DISTS.

``pair_files`` matches the images of two folders by their path relative to each folder;
``score_pairs`` streams the pairs through the input pipeline dumps use (``featurehooks._stream``:
decoding in worker processes while the metric runs) and returns one score per pair, in order. Images
are read and prepared by ``featurehooks.images``, as dumps read them.

A batch is bounded by pixels as well as by pairs: a forward's memory grows with the pixels it
holds (LPIPS on VGG keeps activations of about 1.7 GB per megapixel pair), so large images get
smaller batches, down to one pair. Where batches end depends only on the images' sizes and the two
bounds, never on the number of workers or on timing.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple, overload

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info
from torchvision.transforms import InterpolationMode
from typing_extensions import Unpack

from .._stream import (
    Progress,
    Sample,
    Streaming,
    StreamOptions,
    feature_batches,
    list_images,
    loader_workers,
    pixel_pieces,
    placement,
    row_loader,
)
from ..errors import InputNotFoundError, InvalidTypeError, InvalidValueError, first_line
from ..images import ImageTransform, read_image

__all__ = ["BATCH_PIXELS", "ImagePair", "PairsWithin", "pair_files", "pairs_within", "score_pairs"]

PairMetric = Callable[[Tensor, Tensor], Tensor]

BATCH_PIXELS = 2**20
"""Default pixel budget of a batch of pairs: the sum of height × width (of one image of each pair, after
resize and crop). 16 pairs of 256 × 256, 4 of 512 × 512, one of 1024 × 1024; a larger pair is scored alone.

Examples:
    >>> from featurehooks.metrics import BATCH_PIXELS
    >>> BATCH_PIXELS // (256 * 256), BATCH_PIXELS // (1024 * 1024)
    (16, 1)
"""

_NAMED_SKIPS = 3  # inputs named in the warning about unreadable entries; the rest are counted


class ImagePair(NamedTuple):
    """Two image files with the same relative path ``name`` under two folders (``a`` and ``b`` are absolute).

    Examples:
        >>> from featurehooks.metrics import ImagePair
        >>> pair = ImagePair("cat/0001.png", "/data/outputs/cat/0001.png", "/data/references/cat/0001.png")
        >>> pair.name, pair.b
        ('cat/0001.png', '/data/references/cat/0001.png')
    """

    name: str
    a: str
    b: str


class _Listed(NamedTuple):
    """An entry of a folder: its relative path, absolute path, and why it cannot be read ("" for an image file)."""

    name: str
    path: str
    reason: str


def _images_by_name(folder: str | os.PathLike[str], ignore_suffix: bool) -> dict[str, _Listed]:
    """``{key: entry}`` of the images under ``folder`` and of what only looks like one; relative paths use ``/``.

    The entries are what ``list_images`` finds, as for a dump. Those that are not regular files (a FIFO,
    a socket, a device, a dangling link) carry the reason ``read_image`` refuses them for, so that they are
    reported, not lost; only their ``stat`` is read.
    """
    root = Path(folder)
    if not root.is_dir():
        kind = "is not a folder" if root.exists() else "does not exist"
        raise InputNotFoundError(f"{os.fspath(folder)} {kind}; pass two folders of images")
    base = os.path.abspath(root)
    found: dict[str, _Listed] = {}
    for path in list_images(root):
        reason = "" if os.path.isfile(path) else _refusal(path)
        name = Path(os.path.relpath(path, base)).as_posix()
        key = name.rsplit(".", 1)[0] if ignore_suffix and "." in Path(name).name else name
        if key in found:
            raise InvalidValueError(
                f"{found[key].path} and {path} both match {key!r} with ignore_suffix=True; keep one of them"
            )
        found[key] = _Listed(name, path, reason)
    return found


def _refusal(path: str) -> str:
    """Why ``read_image`` refuses ``path``, in the words a dump records for an invalid row.

    ``read_image`` checks the file's ``stat`` before it opens anything, so a FIFO or a device is refused
    without being opened (it could block for ever).
    """
    try:
        read_image(path)
    except Exception as exc:  # noqa: BLE001 - whatever read_image raises is the reason, as for a dump's rows
        return first_line(exc)
    return "not a regular file when the folder was listed"


def _warn_unreadable(unreadable: list[_Listed]) -> None:
    if not unreadable:
        return
    named = "; ".join(f"{entry.path}: {entry.reason}" for entry in unreadable[:_NAMED_SKIPS])
    more = f" and {len(unreadable) - _NAMED_SKIPS} more" if len(unreadable) > _NAMED_SKIPS else ""
    warnings.warn(
        f"{len(unreadable)} input(s) could not be read and are left out of the pairs ({named}{more})", stacklevel=3
    )


def pair_files(
    dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str], *, ignore_suffix: bool = False
) -> tuple[list[ImagePair], list[str], list[str]]:
    """Pair the images of two folders by their path relative to each folder (searched recursively).

    An entry with an image suffix that is not a regular file (a FIFO, a socket, a device, a dangling
    link) is never opened; it is left out with a warning that names it and the reason (``not a regular
    file: fifo``), as a dump reports its unreadable inputs, and so is the pair it would belong to.

    Args:
        dir_a: the first folder (e.g. generated images).
        dir_b: the second folder (e.g. references).
        ignore_suffix: match ``x/0001.png`` with ``x/0001.jpg`` (the name without its suffix);
            two images of one folder with the same name then are an error.

    Returns:
        ``(pairs, only_in_a, only_in_b)``: the pairs sorted by relative path (named as in ``dir_a``),
        and the relative paths of the images found in one folder only (sorted).

    Raises:
        InputNotFoundError: a folder does not exist or holds no images.
        InvalidValueError: two images of one folder match one name with ``ignore_suffix``.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import pair_files
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("outputs/cat/0001.png", "references/cat/0001.png", "references/cat/0002.png"):
        ...     (root / name).parent.mkdir(parents=True, exist_ok=True)
        ...     save_image(torch.rand(3, 32, 32), root / name)
        >>> pairs, only_a, only_b = pair_files(root / "outputs", root / "references")
        >>> [pair.name for pair in pairs], only_a, only_b
        (['cat/0001.png'], [], ['cat/0002.png'])
    """
    in_a, in_b = _images_by_name(dir_a, ignore_suffix), _images_by_name(dir_b, ignore_suffix)
    unreadable = sorted(
        (entry for entry in (*in_a.values(), *in_b.values()) if entry.reason), key=lambda entry: entry.path
    )
    _warn_unreadable(unreadable)
    readable = {key for key in in_a.keys() & in_b.keys() if not (in_a[key].reason or in_b[key].reason)}
    pairs = [ImagePair(in_a[key].name, in_a[key].path, in_b[key].path) for key in sorted(readable)]
    only_in_a = sorted(in_a[key].name for key in in_a.keys() - in_b.keys() if not in_a[key].reason)
    only_in_b = sorted(in_b[key].name for key in in_b.keys() - in_a.keys() if not in_b[key].reason)
    return pairs, only_in_a, only_in_b


class PairsWithin(Sequence[ImagePair]):
    """Every pair ``(i, j)``, ``i < j``, of a list of images (or each image with the next only, ``consecutive``),
    in the order ``lpips_1dir_allpairs.py`` scores them: ``(0, 1), (0, 2), ..., (1, 2), ...``. Pairs are made when
    asked for, so ``N (N - 1) / 2`` of them cost no memory; each is named ``(a,b)`` as the script prints it.

    Examples:
        >>> from featurehooks.metrics.pairs import PairsWithin
        >>> pairs = PairsWithin(["/x/a.png", "/x/b.png", "/x/c.png"], ["a.png", "b.png", "c.png"])
        >>> len(pairs), [pair.name for pair in pairs]
        (3, ['(a.png,b.png)', '(a.png,c.png)', '(b.png,c.png)'])
    """

    def __init__(self, paths: Sequence[str], names: Sequence[str], *, consecutive: bool = False) -> None:
        self.paths, self.names, self.consecutive = list(paths), list(names), consecutive
        count = len(self.paths)
        self._length = max(count - 1, 0) if consecutive else count * (count - 1) // 2

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> ImagePair: ...

    @overload
    def __getitem__(self, index: slice) -> list[ImagePair]: ...

    def __getitem__(self, index: int | slice) -> ImagePair | list[ImagePair]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"pair {index} of {self._length}")
        first, second = (index, index + 1) if self.consecutive else self._row_and_column(index)
        name = f"({self.names[first]},{self.names[second]})"
        return ImagePair(name, self.paths[first], self.paths[second])

    def _row_and_column(self, index: int) -> tuple[int, int]:
        """``(i, j)`` of pair ``index`` in the rows of the upper triangle: row ``i`` holds ``N - 1 - i`` pairs."""
        count = len(self.paths)
        before = lambda row: row * (2 * count - row - 1) // 2  # noqa: E731 - pairs in the rows above ``row``
        row = int((2 * count - 1 - math.sqrt((2 * count - 1) ** 2 - 8 * index)) // 2)
        while before(row + 1) <= index:  # the float root may land one row short
            row += 1
        while before(row) > index:
            row -= 1
        return row, row + 1 + index - before(row)


def pairs_within(folder: str | os.PathLike[str], *, consecutive: bool = False) -> PairsWithin:
    """Every pair of the images of one folder (searched recursively, sorted by relative path): the pairs of
    ``lpips_1dir_allpairs.py --all-pairs``, whose mean score is the diversity of a set of samples; with
    ``consecutive``, each image with the next (the script without ``--all-pairs``). Unreadable entries are left
    out with a warning, as ``pair_files`` leaves them out.

    Raises:
        InputNotFoundError: the folder does not exist or holds no images.
        InvalidValueError: fewer than two readable images.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import pairs_within
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("0.png", "1.png", "2.png", "3.png"):
        ...     save_image(torch.rand(3, 16, 16), root / name)
        >>> len(pairs_within(root)), len(pairs_within(root, consecutive=True))
        (6, 3)
    """
    listed = _images_by_name(folder, ignore_suffix=False)
    _warn_unreadable(sorted((entry for entry in listed.values() if entry.reason), key=lambda entry: entry.path))
    readable = sorted((entry for entry in listed.values() if not entry.reason), key=lambda entry: entry.name)
    if len(readable) < 2:
        raise InvalidValueError(f"{os.fspath(folder)} holds {len(readable)} readable image(s); pairs need 2 or more")
    return PairsWithin([entry.path for entry in readable], [entry.name for entry in readable], consecutive=consecutive)


class _PairBatches(IterableDataset):
    """Batches of prepared pairs, cut where they are decoded: in a DataLoader worker, or in this process.

    A pair is a ``Sample`` whose row is its position in ``pairs`` and whose image is both images stacked,
    ``(2, C, H, W)``; ``None``, with the reason, when it cannot be scored.

    The pairs go in blocks of ``batch_size`` consecutive ones, block ``k`` to worker ``k % workers``, and a
    block is cut again wherever the next pair would take a batch over ``batch_pixels`` (height × width of
    one image per pair). A batch thus stays within both bounds (a pair larger than the budget goes alone),
    decoded images in flight are bounded by pixels too, and where batches end depends on the images' sizes
    only, never on the workers. Every pair carries its position, so its score lands in its place.
    A failure to read is returned as a reason, raised by the main process.
    """

    def __init__(
        self,
        pairs: Sequence[ImagePair] | Sequence[tuple[str, str]],
        transform: ImageTransform,
        batch_size: int,
        batch_pixels: int | None,
    ) -> None:
        self.pairs = [_paths(item) for item in pairs]
        self.transform = transform
        self.batch_size = batch_size
        self.batch_pixels = batch_pixels

    def __iter__(self) -> Iterator[list[Sample]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        size = self.batch_size
        for start in range(worker * size, len(self.pairs), workers * size):
            yield from self._cut(range(start, min(start + size, len(self.pairs))))

    def _cut(self, indices: range) -> Iterator[list[Sample]]:
        """The pairs at ``indices``, prepared, in batches of at most ``batch_pixels`` (one pair at least)."""
        yield from pixel_pieces(map(self._prepare, indices), _pixels, self.batch_pixels)

    def _prepare(self, index: int) -> Sample:
        images = []
        for path in self.pairs[index]:
            try:
                images.append(self.transform(read_image(path)))
            except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
                return Sample(index, None, f"cannot read image {path}: {first_line(exc)}")
        a, b = images
        if a.shape != b.shape:
            a_path, b_path = self.pairs[index]
            return Sample(
                index,
                None,
                f"images of a pair differ in size after preparation: {a_path} is {tuple(a.shape[1:])}, "
                f"{b_path} is {tuple(b.shape[1:])}; pass a crop_size (or resize both to one size)",
            )
        return Sample(index, torch.stack([a, b]), "")


def _pixels(item: Sample) -> int:
    return item.image.shape[-2] * item.image.shape[-1] if item.image is not None else 0


def _paths(item: tuple[str, str] | ImagePair) -> tuple[str, str]:
    """``(path_a, path_b)`` of an ``ImagePair`` or of a pair of paths."""
    if isinstance(item, ImagePair):
        return item.a, item.b
    try:
        a, b = item
        return os.fspath(a), os.fspath(b)
    except (TypeError, ValueError):
        raise InvalidValueError(f"pairs holds {item!r}; give ImagePair items or (path_a, path_b) pairs") from None


def score_pairs(
    metric: PairMetric,
    pairs: Sequence[ImagePair] | Sequence[tuple[str, str]],
    *,
    interpolation: str = "bilinear",
    **options: Unpack[StreamOptions],
) -> list[float]:
    """One score per pair of image files: ``metric(a, b)`` for each pair, in the order of ``pairs``.

    Images are decoded in DataLoader workers (``featurehooks.images.read_image``), optionally resized
    (shorter side) and center-cropped, scaled to the metric's ``input_range`` (``(0, 1)`` for a
    callable without one) and moved to its device. Both images of a pair must have the same size
    after that; pairs of different sizes are scored in separate forwards.

    A batch holds at most ``batch_size`` pairs and at most ``batch_pixels`` pixels, so the memory of a
    forward is bounded whatever the image size: 1024 × 1024 pairs are scored one at a time, 256 × 256 pairs
    16 at a time with the defaults. Batches end where the sizes of the images and the two bounds say, not where a worker
    does; a pair's score does not depend on the other pairs of its batch (other batch sizes change it
    by float rounding only, as a batched convolution does).

    Args:
        metric: a module or function ``(a, b) -> (B,)`` distances, e.g. ``LPIPS(reduction="none")`` or
            ``DISTS(reduction="none")``.
        pairs: the ``ImagePair`` items of ``pair_files``, or ``(path_a, path_b)`` items.
        interpolation: ``"bilinear"`` or ``"bicubic"`` for the resize.
        **options: the ``StreamOptions``: ``batch_size`` (pairs per forward, at most), ``batch_pixels`` (pixels
            per forward, at most: the sum over its pairs of height × width of one image, after resize and crop; a
            pair larger than this is scored alone; ``BATCH_PIXELS`` by default here), ``num_workers``,
            ``resize_size`` (the shorter side of both images), ``crop_size`` (a center square, after the
            resize), ``progress``. A pair metric has no preprocessing of its own: ``"weights"`` (the default)
            keeps the images' size.

    Returns:
        The scores as floats, aligned with ``pairs``.

    Raises:
        InvalidValueError: an image cannot be read (the error names the file), the images of a pair
            differ in size, or the metric does not return one value per pair (for ``LPIPS`` and
            ``DISTS`` pass ``reduction="none"``).

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import LPIPS, pair_files, score_pairs
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("outputs/0001.png", "outputs/0002.png", "references/0001.png", "references/0002.png"):
        ...     (root / name).parent.mkdir(exist_ok=True)
        ...     save_image(torch.rand(3, 32, 32), root / name)
        >>> pairs, _, _ = pair_files(root / "outputs", root / "references")
        >>> metric = LPIPS("alex", weights=None, reduction="none")  # random weights here: use the default
        >>> scores = score_pairs(metric, pairs, num_workers=0)
        >>> len(scores), all(score >= 0 for score in scores)
        (2, True)
    """
    streaming = Streaming.of({"batch_pixels": BATCH_PIXELS, **options})  # a pair's budget: two images each
    if streaming.shard is not None:
        raise InvalidValueError("score_pairs scores every pair it is given: pass each job its pairs, not shard=")
    if not callable(metric):
        raise InvalidTypeError(f"metric must be callable as metric(a, b), got {type(metric).__name__}")
    try:
        InterpolationMode(interpolation)
    except ValueError:
        modes = [mode.value for mode in InterpolationMode]
        raise InvalidValueError(f"interpolation must be one of {modes}, not {interpolation!r}") from None
    if not pairs:
        return []
    input_range = tuple(float(v) for v in getattr(metric, "input_range", (0.0, 1.0)))
    resize, crop = streaming.resize_size, streaming.crop_size  # a str is "weights": a pair metric has none
    transform = ImageTransform(
        None if isinstance(resize, str) else resize,
        None if isinstance(crop, str) else crop,
        interpolation,
        (input_range[0], input_range[1]),
    )
    device = placement(metric)[0]
    workers = loader_workers(
        streaming.num_workers, -(-len(pairs) // streaming.batch_size), cpu_forward=device.type == "cpu"
    )
    rows = _PairBatches(pairs, transform, streaming.batch_size, streaming.batch_pixels)
    loader = row_loader(rows, None, workers, pin=device.type == "cuda")
    scores = [0.0] * len(pairs)
    with Progress(len(pairs), streaming.progress, label="score", unit="pair") as bar:
        for batch in feature_batches(partial(_pair_scores, metric), loader, model=metric, progress=bar):
            reason = next((reason for reason in batch.reasons if reason), None)
            if reason is not None:
                raise InvalidValueError(reason)
            for row, score in zip(batch.rows, batch.arrays["score"].tolist()):
                scores[row] = score
    return scores


def _pair_scores(metric: PairMetric, pairs: Tensor) -> dict[str, np.ndarray]:
    """``{"score": (B,)}`` of one batch of pairs of one size, ``(B, 2, C, H, W)``: one ``metric`` call."""
    values = metric(pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
    if not isinstance(values, Tensor) or tuple(values.shape) != (len(pairs),):
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise InvalidValueError(
            f"the metric returned {shape} for {len(pairs)} pairs; it must return one value per pair "
            "(for LPIPS and DISTS pass reduction='none', and spatial=False to LPIPS)"
        )
    return {"score": values.detach().float().cpu().numpy()}
