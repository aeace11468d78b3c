"""The CPUs this process may use, and how the pipeline shares them between decoding workers and torch's threads.

``os.cpu_count()`` counts the machine; a process may be pinned to fewer cores (``taskset``, a scheduler's
affinity) or limited by a container's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``). Counting the
machine, decoding workers and torch's intra-op threads (which spin while they wait) outnumber the cores and
slow each other down, most on a machine that other jobs share. The pipeline keeps its busy threads (decoding
workers + torch's threads) within ``available_cpus()``; a thread count the user chose (``torch.set_num_threads``,
``OMP_NUM_THREADS``) is left as it is.

Other jobs on the same cores are seen from the inside: the time this process's threads spend runnable but waiting
for a CPU (Linux schedstat), which ``WaitMeter`` reads around a forward.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CONTENDED_SHARE",
    "LAST_SEEN",
    "Contention",
    "WaitMeter",
    "available_cpus",
    "cpu_wait_seconds",
    "forward_threads",
    "threads_for",
]

_CGROUP = Path("/sys/fs/cgroup")
_TASKS = Path("/proc/self/task")
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# threads that waited for a CPU longer than this share of their time ran on cores other jobs kept busy (measured on
# 2 cores: 0.005 quiet, 0.67 beside two multi-threaded torch jobs or two busy Python loops; docs/performance.md)
CONTENDED_SHARE = 0.1
_DEFAULT_THREADS = torch.get_num_threads()  # torch's own choice, unless the user set it before importing us


def available_cpus() -> int:
    """The cores this process may keep busy: its CPU affinity, capped by the cgroup CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota))) if quota else max(1, cores)


def _cgroup_quota() -> float | None:
    """CPUs' worth of time the cgroup allows per period (v2 ``cpu.max``, else v1), ``None`` without a limit."""
    try:
        limit, period = (_CGROUP / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    for folder in (_CGROUP / "cpu", _CGROUP / "cpu,cpuacct"):
        try:
            quota_us = int((folder / "cpu.cfs_quota_us").read_text())
            period_us = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    return None


def threads_for(workers: int) -> int | None:
    """torch's intra-op threads beside ``workers`` decoding processes: at most the cores left to them (one at
    least); ``None`` where the user chose a thread count (``torch.set_num_threads``, ``OMP_NUM_THREADS``)."""
    current = torch.get_num_threads()
    if current != _DEFAULT_THREADS or any(os.environ.get(name) for name in _THREAD_VARIABLES):
        return None
    return min(current, max(1, available_cpus() - workers))


@contextmanager
def forward_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` for the block (``None``: left alone), restored after it.

    The count is process-wide: another thread of the caller that runs torch meanwhile uses it too.
    """
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cpu_wait_seconds() -> float | None:
    """Seconds the threads of this process have spent runnable but waiting for a CPU, so far (the second field
    of Linux ``/proc/self/task/*/schedstat``); ``None`` where the kernel does not say."""
    total, read = 0, False
    for path in _TASKS.glob("*/schedstat"):
        try:
            total += int(path.read_text().split()[1])
        except (OSError, ValueError, IndexError):  # a thread that just exited, or no schedstat
            continue
        read = True
    return total / 1e9 if read else None


class WaitMeter:
    """Whether this process's threads waited for a CPU (other jobs running on its cores) more than
    ``CONTENDED_SHARE`` of their time since the meter was started; never where the kernel does not say."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._waited = cpu_wait_seconds()

    def contended(self, threads: int) -> bool:
        """``threads`` busy threads waited longer than ``CONTENDED_SHARE`` of their time since the start."""
        waited = cpu_wait_seconds()
        if waited is None or self._waited is None:
            return False
        return waited - self._waited > CONTENDED_SHARE * threads * (time.perf_counter() - self._wall)


@dataclass
class Contention:
    """What streams saw of other jobs on the cores: ``busy`` when the last metered forward waited for a CPU
    (``WaitMeter``). While it is, a batch runs in one forward, metered, until one runs uncontended, instead of
    paying for a first micro-batch that waits as long as a whole batch."""

    busy: bool = False


LAST_SEEN = Contention()
"""What the streams of this process saw last: each stream starts from it, so that on busy cores only the first
stream of a process (not each set of an FID, each dump of a loop) pays for a micro-batch that waits."""
