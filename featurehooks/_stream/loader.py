"""Decoding rows in DataLoader worker processes while the model runs, and collating them into batches: batches
cut to a pixel budget, the workers' count, and a worker's death as one error."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ..errors import RunFailedError
from .cpus import available_cpus
from .sources import Sample

T = TypeVar("T")

__all__ = ["Batch", "collate_batch", "cut_to_pixels", "loader_workers", "row_loader", "worker_deaths"]


class Batch(NamedTuple):
    """Collated samples: their row numbers, images (B, C, H, W), or a list of (C, H, W) of several sizes (``None``
    for rows with nothing to compute), reasons (empty for valid rows), labels (``None`` where absent)."""

    rows: list[int]
    images: Tensor | list[Tensor | None]
    reasons: list[str]
    labels: list[int | None]


def collate_batch(samples: list[Sample]) -> Batch:
    """A batch of samples: images stacked when they all share one shape, else kept as a list."""
    images = [s.image for s in samples]
    shapes = {None if image is None else tuple(image.shape) for image in images}
    stacked = torch.stack(images) if len(shapes) == 1 and None not in shapes else images  # type: ignore[arg-type]
    return Batch([s.row for s in samples], stacked, [s.reason for s in samples], [s.label for s in samples])


def loader_workers(requested: int | None, batches: int, *, cpu_forward: bool = True) -> int:
    """DataLoader workers: ``requested``, or by default one per 4 of the CPUs this process may use when the forward
    runs on them too (torch's threads take the rest: see ``cpus``), one less than those CPUs when it runs on an
    accelerator; up to 4 by default, never more than 4 per CPU, nor more than there are batches.

    Decoding is partly I/O-bound, so a few workers per core can pay; past that, each worker is a process
    that only costs memory (``--workers 100000`` would fork until the OOM killer stepped in).
    """
    cores = available_cpus()
    if requested is None:
        requested = min(4, cores // 4 if cpu_forward else cores - 1)
    return min(requested, 4 * cores, batches)


def cut_to_pixels(
    batches: Iterable[list[int]], pixels: Callable[[int], int], budget: int | None
) -> Iterator[list[int]]:
    """``batches`` of rows, each cut where its next row would take it over ``budget`` pixels (``pixels(row)``: the
    row's height × width once prepared); a row larger than the budget goes alone, ``None`` cuts nothing.

    Lazy: the DataLoader asks for the next batch as it decodes, so sizes read from files' headers are read then.
    """
    for batch in batches:
        yield from pixel_pieces(batch, pixels, budget)


def pixel_pieces(items: Iterable[T], pixels: Callable[[T], int], budget: int | None) -> Iterator[list[T]]:
    """``items`` in consecutive pieces of at most ``budget`` pixels (``pixels(item)`` each; an item larger than the
    budget goes alone); ``None``: one piece, and ``pixels`` is never called."""
    piece: list[T] = []
    total = 0
    for item in items:
        if budget is not None:
            area = pixels(item)
            if piece and total + area > budget:
                yield piece
                piece, total = [], 0
            total += area
        piece.append(item)
    if piece:
        yield piece


def row_loader(
    rows: Dataset | IterableDataset, batches: Iterable[list[int]] | None, workers: int, pin: bool
) -> DataLoader:
    """Batches of ``rows`` decoded by ``workers`` processes (0: in this one), two batches ahead per worker.

    A map-style ``rows`` dataset is read in ``batches`` (lists of row numbers); an iterable one (``batches``
    ``None``) yields the samples of each batch itself, as lists.
    """
    return DataLoader(
        rows,
        batch_sampler=batches,  # type: ignore[arg-type]  # any iterable of lists of indices
        batch_size=None if batches is None else 1,
        num_workers=workers,
        collate_fn=collate_batch,
        pin_memory=pin,
        prefetch_factor=2 if workers > 0 else None,
    )


@contextmanager
def worker_deaths() -> Iterator[None]:
    """A decoding worker that dies (killed for memory, a crash in a decoder) raised as one ``RunFailedError`` line
    instead of the DataLoader's traceback, wherever the main process was when it learned of it."""
    try:
        yield
    except RuntimeError as exc:
        message = str(exc)
        if not message.startswith("DataLoader worker (pid"):
            raise
        raise RunFailedError(
            f"a decoding worker died ({message.splitlines()[0].rstrip('. ')}), maybe for lack of memory; use fewer "
            "or no decoding workers (num_workers=0, --workers 0), or a smaller batch_size or batch_pixels"
        ) from None
