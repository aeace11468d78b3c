"""``watch``: activation and gradient statistics of a model you train, cheap enough to leave on.

Every call of a watched module adds its output's statistics (and, in backward, its gradient's) to running sums:
on an accelerator kept on the device with no host sync and read once by ``Watch.summary()``; on the CPU, where a
read waits for nothing, read at once and added on the host, through a fast path when every value is finite.
Moments are over the finite values only, summed about a shift so that a large mean cannot cancel the variance;
docs/probes.md has the exact definitions, each path's accuracy and its cost.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .._hooks import ClosedOnExit, Observer, ObserverSession
from .._taps import call_name
from ..errors import InvalidTypeError, InvalidValueError, did_you_mean
from ..layers import select_modules
from ._fused import ROW, fused_moments
from ._torch import pytree_leaves, row_mean_var

__all__ = ["STATS", "Watch", "WatchRow", "watch"]

STATS = ("count", "mean", "std", "min", "max", "absmax", "zeros", "nonfinite")
"""The statistics ``watch`` can compute (all of them by default; fewer is cheaper), as ``WatchRow`` fields.

Examples:
    >>> import torch
    >>> from featurehooks.probes import STATS, watch
    >>> "absmax" in STATS
    True
    >>> net = torch.nn.Linear(4, 2)
    >>> with watch(net, grads=False, stats=("mean", "absmax")) as w:
    ...     _ = net(torch.randn(8, 4))
    >>> row = w.summary()[0]
    >>> row.absmax >= abs(row.mean), row.std is None  # std was not requested
    (True, True)
"""
KINDS = ("output", "grad")
# Slots of the per-call vector and of the running sums: additive ones first, then maxima.
_NONFINITE, _SUM, _SQUARES, _NONZERO, _NEG_MIN, _MAX, _SHIFT = range(7)
_ADDITIVE = 4
_SLOTS = 7
READ_AT_ONCE = frozenset({"cpu"})  # device types whose values the host reads at no cost: summed on the host


class ScalarWriter(Protocol):
    """What ``Watch.log()`` needs: ``torch.utils.tensorboard.SummaryWriter`` has it."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


@dataclass(frozen=True)
class WatchRow:
    """The statistics of one layer call over the current window (``None``: not requested).

    ``name`` is the per-call name (``path``, ``path_1``, ...), ``kind`` is ``"output"`` or
    ``"grad"`` (the gradient with respect to that output), ``calls`` how many calls were summed and
    ``count`` how many values. ``mean``, ``std`` (population), ``min``, ``max`` and ``absmax`` are
    over the finite values (NaN when there were none), ``zeros`` is the fraction of values that are
    exactly 0 and ``nonfinite`` the number of NaN and ±inf values.

    Examples:
        >>> import torch
        >>> from featurehooks.probes import watch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
        >>> with watch(net, "1", grads=False) as w:
        ...     _ = net(torch.randn(16, 4))
        >>> row = w.summary()[0]
        >>> row.name, row.kind, row.calls, row.count, row.min >= 0, row.nonfinite
        ('1', 'output', 1, 128, True, 0)
    """

    name: str
    path: str
    call: int
    kind: str
    calls: int
    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    absmax: float | None
    zeros: float | None
    nonfinite: int | None


@dataclass(frozen=True)
class _Need:
    """Which passes over a tensor the requested statistics need."""

    flags: bool
    moments: bool
    squares: bool
    extremes: bool
    zeros: bool

    @classmethod
    def of(cls, stats: frozenset[str]) -> _Need:
        extremes = bool(stats & {"min", "max", "absmax"})
        return cls(
            flags=bool(stats - {"count"}),
            moments=extremes or bool(stats & {"mean", "std"}),
            squares="std" in stats,
            extremes=extremes,
            zeros="zeros" in stats,
        )


def _host_call_stats(x: Tensor, need: _Need, scratch: _Scratch, shift: float, fused: bool) -> list[float]:
    """``_call_stats`` of a CPU tensor, read at once (the host waits for nothing): the fast path when every value is
    finite, else the exact one."""
    if not need.flags:
        return [0.0] * _SHIFT
    if x.dtype in _FAST_DTYPES:
        fast = _finite_call_stats(x, need, scratch, shift, fused)
        if fast is not None:
            return fast
    return _call_stats(x, need, scratch, torch.tensor(shift, dtype=torch.float64)).tolist()


