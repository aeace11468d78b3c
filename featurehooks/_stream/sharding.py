"""Splitting work across torch.distributed ranks (torchrun), without padding or duplicates.

Rows are grouped in fixed chunks (the batch size); each rank takes one contiguous run of the pending
chunks. Batches are always whole chunks, so every row is computed in the same batch whatever the
number of ranks or restarts: a dump's bytes do not depend on them, and statistics merged from the ranks
equal one process's to float rounding. Every distributed entry point follows one protocol: rank 0 plans
(``Distributed.from_main``: the ranks agree on the rows, and a planning error is raised on every rank),
every rank computes its share (``Distributed.each``: a rank that fails tells the others, which stop with
a ``RunFailedError`` naming it instead of waiting for it).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import RunFailedError, first_line

__all__ = ["Distributed", "chunk_rows", "process_group", "split_contiguous"]

T = TypeVar("T")  # what is split: row indices, batches of them


def chunk_rows(chunk: int, chunk_size: int, num_rows: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of chunk number ``chunk``."""
    start = chunk * chunk_size
    return start, min(start + chunk_size, num_rows)


def split_contiguous(items: Sequence[T], parts: int, part: int) -> list[T]:
    """Part ``part`` of ``parts`` contiguous, non-padded pieces of ``items`` (sizes differ by at most one)."""
    base, extra = divmod(len(items), parts)
    start = part * base + min(part, extra)
    stop = start + base + (1 if part < extra else 0)
    return list(items[start:stop])


@dataclass
class Distributed:
    """Rank and world size of this process, and the collectives dumps and statistics need (no-ops when alone).

    With ``WORLD_SIZE > 1`` in the environment (torchrun sets it) and no process group yet, one is
    created (``nccl`` for CUDA devices, else ``gloo``) and destroyed by ``close()``.
    """

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False

    @classmethod
    def from_environment(cls, device: torch.device) -> Distributed:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), owns_group=False)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size <= 1:
            return cls()
        if not dist.is_available():
            raise RunFailedError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(minutes=60))
        return cls(dist.get_rank(), dist.get_world_size(), owns_group=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        if self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def from_main(self, work: Callable[[], T]) -> T:
        """``work()`` run on rank 0 only, its value on every rank; its error raised on every rank (of the same
        type where the exception pickles)."""
        if self.world_size == 1:
            return work()
        value: T | None = None
        error: BaseException | None = None
        if self.is_main:
            try:
                value = work()
            except Exception as exc:
                error = _portable(exc)
        value, error = self.broadcast((value, error))
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def each(self, work: Callable[[], T], doing: str, hint: str = "") -> list[T]:
        """``work()`` on every rank, every rank's value in rank order on every rank.

        A rank whose work raises tells the others before raising its error; they raise ``RunFailedError``
        ("another rank failed ``doing``", the rank and its error, then ``hint``) rather than wait for it.
        """
        try:
            value = work()
        except Exception as exc:
            if self.world_size > 1:
                self.all_gather(_Failure(first_line(exc)))
            raise
        values = self.all_gather(value)
        failed = [f"rank {rank}: {other.reason}" for rank, other in enumerate(values) if isinstance(other, _Failure)]
        if failed:
            raise RunFailedError(f"another rank failed {doing} ({'; '.join(failed)})" + (f"; {hint}" if hint else ""))
        return values

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class _Failure:
    """What a rank whose work failed sends the others in place of its value."""

    reason: str


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling (so other ranks raise the same type), else a RuntimeError saying it."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - exceptions with unusual constructors
        return RuntimeError(f"{type(exc).__name__}: {exc}")


@contextmanager
def process_group(device: torch.device) -> Iterator[Distributed]:
    """One process group for several collective steps (a command that computes two image sets).

    Under torchrun with no group yet, one is created here and destroyed at the end; the steps' own
    ``Distributed.from_environment`` then join it instead of each creating and destroying one (a second
    group created right after the first can meet the first's stale addresses in torchrun's store).
    """
    ranks = Distributed.from_environment(device)
    try:
        yield ranks
    finally:
        ranks.close()
