"""Micro-batches for the pipeline's CPU forwards: few enough images that the largest activation stays in the cache.

One forward of a whole batch of 32 images at 224 px streams every activation through main memory;
split so that the largest activation of a micro-batch fits in half the last-level cache, the same
forwards measured 1.17–1.23x faster (ResNet-18/50 in channels-last) and 1.22x (VGG16 relu3_3 in NCHW,
one image per forward) on a 2-core EPYC with 32 MiB of L3, and a whole ResNet-18 dump of 128 JPEGs
1.08x. Cache-sized only while no DataLoader worker shares the cores (``num_workers=0``): with one decoding
worker on those 2 cores the cache-sized dump gained 1.02x on a quiet machine and ran at 0.37x on a busy
one, the many short OpenMP regions waiting on cores the worker holds. With workers, micro-batches bound
memory instead (``WORKERS_BUDGET`` for the largest activation): a batch of 50 through the FID Inception
ran in 9-image forwards 1.28x faster than in one, bitwise equal, at 0.18x the peak allocation.
On accelerators the whole batch runs at once: there, large batches are what keeps the device busy.
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