def _call_stats(x: Tensor, need: _Need, scratch: _Scratch, shift: Tensor) -> Tensor:
    """One call's statistics as a vector of the accumulators' dtype on ``x``'s device; no host sync.

    Slots: number of non-finite values, sum of the finite values and sum of their squared distances
    to ``shift`` (a 0-d tensor), number of non-zero finite values, minus the minimum and the maximum
    of the finite values (NaN: none).
    Computed in float64 (float32 on MPS, which has no float64) over the elements in memory order. On the
    CPU the tensor is taken in chunks of ``_CHUNK`` values through small scratch buffers, so the
    passes after the first read it from the cache instead of memory.
    """
    # float64 wherever the device has it: the squares of finite float32 values (up to 1.2e77), their sums and
    # differences (3e38 - -3e38) are all finite there, so every finite input gives finite statistics
    accumulate = _accumulator_dtype(x.device)
    dtype = accumulate
    if not need.flags:
        return torch.zeros(6, dtype=accumulate, device=x.device)
    source = _flat(x)
    n = source.numel()
    chunk = _CHUNK if x.device.type == "cpu" else n
    low_precision = source.dtype != dtype
    first, second, third = [*scratch.take(min(chunk, n), dtype, x.device, 3 if low_precision else 2), None][:3]
    zero = torch.zeros((), dtype=dtype, device=x.device)
    shift = shift.to(dtype)
    parts: list[Tensor] = []
    for start in range(0, n, chunk):
        part = source[start : start + chunk]
        size = part.numel()
        if low_precision:  # float32/bfloat16/float16: one conversion, then everything in float64
            part = third[:size].copy_(part) if third is not None else part.to(dtype)
        total = squares = nonzero = low = high = zero
        if need.moments or need.zeros:
            finite = torch.nan_to_num(part, nan=0.0, posinf=0.0, neginf=0.0, out=_head(first, size))
            total = finite.sum()
            if need.squares:  # non-finite values sit at 0 here: each adds shift**2, taken off below
                squares = _sum_of_squares(torch.sub(finite, shift, out=_head(second, size)))
            if need.zeros:
                signs = torch.sign(finite, out=_head(second, size))
                nonzero = torch.dot(signs, signs)  # exact: a sum of ones and zeros
        flags = torch.sub(part, part, out=_head(second, size)).nan_to_num_(nan=1.0)  # x - x: 0, NaN if not finite
        nonfinite = flags.sum()
        if need.squares:
            squares = squares - nonfinite * shift * shift
        if need.extremes:
            # non-finite values become the finite mean, which lies within [min, max]; NaN if none is finite
            finite.addcmul_(flags, total / (size - nonfinite))
            low, high = torch.aminmax(finite)
        parts += (nonfinite, total, squares, nonzero, low, high)
    values = torch.stack(parts).view(-1, 6).to(accumulate)
    low = values[:, 4].nan_to_num(nan=math.inf).amin()
    high = values[:, 5].nan_to_num(nan=-math.inf).amax()
    return torch.cat([values[:, :_ADDITIVE].sum(0), torch.stack([-low, high])])


_FAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _finite_call_stats(x: Tensor, need: _Need, scratch: _Scratch, shift: float, fused: bool) -> list[float] | None:
    """``_call_stats`` of a CPU tensor whose values are all finite, read on the host; ``None`` (the exact path
    decides) when a value is not finite or a float32 sum overflows.

    float32: four passes, sums of rows of ``ROW`` values in float32 (vectorized) added in float64; where the mean is
    large against the spread, the squares are summed again around the mean, so ``1000 ± 0.01`` keeps its std.
    bfloat16 and float16: ``_reduced_call_stats``. ``fused``: one compiled pass for every dtype. Few operations a
    call: in a training step each costs several times what it costs in a loop (the step's large operations have
    emptied the caches).
    """
    source = _flat(x)
    if source.numel() <= _SMALL:
        return _small_call_stats(source, need, shift)
    if not fused and source.dtype != torch.float32:
        return _reduced_call_stats(source, need, scratch, shift)
    n = source.numel()
    if fused:
        low, high, total, squares, nonzero = fused_moments(source)
    else:
        low, high, total, squares, nonzero = _moments(source, source if need.zeros else None, scratch)
    if not all(map(math.isfinite, (low, high, total, squares))):
        return None
    mean = total / n
    central = squares - total * mean  # the sum of squares about the mean, if nothing cancelled
    if mean * mean > _CANCELLATION * max(central / n, 0.0):  # a mean far above the spread: sum around it
        (buffer,) = scratch.host(n, torch.float32, 1)
        pivot = torch.tensor(mean, dtype=torch.float32)  # what the float32 subtraction takes away
        near = buffer.copy_(source).sub_(pivot)
        offset, squares = torch.stack([_sum(near), _sum_of_squares(near, torch.float64)]).tolist()
        central = squares - offset * offset / n
        mean = pivot.item() + offset / n
        total = mean * n
    about_shift = max(central, 0.0) + n * (mean - shift) ** 2
    return [0.0, total, about_shift, nonzero if need.zeros else 0.0, -low, high]


def _reduced_call_stats(source: Tensor, need: _Need, scratch: _Scratch, shift: float) -> list[float] | None:
    """``_finite_call_stats`` of a bfloat16 or float16 1-D tensor of more than ``ROW`` values, without a float32
    copy: min and max in its own dtype (exact), and each row's mean and variance in float32 by batch norm's
    statistics kernel, which reads a row from memory once (two passes while it is in the cache, so no large mean
    cancels a row's variance) and writes no output. The rows' sums of squares about ``shift``,
    ``ROW * (variance + (mean - shift) ** 2)``, are added in float64, the last ``len % ROW`` values taken in
    float64 (accuracy and cost against four float32 passes after a float32 copy: docs/probes.md).
    """
    n = source.numel()
    body = n - n % ROW
    rows = body // ROW
    (running,) = scratch.host(2 * rows, torch.float32, 1)  # per-thread scratch for the kernel, never read
    mean, variance = row_mean_var(source[:body].view(1, rows, ROW), running)
    low, high = (value.item() for value in torch.aminmax(source))
    mean_sum, variance_sum = torch.stack([mean, variance]).sum(1, dtype=torch.float64).tolist()
    mean_squares = torch.linalg.vector_norm(mean, dtype=torch.float64).item() ** 2
    # sum over rows of ROW * (variance + (mean - shift) ** 2), expanded: float64 holds the float32 moments' squares
    # exactly enough that nothing a float32 mean can resolve cancels
    total = ROW * mean_sum
    about_shift = ROW * (variance_sum + mean_squares - 2 * shift * mean_sum + rows * shift * shift)
    if body < n:
        tail = source[body:].double()
        tail_sum = tail.sum().item()
        total += tail_sum
        about_shift += torch.dot(tail, tail).item() - 2 * shift * tail_sum + (n - body) * shift * shift
    if not all(map(math.isfinite, (low, high, total, about_shift))):
        return None
    nonzero = float(_count_nonzero(source, scratch)) if need.zeros else 0.0
    return [0.0, total, about_shift, nonzero, -low, high]


def _moments(flat: Tensor, zeros_of: Tensor | None, scratch: _Scratch) -> list[float]:
    """``[min, max, sum, sum of squares, non-zero count]`` of a float32 1-D CPU tensor of at least ``ROW`` values,
    in one host read: float32 sums and norms of rows of ``ROW`` values added in float64, the last ``len % ROW``
    values in float64; the non-zero values are counted in ``zeros_of`` (0 when None)."""
    n = flat.numel()
    body = n - n % ROW
    rows = flat[:body].view(-1, ROW)
    per_row = torch.stack([rows.sum(1), torch.linalg.vector_norm(rows, dim=1)]).double()
    per_row[1].square_()
    sums = per_row.sum(1)
    if body < n:
        tail = flat[body:].double()
        sums = sums + torch.stack([tail.sum(), torch.dot(tail, tail)])
    parts = [torch.stack(torch.aminmax(flat)).double(), sums]
    if zeros_of is not None:
        parts.append(_count_nonzero(zeros_of, scratch).double().view(1))
    read: list[float] = torch.cat(parts).tolist()
    return read if zeros_of is not None else [*read, 0.0]


