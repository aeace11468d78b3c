"""Micro-batches for the pipeline's CPU forwards: few enough images that the largest activation stays in the cache.

One forward of a whole batch streams every activation through main memory; micro-batches whose largest
activation fits in half the last-level cache keep it there. Cache-sized only while no DataLoader worker shares
the cores (``num_workers=0``): a worker holding a core makes the many short OpenMP regions wait. With workers,
micro-batches bound memory instead (``WORKERS_BUDGET`` for the largest activation). On accelerators the whole batch
runs at once: there, large batches keep the device busy.

Rows are bitwise those of one forward of the batch: ATen's CPU convolution picks its kernel by batch size in two
places (``use_mkldnn``: a 1x1 convolution runs natively for a batch of one, and at one thread for batches under 16),
so no micro-batch is smaller than ``smallest_micro_batch`` of its batch. Where other jobs keep the cores busy, each
of the many short OpenMP regions of micro-batches waits for a descheduled thread; ``forward.features_as_arrays``
then runs the rest of the batch, and the next batches while the cores stay busy (``cpus.Contention``), in one
forward (same threads, same kernels, the same rows). Measurements: docs/performance.md.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["WORKERS_BUDGET", "cache_budget", "micro_batch_size", "smallest_micro_batch"]

_FALLBACK_CACHE = 32 * 2**20  # the last-level cache of the machine the rule was measured on
_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
# the largest activation of one forward while decoding workers share the cores: long OpenMP regions, bounded memory
WORKERS_BUDGET = 64 * 2**20
# ATen runs a 1x1 convolution natively (not in oneDNN) below this batch at one thread (ConvParams::use_mkldnn)
_ONE_THREAD_NATIVE_BELOW = 16


def size_in_bytes(text: str) -> int | None:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip().upper())
    return int(match.group(1)) * _UNITS[match.group(2)] if match else None


@functools.cache
def cache_budget() -> int:
    """Half the largest CPU cache (Linux sysfs; 32 MiB where it cannot be read): what one micro-batch's
    largest activation may take, leaving the rest for weights and the next layer's output."""
    sizes = []
    for entry in _SYSFS_CACHES.glob("index*/size"):
        try:
            size = size_in_bytes(entry.read_text())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes, default=_FALLBACK_CACHE) // 2


def smallest_micro_batch(batch: int) -> int:
    """The fewest images a CPU micro-batch of a ``batch`` may hold so that ATen picks the kernels the whole
    batch gets: two (a batch of one runs 1x1 convolutions natively), and at one thread 16 where the batch has 16."""
    if torch.get_num_threads() == 1 and batch >= _ONE_THREAD_NATIVE_BELOW:
        return _ONE_THREAD_NATIVE_BELOW
    return min(batch, 2)


def micro_batch_size(extractor: FeatureExtractor, images: Tensor, budget: int) -> int:
    """Images per forward for ``images``: the whole batch off the CPU or when the extractor cannot say how
    large its activations are (an untraced model); else as many as keep the largest one within ``budget`` bytes,
    never fewer than ``smallest_micro_batch``."""
    batch = images.shape[0]
    if images.device.type != "cpu" or batch <= 1:
        return batch
    per_image = extractor.activation_bytes(int(images.shape[-2]), int(images.shape[-1]))
    if not per_image:
        return batch
    return max(smallest_micro_batch(batch), min(batch, budget // per_image))
