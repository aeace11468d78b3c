"""The statistics of one watched call: ``call_moments``, the one function every way of summing goes through.

Exact (float64, any device) or, on the CPU when every value is finite and float32 squares of them can neither
overflow nor underflow, float32 rows added in float64; docs/probes.md has the definitions and each path's accuracy.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from ._fused import ROW, fused_moments

__all__ = [
    "ADDITIVE",
    "MAX",
    "NEG_MIN",
    "NONFINITE",
    "NONZERO",
    "SQUARES",
    "SUM",
    "Need",
    "Scratch",
    "accumulator_dtype",
    "call_moments",
    "first_value",
]

# Slots of a call's statistics: additive ones first, then maxima.
NONFINITE, SUM, SQUARES, NONZERO, NEG_MIN, MAX = range(6)
ADDITIVE = 4

# Absolute maxima between which float32 squares are taken (docs/probes.md): above, rows of squares (of values or of
# their distances to the mean) could overflow; below, the squares that make the variance would lose bits as
# subnormals or vanish. Outside, the exact path sums in float64.
_TINY = 2.0**-40
_HUGE = 2.0**56

# values up to which a call is taken in float64 at once: a handful of operations, each costing more than its
# arithmetic at that size, where the float32 row sums take more of them
_SMALL = 1 << 14

# the mean may exceed the spread by this factor (squared) before the squares are summed again around the mean:
# float32 row sums are good to about 1e-8 of the sum of squares, so the variance then keeps about 1e-6
_CANCELLATION = 100.0

# rows of int32 words summed per column when counting non-zero bytes: each byte counter reaches at most 127
_LANE_ROW = 127

_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Need:
    """Which passes over a tensor the requested statistics need."""

    flags: bool
    moments: bool
    squares: bool
    extremes: bool
    zeros: bool

    @classmethod
    def of(cls, stats: frozenset[str]) -> Need:
        extremes = bool(stats & {"min", "max", "absmax"})
        return cls(
            flags=bool(stats - {"count"}),
            moments=extremes or bool(stats & {"mean", "std"}),
            squares="std" in stats,
            extremes=extremes,
            zeros="zeros" in stats,
        )


class Scratch:
    """CPU buffers per thread and dtype, reused call after call (a call's bytes for counting zeros, its float32 copy
    for the second pass around the mean), as large as the largest call; dropped by ``clear``."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype], Tensor] = {}
        self._lock = threading.Lock()

    def host(self, n: int, dtype: torch.dtype) -> Tensor:
        """A CPU buffer of ``n`` elements."""
        key = (threading.get_ident(), dtype)
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < n:
                with torch.inference_mode(False):  # a normal tensor: writable in and outside inference mode
                    buffer = self._buffers[key] = torch.empty(n, dtype=dtype)
        return buffer[:n]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


@overload
def call_moments(
    x: Tensor, need: Need, scratch: Scratch, shift: float, *, read_now: Literal[True], fused: bool
) -> list[float]: ...
@overload
def call_moments(
    x: Tensor, need: Need, scratch: Scratch, shift: Tensor, *, read_now: Literal[False], fused: bool
) -> Tensor: ...
def call_moments(
    x: Tensor, need: Need, scratch: Scratch, shift: Tensor | float, *, read_now: bool, fused: bool
) -> list[float] | Tensor:
    """One call's statistics by slot: the number of non-finite values (``NONFINITE``), the sum of the finite values
    (``SUM``) and of their squared distances to ``shift`` (``SQUARES``), the number of non-zero finite values, minus
    the minimum and the maximum of the finite values (``NEG_MIN``, ``MAX``; -inf both when none is finite).

    ``read_now`` (a CPU tensor, which the host reads at no cost): Python floats, from the fast path where it applies
    (``fused``: its compiled pass), else from the exact one. Otherwise a vector of the accumulators' dtype on
    ``x``'s device from the exact path, which reads nothing on the host. Grad mode and autocast do not reach the
    arithmetic.
    """
    accumulate = accumulator_dtype(x.device)
    if not need.flags:
        zeros = torch.zeros(ADDITIVE + 2, dtype=accumulate, device=x.device)
        return zeros.tolist() if read_now else zeros
    flat = _flat(x.detach())
    if read_now and flat.dtype in _FAST_DTYPES:  # reductions of a detached tensor: no graph, no autocast policy
        fast = fast_moments(flat, need, scratch, float(shift), fused)
        if fast is not None:
            return fast
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        exact = exact_moments(flat.to(accumulate), need, torch.as_tensor(shift, dtype=accumulate, device=x.device))
    return exact.tolist() if read_now else exact


def accumulator_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def first_value(x: Tensor) -> Tensor:
    """The first element of ``x`` as a float32 0-d tensor on its device (0 if it is not finite): a shift for the
    sums."""
    return torch.nan_to_num(_flat(x)[0].detach().float(), nan=0.0, posinf=0.0, neginf=0.0)


def exact_moments(values: Tensor, need: Need, shift: Tensor) -> Tensor:
    """``call_moments`` of a 1-D tensor in the accumulators' dtype, pairwise summation, no host sync."""
    zero = values.new_zeros(())
    flags = torch.sub(values, values).nan_to_num_(nan=1.0)  # x - x: 0, NaN where x is not finite
    nonfinite = flags.sum()
    total = squares = nonzero = low = high = zero
    if need.moments or need.zeros:
        finite = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        total = finite.sum()
        if need.squares:
            squares = _sum_of_squares(torch.where(flags == 0, finite - shift, zero))
        if need.zeros:
            nonzero = torch.count_nonzero(finite).to(values.dtype)
        if need.extremes:
            # non-finite values become the finite mean, which lies within [min, max]; NaN if none is finite
            finite.addcmul_(flags, total / (values.numel() - nonfinite))
            low, high = torch.aminmax(finite)
            low, high = low.nan_to_num(nan=math.inf), high.nan_to_num(nan=-math.inf)
    return torch.stack([nonfinite, total, squares, nonzero, -low, high])


