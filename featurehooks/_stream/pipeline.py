"""The loop every consumer of images shares: batches of decoded rows in, batches of features out.

``feature_batches`` is that loop: it moves each batch where the model computes, runs one forward per image
size found in it (a batch of pooled, uncropped files holds several), puts the results back in row order,
zero-fills the rows that could not be read, and counts the rows on a progress bar. Dumps and feature
statistics call it through ``extract_batches`` (a ``FeatureExtractor`` over ``Inputs``); the LPIPS pair
scorer with a forward of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from .._layout import Pool
from ..errors import InvalidValueError
from .cpus import LAST_SEEN, forward_threads, threads_for
from .forward import features_as_arrays, placement
from .independence import rows_independent
from .loader import Batch, cut_to_pixels, loader_workers, row_loader
from .options import Streaming
from .progress import Progress
from .sources import Inputs
from .tiling import WORKERS_BUDGET, cache_budget

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["FeatureBatch", "Forward", "dtype_name", "extract_batches", "feature_batches"]

_DTYPES = ("float16", "float32")

Forward = Callable[[Tensor], dict[str, np.ndarray]]
"""A forward of images of one size, on the model's device and dtype: one array row per image, by output name."""


class FeatureBatch(NamedTuple):
    """Features of the rows ``rows``: ``arrays`` by output name, one row each (zeros where ``reasons`` says
    why a row could not be read), and the rows' labels (``None`` where absent)."""

    rows: list[int]
    arrays: dict[str, np.ndarray]
    reasons: list[str]
    labels: list[int | None]

    @property
    def valid(self) -> list[int]:
        """Positions (in this batch) of the rows that were read."""
        return [i for i, reason in enumerate(self.reasons) if not reason]

    @property
    def skipped(self) -> list[tuple[int, str]]:
        """``(row, reason)`` of each row that could not be read."""
        return [(row, reason) for row, reason in zip(self.rows, self.reasons) if reason]


def dtype_name(dtype: object) -> str:
    """The name of an on-disk dtype the pipeline writes (``"float16"`` or ``"float32"``); others are refused."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).replace("torch.", "")
    else:
        try:
            name = np.dtype(dtype).name  # type: ignore[call-overload]
        except TypeError:
            name = str(dtype)
    if name not in _DTYPES:
        raise InvalidValueError(f"dtype must be 'float16' or 'float32', not {dtype!r}")
    return name


def feature_batches(
    forward: Forward, batches: Iterable[Batch], *, model: object, progress: Progress
) -> Iterator[FeatureBatch]:
    """``forward`` over each batch, moved to ``model``'s device and dtype (see ``placement``), without a graph.

    A batch of images of several sizes runs one forward per size. Rows whose image is ``None`` are not
    computed; their arrays, and those of every row with a reason, are zeros. ``progress`` counts a batch's
    rows once the consumer is done with it.
    """
    device, dtype = placement(model)
    for batch in batches:
        with torch.no_grad():
            arrays = _by_size(forward, batch.images, device, dtype)
        for position, reason in enumerate(batch.reasons):
            if reason:
                for array in arrays.values():
                    array[position] = 0
        yield FeatureBatch(batch.rows, arrays, batch.reasons, batch.labels)
        progress.update(len(batch.rows))


def _by_size(
    forward: Forward, images: Tensor | Sequence[Tensor | None], device: torch.device, dtype: torch.dtype
) -> dict[str, np.ndarray]:
    """``forward`` of a stacked batch, or of each size found in a list of images, put back in row order."""
    if isinstance(images, Tensor):
        return forward(images.to(device=device, dtype=dtype, non_blocking=True))
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for row, image in enumerate(images):
        if image is not None:
            rows_of.setdefault(tuple(image.shape), []).append(row)
    arrays: dict[str, np.ndarray] = {}
    for rows in rows_of.values():
        same = torch.stack([images[row] for row in rows]).to(device=device, dtype=dtype, non_blocking=True)  # type: ignore[misc]
        for name, value in forward(same).items():
            arrays.setdefault(name, np.zeros((len(images), *value.shape[1:]), value.dtype))[rows] = value
    return arrays


def extract_batches(
    extractor: FeatureExtractor,
    inputs: Inputs,
    batches: Sequence[list[int]],
    *,
    pool: Pool | None,
    dtype: str,
    streaming: Streaming,
    progress: Progress,
) -> Generator[FeatureBatch, None, None]:
    """``feature_batches`` of ``extractor`` over ``batches`` (lists of rows) of ``inputs``, each cut to
    ``streaming.batch_pixels`` (so a batch may come back in several pieces, in row order), decoded by up to
    ``streaming.num_workers`` processes (none for generated images, drawn in this process); features pooled with
    ``pool`` and cast to ``dtype``.

    CPU forwards run in micro-batches (see ``tiling``) where the rows are provably independent of their batch
    (see ``independence``; else one forward a batch): cache-sized without decoding workers, else bounded to
    ``WORKERS_BUDGET`` for the largest activation. While they run, torch's threads leave a core to each
    decoding worker chosen by default (see ``cpus``).
    """
    on_cpu = extractor.device.type == "cpu"
    # a generator's rows are drawn here, in order: a worker would hold a copy of it
    workers = 0 if inputs.generated else loader_workers(streaming.num_workers, len(batches), cpu_forward=on_cpu)
    pieces = cut_to_pixels(batches, inputs.pixels, streaming.batch_pixels)
    loader = row_loader(inputs.rows(extractor.input_range), pieces, workers, pin=extractor.device.type == "cuda")
    budget = None
    if rows_independent(extractor.backbone):
        budget = cache_budget() if workers == 0 else WORKERS_BUDGET
    forward = partial(features_as_arrays, extractor, pool=pool, dtype=dtype, budget=budget, contention=LAST_SEEN)
    decoding = workers if streaming.num_workers is None else 0  # workers the user asked for take no thread
    with forward_threads(threads_for(decoding) if on_cpu else None):
        yield from feature_batches(forward, loader, model=extractor, progress=progress)
