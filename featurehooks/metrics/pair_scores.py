"""Scoring pairs of images with a pairwise metric such as LPIPS or DISTS, in bounded memory.

``iter_pair_scores`` streams the pairs (``pairs.pair_files``, ``pairs.pairs_within`` or a list of path pairs)
through the input pipeline dumps use (``featurehooks._stream``: decoding in worker processes while the metric runs)
and yields their scores in order as they come, ``score_pairs`` collects them in a list, ``RunningSummary`` sums
them up in constant memory. Images are read and prepared by ``featurehooks.images``, as dumps read them.

Every pair of one folder is decoded by tiles: the images of two groups of ``side`` images each, decoded once,
give the ``side`` × ``side`` pairs between them, so N images cost about N² / ``side`` decodes instead of N² (a pair
metric takes images, so each pair still costs its forward).

A batch is bounded by pixels as well as by pairs: a forward's memory grows with the pixels it
holds (LPIPS on VGG keeps activations of about 1.7 GB per megapixel pair), so large images get
smaller batches, down to one pair. Where batches end depends only on the images' sizes and the two
bounds, never on the number of workers or on timing.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import partial

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import IterableDataset, get_worker_info
from torchvision.transforms import InterpolationMode
from typing_extensions import Unpack

from .._stream import (
    Batch,
    Progress,
    Sample,
    Streaming,
    StreamOptions,
    feature_batches,
    loader_workers,
    pixel_pieces,
    placement,
    read_row,
    row_loader,
)
from ..errors import InvalidTypeError, InvalidValueError, first_line
from ..images import ImageTransform
from .pairs import ImagePair, PairsWithin

__all__ = ["BATCH_PIXELS", "RunningSummary", "ScoreSummary", "iter_pair_scores", "score_pairs"]

PairMetric = Callable[[Tensor, Tensor], Tensor]

BATCH_PIXELS = 2**20
"""Default pixel budget of a batch of pairs: the sum of height × width (of one image of each pair, after
resize and crop). 16 pairs of 256 × 256, 4 of 512 × 512, one of 1024 × 1024; a larger pair is scored alone.

Examples:
    >>> from featurehooks.metrics import BATCH_PIXELS
    >>> BATCH_PIXELS // (256 * 256), BATCH_PIXELS // (1024 * 1024)
    (16, 1)
"""


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
            yield from pixel_pieces(
                map(self._prepare, range(start, min(start + size, len(self.pairs)))), _pixels, self.batch_pixels
            )

    def _prepare(self, index: int) -> Sample:
        a, b = self.pairs[index]
        return _pair_sample(index, (a, b), _prepared(self.transform, a), _prepared(self.transform, b))


class _TiledPairs(IterableDataset):
    """Batches of every pair ``(i, j)``, ``i < j``, of ``paths``, decoded by tiles: in a DataLoader worker, or here.

    The images are cut into groups of ``side`` consecutive ones; tile ``(r, c)``, ``r <= c``, holds the pairs of an
    image of group ``r`` with a later one of group ``c``, in the order of ``PairsWithin`` (row by row), and costs
    the decoding of those two groups only (group ``r`` is kept from the worker's previous tile when it is the
    same). Tile ``k`` (counted row by row) goes to worker ``k % workers``; its pairs go in batches as
    ``_PairBatches`` cuts blocks: ``batch_size`` pairs, cut again at ``batch_pixels``. A worker thus holds at most
    ``2 side`` prepared images, which ``side`` bounds by pixels as a batch is bounded, and where batches end
    depends on the images' sizes, ``side`` and the two bounds only. Each pair carries its index in
    ``PairsWithin``, whose order the main process restores.
    """

    def __init__(
        self, paths: list[str], transform: ImageTransform, side: int, batch_size: int, batch_pixels: int | None
    ) -> None:
        self.paths, self.transform, self.side = paths, transform, side
        self.batch_size, self.batch_pixels = batch_size, batch_pixels
        self.groups = -(-len(paths) // side)
        self.tile_count = sum(self.groups - self._first_column(r) for r in range(self.groups))

    def _first_column(self, r: int) -> int:
        """The first group that pairs with group ``r``: itself, unless it holds one image (no pair within it)."""
        return r if self.side > 1 and len(self.paths) - r * self.side > 1 else r + 1

    def _tiles(self) -> Iterator[tuple[int, int]]:
        """The tiles that hold a pair, row by row, made as they are asked for (about ``N² / 2 side²`` of them)."""
        for r in range(self.groups):
            yield from ((r, c) for c in range(self._first_column(r), self.groups))

    def __iter__(self) -> Iterator[list[Sample]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        held: tuple[int, list[Tensor | str]] = (-1, [])
        for r, c in itertools.islice(self._tiles(), worker, None, workers):
            if held[0] != r:
                held = (r, self._group(r))
            columns = held[1] if c == r else self._group(c)
            pairs = self._pairs(r, held[1], c, columns)
            while block := list(itertools.islice(pairs, self.batch_size)):
                yield from pixel_pieces(block, _pixels, self.batch_pixels)

    def _group(self, group: int) -> list[Tensor | str]:
        return [_prepared(self.transform, path) for path in self.paths[group * self.side : (group + 1) * self.side]]

    def _pairs(self, r: int, rows: list[Tensor | str], c: int, columns: list[Tensor | str]) -> Iterator[Sample]:
        """The samples of tile ``(r, c)``, row by row; a pair's row is its index in ``PairsWithin``."""
        count, first_column = len(self.paths), c * self.side
        for i, a in enumerate(rows, start=r * self.side):
            before = i * (2 * count - i - 1) // 2 - i - 1  # index of pair (i, j) = before + j
            for j in range(max(i + 1, first_column), first_column + len(columns)):
                paths = (self.paths[i], self.paths[j])
                yield _pair_sample(before + j, paths, a, columns[j - first_column])