def fast_moments(flat: Tensor, need: Need, scratch: Scratch, shift: float, fused: bool) -> list[float] | None:
    """``call_moments`` of a float32, bfloat16 or float16 CPU tensor, read at once: float32 rows of ``ROW`` values
    added in float64 (``fused``: one compiled pass), and where the mean is large against the spread the squares
    summed again around the mean. ``None`` (the exact path decides) when a value is not finite or the absolute
    maximum lies outside the range where float32 squares are exact enough."""
    n = flat.numel()
    if fused and n >= 2 * ROW:
        with torch.autocast(flat.device.type, enabled=False):
            low, high, total, squares, nonzero = fused_moments(flat)
    elif n <= _SMALL:
        low, high, total, squares, nonzero = _small_moments(flat, need.zeros)
    else:
        low, high, total, squares, nonzero = _row_moments(flat, need.zeros, scratch)
    top = max(abs(low), abs(high))
    if not (math.isfinite(top) and math.isfinite(total + squares) and (top == 0 or _TINY <= top <= _HUGE)):
        return None
    mean = total / n
    central = squares - total * mean  # the sum of squares about the mean, if nothing cancelled
    if mean * mean > _CANCELLATION * max(central / n, 0.0):  # a mean far above the spread: sum around it
        pivot = torch.tensor(mean, dtype=torch.float32)  # what the float32 subtraction takes away
        near = scratch.host(n, torch.float32).copy_(flat).sub_(pivot)
        offset, squares = torch.stack([_sum(near), _sum_of_squares(near, torch.float64)]).tolist()
        central = squares - offset * offset / n
        mean = pivot.item() + offset / n
        total = mean * n
    about_shift = max(central, 0.0) + n * (mean - shift) ** 2
    return [0.0, total, about_shift, nonzero if need.zeros else 0.0, -low, high]


def _small_moments(flat: Tensor, zeros: bool) -> list[float]:
    """``_row_moments`` of a tensor of at most ``_SMALL`` values: all of it in float64 at once, one host read."""
    wide = flat.double()
    parts = [*torch.aminmax(wide), wide.sum(), torch.dot(wide, wide)]
    if zeros:
        parts.append(torch.count_nonzero(wide).double())
    read: list[float] = torch.stack(parts).tolist()
    return read if zeros else [*read, 0.0]


def _row_moments(flat: Tensor, zeros: bool, scratch: Scratch) -> list[float]:
    """``[min, max, sum, sum of squares, non-zero count]`` of a float32, bfloat16 or float16 1-D CPU tensor in one
    host read: min and max in its dtype (exact), float32 sums and norms of rows of ``ROW`` values (converted as they
    are read) added in float64, the last ``len % ROW`` values in float64; the non-zero count with ``zeros`` (else
    0)."""
    n = flat.numel()
    body = n - n % ROW
    rows = flat[:body].view(body // ROW, ROW)
    per_row = torch.stack(
        [rows.sum(1, dtype=torch.float32), torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)]
    ).double()
    per_row[1].square_()
    sums = per_row.sum(1)
    if body < n:
        tail = flat[body:].double()
        sums = sums + torch.stack([tail.sum(), torch.dot(tail, tail)])
    parts = [torch.stack(torch.aminmax(flat)).double(), sums]
    if zeros:
        parts.append(_count_nonzero(flat, scratch).double().view(1))
    read: list[float] = torch.cat(parts).tolist()
    return read if zeros else [*read, 0.0]


def _count_nonzero(flat: Tensor, scratch: Scratch) -> Tensor:
    """How many values of a CPU 1-D tensor are not 0 (an int64 0-d tensor), exactly: the values become bytes (1
    where not 0) in a scratch buffer, read as int32 words of four byte counters summed column by column over
    ``_LANE_ROW`` rows (no counter overflows into the next), then the byte counters of the column sums are added."""
    n = flat.numel()
    flags = scratch.host(n, torch.bool).copy_(flat)
    body = n - n % (4 * _LANE_ROW)
    count = flags[body:].sum()
    if body:
        sums = flags[:body].view(torch.int32).view(_LANE_ROW, -1).sum(dim=0, dtype=torch.int32)
        count = count + sums.view(torch.uint8).sum(dtype=torch.int64)
    return count


def _sum_of_squares(flat: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Sum of squares of a 1-D tensor: norms of rows of ``ROW`` values in its dtype, then a pairwise sum of their
    squares in ``dtype`` (default: its own); the last ``len % ROW`` values in ``dtype``."""
    dtype = dtype or flat.dtype
    n = flat.numel()
    body = n - n % ROW
    tail = flat[body:].to(dtype)
    squares = torch.dot(tail, tail)
    if body:
        norms = torch.linalg.vector_norm(flat[:body].view(body // ROW, ROW), dim=1)
        squares = squares + norms.to(dtype).square_().sum()
    return squares


def _sum(flat: Tensor) -> Tensor:
    """Sum of a float32 1-D tensor as a float64 0-d tensor: float32 sums of rows of ``ROW`` values, added in
    float64."""
    body = flat.numel() - flat.numel() % ROW
    return flat[:body].view(body // ROW, ROW).sum(dim=1).double().sum() + flat[body:].double().sum()


def _flat(x: Tensor) -> Tensor:
    """The elements of ``x`` as a 1-D view in memory order (a copy only when ``x`` is not dense)."""
    if x.is_contiguous():
        return x.view(-1)
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    permuted = x.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else x.reshape(-1)