def _small_call_stats(source: Tensor, need: _Need, shift: float) -> list[float] | None:
    """``_finite_call_stats`` of a tensor of at most ``_SMALL`` values: everything in float64 at once, a handful of
    operations, each costing more than its arithmetic here (fewer than the row-sum passes take)."""
    wide = source.to(torch.float64, copy=True)  # changed in place below
    low, high = torch.aminmax(wide)
    total = wide.sum()
    about = wide.sub_(shift)
    read = torch.stack([low, high, total, torch.dot(about, about)]).tolist()  # the one host read: free on the CPU
    if not all(map(math.isfinite, read)):
        return None
    low, high, total, about_shift = read
    nonzero = float(torch.count_nonzero(source)) if need.zeros else 0.0
    return [0.0, total, about_shift, nonzero, -low, high]


# values up to which a call is summed in float64 at once (where that beats float32 row sums: docs/probes.md)
_SMALL = 1 << 14

# the mean may exceed the spread by this factor (squared) before the squares are summed again around the mean:
# float32 row sums are good to about 1e-8 of the sum of squares, so the variance then keeps about 1e-6
_CANCELLATION = 100.0


def _count_nonzero(flat: Tensor, scratch: _Scratch) -> Tensor:
    """How many values of a CPU 1-D tensor are not 0 (an int64 0-d tensor), exactly, in one conversion pass and two
    cheap sums.

    The values become bytes (1 where not 0) in a scratch buffer, read as int32 words of four byte counters;
    ``_LANE_ROW`` rows of words add up column by column in int32 without a counter overflowing into the next,
    and the byte counters of the column sums are added (much faster than ``torch.count_nonzero`` or a ``sum`` of
    bools or bytes: docs/probes.md).
    """
    n = flat.numel()
    (buffer,) = scratch.host(n, torch.bool, 1)
    flags = buffer.copy_(flat)
    body = n - n % (4 * _LANE_ROW)
    sums = flags[:body].view(torch.int32).view(_LANE_ROW, -1).sum(dim=0, dtype=torch.int32)
    count = sums.view(torch.uint8).sum(dtype=torch.int64)
    return count + flags[body:].sum() if body < n else count


# rows of int32 words summed per column: each byte counter reaches at most 127, no carry nor sign overflow
_LANE_ROW = 127


def _first_value(x: Tensor) -> Tensor:
    """The first element of ``x`` as a 0-d tensor on its device (0 if it is not finite): a shift for the sums."""
    return torch.nan_to_num(_flat(x)[0].detach().float(), nan=0.0, posinf=0.0, neginf=0.0)


def _head(buffer: Tensor | None, size: int) -> Tensor | None:
    return None if buffer is None else buffer[:size]


# Values per pass on the CPU: chunk and scratch buffers (2 MiB each) stay in the cache between passes.
_CHUNK = 1 << 19


