"""Splitting work across torch.distributed ranks (torchrun), without padding or duplicates.

Rows are grouped in fixed chunks (the batch size); each rank takes one contiguous run of the pending
chunks. Batches are always whole chunks, so every row is computed in the same batch whatever the
number of ranks or restarts: a dump's bytes do not depend on them, and statistics merged from the ranks
equal one process's to float rounding. Every distributed entry point follows one protocol: rank 0 plans
(``Distributed.from_main``: the ranks agree on the rows, and a planning error is raised on every rank),
every rank computes its share (``Distributed.each``: a rank that fails tells the others, which stop with
a ``RunFailedError`` naming it instead of waiting for it).

Jobs that share no process group and no filesystem (a SLURM job array, spot instances) split the rows by the
same rule: ``shard=(i, n)`` takes the rows rank ``i`` of ``n`` would (``shard_of``), and its output records
them as a ``Shard`` of its input set; ``check_cover`` tells whether the shards of a merge cover their set once.
"""

from __future__ import annotations

import atexit
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import Subset

from ..errors import InvalidValueError, RunFailedError, first_line
from .sources import Inputs, inputs_digest

__all__ = ["Distributed", "Shard", "check_cover", "chunk_rows", "process_group", "shard_of", "split_contiguous"]

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
    created (``nccl`` for CUDA devices, else ``gloo``) and kept for the process's later steps, destroyed at its exit:
    a group created right after another was destroyed can meet the first's stale addresses in the rendezvous store
    and wait for ever (seen: two CPU ranks calling ``feature_statistics``, ``fid_statistics`` and ``dump_features``
    one after the other hung 2 runs in 5).
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
        atexit.register(_destroy_group)
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

    def agree(self, value: Any, what: str) -> None:
        """Refuse, on every rank, a ``value`` that is not the same on every rank (``what`` names it)."""
        values = self.all_gather(value)
        if any(other != values[0] for other in values):
            raise InvalidValueError(f"the ranks were given other {what} ({', '.join(map(repr, values))}, by rank)")

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
        """The end of a step: a group this process created stays for its later steps (see the class docstring)."""


