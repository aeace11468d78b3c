"""Decoding rows in DataLoader worker processes while the model runs, and collating them into batches."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .sources import Sample

__all__ = ["Batch", "collate_batch", "loader_workers", "row_loader"]


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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loader_workers(requested: int | None, batches: int) -> int:
    """DataLoader workers: up to 4 by default; never more than 4 per core, nor more than there are batches.

    Decoding is partly I/O-bound, so a few workers per core can pay; past that, each worker is a process
    that only costs memory (``--workers 100000`` would fork until the OOM killer stepped in).
    """
    wanted = min(4, max(_cores() - 1, 0)) if requested is None else requested
    return min(wanted, 4 * _cores(), batches)


def row_loader(
    rows: Dataset | IterableDataset, batches: Sequence[list[int]] | None, workers: int, pin: bool
) -> DataLoader:
    """Batches of ``rows`` decoded by ``workers`` processes (0: in this one), two batches ahead per worker.

    A map-style ``rows`` dataset is read in ``batches`` (lists of row numbers); an iterable one (``batches``
    ``None``) yields the samples of each batch itself, as lists.
    """
    return DataLoader(
        rows,
        batch_sampler=batches,
        batch_size=None if batches is None else 1,
        num_workers=workers,
        collate_fn=collate_batch,
        pin_memory=pin,
        prefetch_factor=2 if workers > 0 else None,
    )