def _sum_of_squares(flat: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Sum of squares of a 1-D tensor: norms of rows of about 1024 values in its dtype, then a pairwise sum of their
    squares in ``dtype`` (default: its own; accurate)."""
    dtype = dtype or flat.dtype
    n = flat.numel()
    body = n - n % ROW
    tail = flat[body:].to(dtype)
    if body == 0:
        return torch.dot(tail, tail)
    squares: Tensor = torch.linalg.vector_norm(flat[:body].view(-1, ROW), dim=1).to(dtype).square_().sum()
    if body < n:
        squares = squares + torch.dot(tail, tail)
    return squares


def _sum(flat: Tensor) -> Tensor:
    """Sum of a float32 1-D tensor as a float64 0-d tensor: float32 sums of rows of ``ROW`` values, added in
    float64."""
    body = flat.numel() - flat.numel() % ROW
    return flat[:body].view(-1, ROW).sum(dim=1).double().sum() + flat[body:].double().sum()


def _flat(x: Tensor) -> Tensor:
    """The elements of ``x`` as a 1-D view in memory order (a copy only when ``x`` is not dense)."""
    if x.is_contiguous():
        return x.view(-1)
    strides = x.stride()
    order = sorted(range(x.dim()), key=lambda d: -strides[d])
    permuted = x.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else x.reshape(-1)


class _Scratch:
    """Flat buffers per thread and dtype on the CPU, reused call after call (a chunk each on the exact path; on the
    fast path a whole tensor's bytes for counting zeros, a float32 copy for the second pass where the mean would
    cancel, and a bfloat16 or float16 call's unused running statistics); as large as the largest call watched,
    dropped by ``clear``."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, n: int, dtype: torch.dtype, device: torch.device, count: int) -> list[Tensor | None]:
        """``count`` buffers of ``n`` elements (``None`` each off the CPU: allocate as usual there)."""
        if device.type != "cpu":  # device allocators cache blocks already, and streams must not share them
            return [None] * count
        return list(self.host(n, dtype, count))

    def host(self, n: int, dtype: torch.dtype, count: int) -> list[Tensor]:
        """``count`` CPU buffers of ``n`` elements."""
        key = (threading.get_ident(), dtype)
        with self._lock:
            buffers = self._buffers.get(key, [])
            if len(buffers) < count or buffers[0].numel() < n:
                size = max(n, buffers[0].numel() if buffers else 0)
                with torch.inference_mode(False):  # normal tensors: writable in and outside inference mode
                    buffers = [torch.empty(size, dtype=dtype) for _ in range(max(count, len(buffers)))]
                self._buffers[key] = buffers
        return [buffer[:n] for buffer in buffers[:count]]

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


def _accumulator_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


def _first_float(value: Any) -> Tensor | None:
    """The first floating-point, strided, non-empty tensor of an output (tuples, dicts: pytree order)."""
    if isinstance(value, Tensor):
        leaves: Iterable[Any] = (value,)
    else:
        leaves = pytree_leaves(value)
    for leaf in leaves:
        if isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.layout == torch.strided and leaf.numel():
            return leaf
    return None


def _moved_to_shift(values: list[float], count: int, shift: float) -> list[float]:
    """``values`` with their sum of squares taken about ``shift`` instead of their own shift."""
    finite = count - round(values[_NONFINITE])
    delta = values[_SHIFT] - shift
    moved = list(values)
    moved[_SQUARES] += 2 * delta * (values[_SUM] - finite * values[_SHIFT]) + finite * delta * delta
    moved[_SHIFT] = shift
    return moved


class _HostSums:
    """Running sums of one (layer, call, kind) on the CPU, as Python floats: each call's statistics are read at once
    there (the host waits for nothing), and a tensor operation costs more than the additions."""

    __slots__ = ("calls", "count", "values")

    def __init__(self, first: Tensor) -> None:
        self.values = [0.0] * _ADDITIVE + [-math.inf, -math.inf, _first_value(first).item()]
        self.calls = 0
        self.count = 0

    def take(self, tensor: Tensor, watch: Watch) -> None:
        """Add the statistics of one call's (detached) ``tensor``: float64 or host arithmetic, which autocast and
        grad mode cannot reach."""
        values = _host_call_stats(tensor, watch._need, watch._scratch, self.values[_SHIFT], watch.fused)
        with watch._lock:
            sums = self.values
            for slot in range(_ADDITIVE):
                sums[slot] += values[slot]
            sums[_NEG_MIN] = max(sums[_NEG_MIN], values[_NEG_MIN])
            sums[_MAX] = max(sums[_MAX], values[_MAX])
            self.calls += 1
            self.count += tensor.numel()

    def snapshot(self) -> list[float]:
        """A copy of the sums and the shift (the caller holds the lock)."""
        return list(self.values)


class _DeviceSums:
    """Running sums of one (layer, call, kind) on an accelerator: a tensor there, added to without a host sync."""

    __slots__ = ("calls", "count", "values")

    def __init__(self, first: Tensor) -> None:
        with torch.inference_mode(False):  # a normal tensor: updated in and outside inference mode
            self.values = torch.zeros(_SLOTS, dtype=_accumulator_dtype(first.device), device=first.device)
            self.values[_ADDITIVE:_SHIFT] = -math.inf
            self.values[_SHIFT] = _first_value(first)
        self.calls = 0
        self.count = 0

    def take(self, tensor: Tensor, watch: Watch) -> None:
        """Add the statistics of one call's (detached) ``tensor``, computed on its device."""
        with torch.no_grad(), torch.autocast(tensor.device.type, enabled=False):
            values = _call_stats(tensor, watch._need, watch._scratch, self.values[_SHIFT])
        with watch._lock:
            self.values[:_ADDITIVE].add_(values[:_ADDITIVE])
            torch.fmax(self.values[_ADDITIVE:_SHIFT], values[_ADDITIVE:], out=self.values[_ADDITIVE:_SHIFT])
            self.calls += 1
            self.count += tensor.numel()

    def snapshot(self) -> Tensor:
        """A copy of the sums and the shift, on the device (the caller holds the lock)."""
        return self.values.clone()


class _GradStats:
    """Tensor hook on one output: adds the statistics of the gradient with respect to it."""

    def __init__(self, owner: Watch, path: str, call: int) -> None:
        self.owner = owner
        self.path = path
        self.call = call

    def __call__(self, grad: Tensor) -> None:
        self.owner._add(self.path, self.call, "grad", grad)


class Watch(Observer[None], ClosedOnExit):
    """Statistics of the outputs (and gradients) of a model's layers; see ``watch()``.

    A context manager and a handle: hooks are registered on construction and removed by
    ``close()`` or at the end of a ``with`` block, also after an exception.

    Examples:
        >>> import torch
        >>> from featurehooks.probes import Watch, watch
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        >>> w = watch(net)  # a handle that lives across training steps
        >>> isinstance(w, Watch)
        True
        >>> for step in range(3):
        ...     net(torch.randn(16, 4)).pow(2).mean().backward()
        >>> [(row.name, row.kind, row.calls) for row in w.summary()]
        [('0', 'output', 3), ('0', 'grad', 3), ('2', 'output', 3), ('2', 'grad', 3)]
        >>> w.close()
    """

    def __init__(
        self,
        model: nn.Module,
        layers: str | Sequence[str] | None = None,
        *,
        grads: bool = True,
        stats: Sequence[str] = STATS,
        fused: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"watch needs an nn.Module, got {type(model).__name__}")
        self.stats = _check_stats(stats)
        self.grads = bool(grads)
        self.fused = bool(fused)
        self._need = _Need.of(self.stats)
        selection = select_modules(model, layers, default=_leaves_with_parameters, what="watch")
        self._order = {path: k for k, path in enumerate(selection.paths)}
        self._types = {path: type(model.get_submodule(path)).__name__ for path in selection.paths}
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, int, str, torch.device], _HostSums | _DeviceSums] = {}
        self._scratch = _Scratch()
        self._hooked: MutableMapping[Tensor, dict[tuple[str, int], Any]] = WeakIdKeyDictionary()  # site -> grad_fn
        self._session = ObserverSession(model, selection, self)

    # Observer ------------------------------------------------------------------------------------

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        return None  # statistics add up across forwards: nothing is kept per forward

    def after(self, state: None, path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        tensor = _first_float(output)
        if tensor is None:
            return
        self._add(path, call, "output", tensor)
        if self.grads and tensor.requires_grad and torch.is_grad_enabled():
            # one hook per tensor, call site and grad_fn: an output that outlives forwards (a module returning a
            # leaf) would otherwise gather a hook a forward, each adding the same gradient again
            sites = self._hooked.setdefault(tensor, {})
            if (path, call) not in sites or sites[path, call] is not tensor.grad_fn:
                sites[path, call] = tensor.grad_fn
                self._session.hold(tensor, _GradStats(self, path, call))

    def _add(self, path: str, call: int, kind: str, tensor: Tensor) -> None:
        if not self._session.active:
            return
        if not tensor.numel():
            return
        key = (path, call, kind, tensor.device)
        with self._lock:
            sums = self._sums.get(key)
            if sums is None:
                kind_of_sums = _HostSums if tensor.device.type in READ_AT_ONCE else _DeviceSums
                sums = self._sums[key] = kind_of_sums(tensor)
        try:
            sums.take(tensor.detach(), self)
        except BaseException:
            with self._lock:  # a first call that raised (the fused kernel could not be built) leaves no empty row
                if sums.calls == 0 and self._sums.get(key) is sums:
                    del self._sums[key]
            raise

    # handle --------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the hooks are still registered."""
        return self._session.active

    def close(self) -> None:
        """Remove every hook (module and tensor hooks); the statistics stay readable. Safe to call twice."""
        self._session.remove()
        self._scratch.clear()
        self._hooked.clear()

    def reset(self) -> None:
        """Start a new window: forget everything accumulated so far."""
        with self._lock:
            self._sums.clear()

    def summary(self) -> list[WatchRow]:
        """One row per layer, call and kind, in module order, outputs before gradients.

        The only method that reads device memory: one transfer per device, whatever the number of rows.
        """
        with self._lock:
            items = [(key, sums.snapshot(), sums.calls, sums.count) for key, sums in self._sums.items()]
        host: list[list[float]] = []
        on_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for k, (key, snapshot, _calls, _count) in enumerate(items):
            if isinstance(snapshot, Tensor):
                on_device.setdefault(key[3], []).append((k, snapshot))
            host.append(snapshot if isinstance(snapshot, list) else [])
        for pairs in on_device.values():
            stacked = torch.stack([sums for _k, sums in pairs]).tolist()
            for (k, _sums), read in zip(pairs, stacked):
                host[k] = read
        merged: dict[tuple[str, int, str], tuple[list[float], int, int]] = {}
        for (key, _values, calls, count), values in zip(items, host):
            row_key = key[:3]
            if row_key in merged:  # the same layer call on several devices (nn.DataParallel replicas)
                old, old_calls, old_count = merged[row_key]
                values = _moved_to_shift(values, count, old[_SHIFT])
                values = (
                    [a + b for a, b in zip(old[:_ADDITIVE], values[:_ADDITIVE])]
                    + [max(a, b) for a, b in zip(old[_ADDITIVE:_SHIFT], values[_ADDITIVE:_SHIFT])]
                    + [old[_SHIFT]]
                )
                calls, count = calls + old_calls, count + old_count
            merged[row_key] = (values, calls, count)
        ordered = sorted(merged, key=lambda k: (self._order[k[0]], k[1], KINDS.index(k[2])))
        return [self._row(key, *merged[key]) for key in ordered]

    def _row(self, key: tuple[str, int, str], values: list[float], calls: int, count: int) -> WatchRow:
        path, call, kind = key
        nonfinite = round(values[_NONFINITE])
        finite = count - nonfinite
        mean = values[_SUM] / finite if finite else math.nan
        offset = mean - values[_SHIFT]
        variance = max(values[_SQUARES] / finite - offset * offset, 0.0) if finite else math.nan
        low = -values[_NEG_MIN] if finite else math.nan
        high = values[_MAX] if finite else math.nan
        zeros = max(finite - round(values[_NONZERO]), 0) / count if count else math.nan
        wanted = self.stats

        def pick(name: str, value: float | int) -> Any:
            return value if name in wanted else None

        return WatchRow(
            name=call_name(path, call),
            path=path,
            call=call,
            kind=kind,
            calls=calls,
            count=count,
            mean=pick("mean", mean),
            std=pick("std", math.sqrt(variance)),
            min=pick("min", low),
            max=pick("max", high),
            absmax=pick("absmax", max(abs(low), abs(high)) if finite else math.nan),
            zeros=pick("zeros", zeros),
            nonfinite=pick("nonfinite", nonfinite),
        )

    def log(self, writer: ScalarWriter, step: int, *, prefix: str = "watch") -> list[WatchRow]:
        """Write every requested statistic as ``add_scalar(f"{prefix}/{name}/{kind}/{stat}", value, step)``.

        ``writer`` is a ``torch.utils.tensorboard.SummaryWriter`` or anything with that method.
        Returns the rows written (one ``summary()``).
        """
        rows = self.summary()
        for row in rows:
            for stat in STATS:
                if stat in self.stats:
                    writer.add_scalar(f"{prefix}/{row.name}/{row.kind}/{stat}", float(getattr(row, stat)), step)
        return rows

    def to_csv(self, path: str | os.PathLike[str], *, step: int | None = None, append: bool = False) -> list[WatchRow]:
        """Write the rows of ``summary()`` to a CSV file (a ``step`` column first, empty when None).

        With ``append``, rows are added to an existing file (the header is written once). Returns the rows.
        """
        rows = self.summary()
        new = not append or not os.path.exists(path) or os.path.getsize(path) == 0
        with open(path, "a" if append else "w", newline="") as f:
            out = csv.writer(f)
            if new:
                out.writerow(["step", "type", *(field.name for field in fields(WatchRow))])
            for row in rows:
                cells = ["" if v is None else v for v in astuple(row)]
                out.writerow(["" if step is None else step, self._types[row.path], *cells])
        return rows

    def __repr__(self) -> str:
        state = "active" if self.active else "closed"
        fused = ", fused=True" if self.fused else ""
        return f"Watch({len(self._order)} layers, grads={self.grads}{fused}, {state})"


def watch(
    model: nn.Module,
    layers: str | Sequence[str] | None = None,
    *,
    grads: bool = True,
    stats: Sequence[str] = STATS,
    fused: bool = False,
) -> Watch:
    """Accumulate statistics of layer outputs and of their gradients while you train ``model``.

    The model is neither copied nor frozen nor switched to eval. For every call of every watched
    layer the output's statistics are added to running sums on the device, with no host sync; the
    model may run several times per step (the calls add up) and in several threads. With ``grads``
    a tensor hook on each output adds the statistics of the gradient with respect to it during
    backward. ``Watch.summary()`` reads the sums (one sync) as ``WatchRow``\\ s;
    ``Watch.reset()`` starts a new window; ``Watch.log()`` writes to a TensorBoard
    ``SummaryWriter``; ``Watch.to_csv()`` to a CSV file.

    A module whose output is a tuple, list or dict is summarized by its first floating-point tensor.
    docs/probes.md gives the exact definitions.

    Args:
        model: the model to watch.
        layers: module paths, aliases or glob patterns over module paths (``"layer*.conv1"``); a
            path watches every call of its module and ``path_k`` only call k. Default: every
            leaf module with parameters of its own.
        grads: also watch the gradients with respect to the outputs.
        stats: which statistics to compute, from ``STATS`` (fewer is cheaper).
        fused: on the CPU, take every statistic of a call of more than 16k values in one pass compiled by
            TorchInductor instead of several eager ones; the same statistics up to the summation order. The kernel
            is compiled once per process for each dtype (and thread count, and for inference tensors), at the
            first such call, and needs a C++ compiler: where it cannot be built that call raises
            ``RunFailedError``, and every later one at once.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks.probes import watch
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> with watch(net) as w:
        ...     net(torch.randn(16, 4)).pow(2).mean().backward()
        >>> [(row.name, row.kind, row.count) for row in w.summary()]
        [('0', 'output', 128), ('0', 'grad', 128), ('2', 'output', 16), ('2', 'grad', 16)]
    """
    return Watch(model, layers, grads=grads, stats=stats, fused=fused)


def _check_stats(stats: Sequence[str]) -> frozenset[str]:
    if isinstance(stats, str):
        stats = (stats,)
    chosen = frozenset(stats)
    unknown = sorted(chosen - set(STATS))
    if unknown:
        hint = did_you_mean(unknown[0], STATS)
        raise InvalidValueError(f"unknown statistic {unknown[0]!r}; {hint} Choose from {STATS}")
    if not chosen:
        raise InvalidValueError(f"no statistics requested; choose from {STATS}")
    return chosen


def _leaves_with_parameters(model: nn.Module) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None
    ]