def _prepared(transform: ImageTransform, path: str) -> Tensor | str:
    """The image at ``path`` (a file, or a row of a ZIP, tar shard or array), read and prepared, or why it cannot
    be."""
    try:
        return transform(read_row(path))
    except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
        return f"cannot read image {path}: {first_line(exc)}"


def _pair_sample(index: int, paths: tuple[str, str], a: Tensor | str, b: Tensor | str) -> Sample:
    """Pair ``index``: the prepared images ``a`` and ``b`` stacked, or ``None`` with why it cannot be scored."""
    if isinstance(a, str):
        return Sample(index, None, a)
    if isinstance(b, str):
        return Sample(index, None, b)
    if a.shape != b.shape:
        return Sample(
            index,
            None,
            f"images of a pair differ in size after preparation: {paths[0]} is {tuple(a.shape[1:])}, "
            f"{paths[1]} is {tuple(b.shape[1:])}; pass a crop_size (or resize both to one size)",
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


def _tile_side(paths: list[str], transform: ImageTransform, batch_size: int, batch_pixels: int | None) -> int:
    """Images per group of ``_TiledPairs``: ``batch_size``, fewer where the prepared images (their size read from
    the first one) would hold more than ``batch_pixels`` pixels per group, one at least."""
    if batch_pixels is None:
        return batch_size
    first = _prepared(transform, paths[0])
    if isinstance(first, str):
        raise InvalidValueError(first)
    return max(1, min(batch_size, batch_pixels // (first.shape[-2] * first.shape[-1])))


def _pair_rows(
    pairs: Sequence[ImagePair] | Sequence[tuple[str, str]], transform: ImageTransform, streaming: Streaming
) -> tuple[IterableDataset, int]:
    """The dataset that decodes ``pairs`` into batches (tiles for every pair of a folder), and its units of work."""
    if isinstance(pairs, PairsWithin) and not pairs.consecutive:
        side = _tile_side(pairs.paths, transform, streaming.batch_size, streaming.batch_pixels)
        tiled = _TiledPairs(pairs.paths, transform, side, streaming.batch_size, streaming.batch_pixels)
        return tiled, tiled.tile_count
    return _PairBatches(pairs, transform, streaming.batch_size, streaming.batch_pixels), -(
        -len(pairs) // streaming.batch_size
    )


def iter_pair_scores(
    metric: PairMetric,
    pairs: Sequence[ImagePair] | Sequence[tuple[str, str]],
    *,
    interpolation: str = "bilinear",
    **options: Unpack[StreamOptions],
) -> Iterator[np.ndarray]:
    """The scores of ``score_pairs`` as they come: ``float64`` arrays of consecutive scores, in the order of
    ``pairs``, each yielded as soon as every pair before it is scored.

    Memory does not grow with the number of pairs: the pairs of ``pairs_within`` are made as they are decoded, and
    only the scores that wait for an earlier pair are held (a band of tiles, about ``batch_size`` × N of them for N
    images), so the N (N - 1) / 2 pairs of thousands of images stream in memory that grows with N only. Every
    pair of ``pairs_within`` is decoded by tiles (two groups of images decoded once give all the pairs between them),
    which decodes each image about N / ``batch_size`` times instead of N - 1. Options and errors are those of
    ``score_pairs``, checked before the first score; an image that cannot be read is raised when its pair comes.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import RunningSummary, iter_pair_scores, pairs_within
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for i in range(4):
        ...     save_image(torch.full((3, 8, 8), i / 4), folder / f"{i}.png")
        >>> distance = lambda a, b: (a - b).abs().mean(dim=(1, 2, 3))
        >>> summary = RunningSummary()
        >>> for scores in iter_pair_scores(distance, pairs_within(folder), num_workers=0, batch_size=2):
        ...     summary.add(scores)
        >>> summary.summary().count, round(summary.summary().mean, 2)
        (6, 0.42)
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
        return iter(())
    input_range = tuple(float(v) for v in getattr(metric, "input_range", (0.0, 1.0)))
    resize, crop = streaming.resize_size, streaming.crop_size  # a str is "weights": a pair metric has none
    transform = ImageTransform(
        None if isinstance(resize, str) else resize,
        None if isinstance(crop, str) else crop,
        interpolation,
        (input_range[0], input_range[1]),
    )
    device = placement(metric)[0]
    rows, units = _pair_rows(pairs, transform, streaming)
    workers = loader_workers(streaming.num_workers, units, cpu_forward=device.type == "cpu")
    loader = row_loader(rows, None, workers, pin=device.type == "cuda")
    return _in_order(metric, loader, len(pairs), streaming.progress)


def _in_order(metric: PairMetric, loader: Iterable[Batch], count: int, progress: bool) -> Iterator[np.ndarray]:
    """The scores of the batches of ``loader``, which come in any order, yielded from the first pair on in runs.

    Scores that wait for an earlier pair are kept as runs of consecutive pairs (an array each), by first pair.
    """
    waiting: dict[int, np.ndarray] = {}
    done = 0
    with Progress(count, progress, label="score", unit="pair") as bar:
        for batch in feature_batches(partial(_pair_scores, metric), loader, model=metric, progress=bar):
            reason = next((reason for reason in batch.reasons if reason), None)
            if reason is not None:
                raise InvalidValueError(reason)
            rows, scores = np.asarray(batch.rows), batch.arrays["score"].astype(np.float64)
            starts = np.flatnonzero(np.diff(rows, prepend=-2) != 1)
            waiting.update(zip(rows[starts].tolist(), np.split(scores, starts[1:])))
            ready = []
            while done in waiting:
                ready.append(waiting.pop(done))
                done += len(ready[-1])
            if ready:
                yield np.concatenate(ready)


def score_pairs(
    metric: PairMetric,
    pairs: Sequence[ImagePair] | Sequence[tuple[str, str]],
    *,
    interpolation: str = "bilinear",
    **options: Unpack[StreamOptions],
) -> list[float]:
    """One score per pair of image files: ``metric(a, b)`` for each pair, in the order of ``pairs``.

    Images (files, or rows of a ZIP, tar shard or array) are decoded in DataLoader workers, optionally resized
    (shorter side) and center-cropped, scaled to the metric's ``input_range`` (``(0, 1)`` for a
    callable without one) and moved to its device. Both images of a pair must have the same size
    after that; pairs of different sizes are scored in separate forwards.

    A batch holds at most ``batch_size`` pairs and at most ``batch_pixels`` pixels, so the memory of a
    forward is bounded whatever the image size: 1024 × 1024 pairs are scored one at a time, 256 × 256 pairs
    16 at a time with the defaults. Batches end where the sizes of the images and the two bounds say, not where a worker
    does; a pair's score does not depend on the other pairs of its batch (other batch sizes change it
    by float rounding only, as a batched convolution does). The list holds one float per pair: for the
    N (N - 1) / 2 pairs of many images, ``iter_pair_scores`` streams the same scores in bounded memory.

    Args:
        metric: a module or function ``(a, b) -> (B,)`` distances, e.g. ``LPIPS(reduction="none")`` or
            ``DISTS(reduction="none")``.
        pairs: the ``ImagePair`` items of ``pair_files`` or ``pairs_within``, or ``(path_a, path_b)`` items.
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
    chunks = iter_pair_scores(metric, pairs, interpolation=interpolation, **options)
    return [score for chunk in chunks for score in chunk.tolist()]


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


@dataclass(frozen=True)
class ScoreSummary:
    """How many scores, their mean and their sample standard deviation (``0.0`` for a single score; NaN for none).

    Examples:
        >>> from featurehooks.metrics import ScoreSummary
        >>> ScoreSummary(3, 0.5, 0.1).mean
        0.5
    """

    count: int
    mean: float
    std: float


class RunningSummary:
    """The ``ScoreSummary`` of scores added a chunk at a time, in memory that does not grow with their number.

    The sums are exact (integers by power-of-two denominator, as ``statistics`` keeps them), so the summary equals
    ``statistics.fmean`` and ``statistics.stdev`` of all the scores at once, bit for bit, however they are chunked.
    A NaN or infinite score makes the mean that score (NaN for both infinities) and the deviation NaN.

    Examples:
        >>> import statistics
        >>> from featurehooks.metrics import RunningSummary
        >>> running = RunningSummary()
        >>> running.add([0.1, 0.2])
        >>> running.add([0.4])
        >>> summary, scores = running.summary(), [0.1, 0.2, 0.4]
        >>> summary.count, summary.mean == statistics.fmean(scores), summary.std == statistics.stdev(scores)
        (3, True, True)
    """

    def __init__(self) -> None:
        self.count = 0
        self._sums: defaultdict[int, int] = defaultdict(int)  # sum of numerators, by denominator
        self._squares: defaultdict[int, int] = defaultdict(int)  # sum of squared numerators, by denominator
        self._special = 0.0  # the sum of the NaN and infinite scores

    def add(self, scores: Iterable[float] | np.ndarray) -> None:
        """Count ``scores`` in (floats, or an array of them)."""
        for score in scores.tolist() if isinstance(scores, np.ndarray) else scores:
            self.count += 1
            try:
                numerator, denominator = float(score).as_integer_ratio()
            except (OverflowError, ValueError):
                self._special += float(score)
                continue
            self._sums[denominator] += numerator
            self._squares[denominator] += numerator * numerator

    def summary(self) -> ScoreSummary:
        """The count, mean and sample standard deviation of the scores added so far."""
        if not self.count:
            return ScoreSummary(0, math.nan, math.nan)
        if self._special:
            return ScoreSummary(self.count, self._special, math.nan)
        total = sum((Fraction(n, d) for d, n in self._sums.items()), Fraction(0))
        mean = float(total) / self.count  # fsum(scores) / count, as statistics.fmean
        if self.count < 2:
            return ScoreSummary(1, mean, 0.0)
        squares = sum((Fraction(n, d * d) for d, n in self._squares.items()), Fraction(0))
        variance = (self.count * squares - total * total) / self.count / (self.count - 1)
        return ScoreSummary(self.count, mean, _sqrt(variance))


_SQRT_BITS = 2 * sys.float_info.mant_dig + 3


def _sqrt(value: Fraction) -> float:
    """The square root of ``value`` >= 0, correctly rounded (round to odd, then to float: as ``statistics.stdev``)."""
    n, m = value.numerator, value.denominator
    shift = (n.bit_length() - m.bit_length() - _SQRT_BITS) // 2
    if shift >= 0:
        return float(_isqrt_to_odd(n, m << 2 * shift) << shift)
    return _isqrt_to_odd(n << -2 * shift, m) / (1 << -shift)


def _isqrt_to_odd(n: int, m: int) -> int:
    """The square root of ``n / m`` as an integer, rounded to odd."""
    root = math.isqrt(n // m)
    return root | (root * root * m != n)
