"""Micro-batches for the pipeline's CPU forwards: few enough images that the largest activation stays in the cache.

One forward of a whole batch streams every activation through main memory; micro-batches whose largest
activation fits in half the last-level cache keep it there. Cache-sized only while no DataLoader worker shares
the cores (``num_workers=0``): a worker holding a core makes the many short OpenMP regions wait. With workers,
micro-batches bound memory instead (``WORKERS_BUDGET`` for the largest activation). Rows are bitwise those of one
forward. On accelerators the whole batch runs at once: there, large batches keep the device busy. Measurements:
docs/performance.md.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["WORKERS_BUDGET", "cache_budget", "micro_batch_size"]

_FALLBACK_CACHE = 32 * 2**20  # the last-level cache of the machine the rule was measured on
_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
# the largest activation of one forward while decoding workers share the cores: long OpenMP regions, bounded memory
WORKERS_BUDGET = 64 * 2**20


def _size_in_bytes(text: str) -> int | None:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip().upper())
    return int(match.group(1)) * _UNITS[match.group(2)] if match else None


@functools.cache
def cache_budget() -> int:
    """Half the largest CPU cache (Linux sysfs; 32 MiB where it cannot be read): what one micro-batch's
    largest activation may take, leaving the rest for weights and the next layer's output."""
    sizes = []
    for entry in _SYSFS_CACHES.glob("index*/size"):
        try:
            size = _size_in_bytes(entry.read_text())
        except OSError:
            continue
        if size:
            sizes.append(size)
    return max(sizes, default=_FALLBACK_CACHE) // 2


def micro_batch_size(extractor: FeatureExtractor, images: Tensor, budget: int) -> int:
    """Images per forward for ``images``: the whole batch off the CPU or when the extractor cannot say how
    large its activations are (an untraced model); else as many as keep the largest one within ``budget`` bytes."""
    batch = images.shape[0]
    if images.device.type != "cpu" or batch <= 1:
        return batch
    per_image = extractor.activation_bytes(int(images.shape[-2]), int(images.shape[-1]))
    if not per_image:
        return batch
    return max(1, min(batch, budget // per_image))