def _destroy_group() -> None:
    """At the exit of a process that created a group from the environment: destroy it."""
    if dist.is_available() and dist.is_initialized():
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

    Under torchrun with no group yet, one is created here (and kept for the process, as every group
    ``Distributed.from_environment`` creates); the steps' own ``Distributed.from_environment`` join it.
    """
    ranks = Distributed.from_environment(device)
    try:
        yield ranks
    finally:
        ranks.close()


# -- shards: jobs without a process group ------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """Which rows of which input set a part holds: shard ``index`` of ``count`` (``shard=(index, count)``), rows
    ``[start, stop)`` of a set of ``set_count`` rows whose names hash to ``set_sha256`` (``inputs_digest``)."""

    index: int
    count: int
    start: int
    stop: int
    set_count: int
    set_sha256: str

    def __str__(self) -> str:
        return f"shard {self.index}/{self.count} (rows {self.start}:{self.stop} of {self.set_count})"

    def to_dict(self) -> dict[str, Any]:
        """The JSON a dump's manifest and a statistics file's meta record it as."""
        return {
            "index": self.index,
            "count": self.count,
            "rows": [self.start, self.stop],
            "set": {"count": self.set_count, "sha256": self.set_sha256},
        }

    @classmethod
    def from_dict(cls, data: Any) -> Shard:
        """The shard ``to_dict`` gave ``data``; ``InvalidValueError`` saying what is unfit."""
        try:
            index, count, (start, stop), whole = data["index"], data["count"], data["rows"], data["set"]
            set_count, digest = whole["count"], whole["sha256"]
            fit = set(data) == {"index", "count", "rows", "set"} and set(whole) == {"count", "sha256"}
            numbers = (index, count, start, stop, set_count)
            fit = (
                fit
                and isinstance(digest, str)
                and not any(isinstance(n, bool) or not isinstance(n, int) for n in numbers)
            )
        except (TypeError, KeyError, ValueError):
            fit = False
        if not fit:
            raise InvalidValueError(
                f"shard {data!r} is not {{index, count, rows: [start, stop], set: {{count, sha256}}}}"
            )
        if not (0 <= index < count and 0 <= start < stop <= set_count):
            raise InvalidValueError(f"shard {data!r} is out of range (0 <= index < count, 0 <= start < stop <= count)")
        return cls(index, count, start, stop, set_count, digest)


def shard_rows(shard: tuple[int, int], num_rows: int, batch_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of shard ``(i, n)``: the whole batches rank ``i`` of ``n`` takes (``split_contiguous``).

    Raises:
        InvalidValueError: the shard is empty (fewer batches than shards).
    """
    index, count = shard
    batches = -(-num_rows // batch_size)
    mine = split_contiguous(range(batches), count, index)
    if not mine:
        raise InvalidValueError(
            f"shard {index}/{count} is empty: {num_rows} rows make {batches} batch(es) of {batch_size}, fewer than "
            f"{count} shards; split into at most {batches} shards, or pass a smaller batch size"
        )
    return mine[0] * batch_size, min((mine[-1] + 1) * batch_size, num_rows)


def shard_of(inputs: Inputs, shard: tuple[int, int] | None, batch_size: int) -> tuple[Inputs, Shard | None]:
    """The rows of ``inputs`` that ``shard`` takes (every row for ``None``), and the ``Shard`` record of them.

    Rows keep their names (``dataset[7]`` stays ``dataset[7]``), so a merge of the parts writes a single run's index.
    """
    if shard is None:
        return inputs, None
    start, stop = shard_rows(shard, len(inputs.names), batch_size)
    record = Shard(*shard, start, stop, len(inputs.names), inputs_digest(inputs.names))
    return replace(
        inputs,
        names=inputs.names[start:stop],
        dataset=None if inputs.dataset is None else Subset(inputs.dataset, range(start, stop)),
        identity=None if inputs.identity is None else inputs.identity[start:stop],
    ), record


def check_cover(shards: Sequence[tuple[str, Shard]]) -> list[tuple[str, Shard]]:
    """``(name, shard)`` pairs of one input set in row order, once checked to cover it exactly once.

    Raises:
        InvalidValueError: naming them, two parts of the same shard, parts whose rows overlap, or rows no part holds
            (the shards missing, when the parts split the set alike).
    """
    seen: dict[tuple[int, int], str] = {}
    for name, shard in shards:
        other = seen.setdefault((shard.index, shard.count), name)
        if other != name:
            raise InvalidValueError(f"{other} and {name} are both {shard}: pass each shard once")
    ordered = sorted(shards, key=lambda pair: pair[1].start)
    covered = 0
    for (before, earlier), (name, shard) in zip([("", None), *ordered], ordered):
        if shard.start < covered:
            raise InvalidValueError(
                f"{before} ({earlier}) and {name} ({shard}) overlap in rows {shard.start}:{min(covered, shard.stop)}; "
                "merge the parts of one split (--shard i/N with one N)"
            )
        if shard.start > covered:
            raise InvalidValueError(_missing(ordered, covered, shard.start))
        covered = shard.stop
    total = ordered[0][1].set_count
    if covered < total:
        raise InvalidValueError(_missing(ordered, covered, total))
    return ordered


def _missing(ordered: Sequence[tuple[str, Shard]], start: int, stop: int) -> str:
    """Why rows ``[start, stop)`` in no part stop a merge, naming the shards missing where the parts agree on ``n``."""
    counts = {shard.count for _, shard in ordered}
    named = ""
    if len(counts) == 1:
        count = counts.pop()
        absent = sorted(set(range(count)) - {shard.index for _, shard in ordered})
        named = f"; missing: {', '.join(f'shard {index}/{count}' for index in absent)}"
    total = ordered[0][1].set_count
    return f"rows {start}:{stop} of the {total} are in no part{named} (a job not run, or its output not given)"
