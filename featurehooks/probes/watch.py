"""``watch``: activation and gradient statistics of a model you train, cheap enough to leave on.

Every call of a watched module adds its output's statistics (and, in backward, its gradient's) to running sums: on
an accelerator kept on the device with no host sync and read once by ``Watch.summary()``; on the CPU, where a read
waits for nothing, read at once and added on the host. The statistics of a call come from ``_moments``;
docs/probes.md has the exact definitions.
"""

from __future__ import annotations

import csv
import math
import os
import threading
from collections.abc import Iterable, MutableMapping, Sequence
from dataclasses import astuple, dataclass, fields
from typing import Any, Protocol, TypedDict

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import Unpack

from .._hooks import Observer, ObserverSession
from .._taps import call_name
from ..errors import InvalidTypeError, InvalidValueError, did_you_mean
from ..layers import select_modules
from ._handle import ProbeHandle
from ._moments import (
    ADDITIVE,
    MAX,
    NEG_MIN,
    NONFINITE,
    NONZERO,
    SQUARES,
    SUM,
    Need,
    Scratch,
    accumulator_dtype,
    call_moments,
    first_value,
)
from ._torch import pytree_leaves

__all__ = ["STATS", "Watch", "WatchOptions", "WatchRow", "watch"]

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
# Slots of the running sums: a call's statistics (``_moments``), then the shift their squares are taken about.
_SHIFT = MAX + 1
_SLOTS = _SHIFT + 1
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
    finite = count - round(values[NONFINITE])
    delta = values[_SHIFT] - shift
    moved = list(values)
    moved[SQUARES] += 2 * delta * (values[SUM] - finite * values[_SHIFT]) + finite * delta * delta
    moved[_SHIFT] = shift
    return moved


class _HostSums:
    """Running sums of one (layer, call, kind) on the CPU, as Python floats: each call's statistics are read at once
    there (the host waits for nothing), and a tensor operation costs more than the additions."""

    __slots__ = ("calls", "count", "values")

    def __init__(self, first: Tensor) -> None:
        self.values = [0.0] * ADDITIVE + [-math.inf, -math.inf, first_value(first).item()]
        self.calls = 0
        self.count = 0

    def take(self, tensor: Tensor, watch: Watch) -> None:
        """Add the statistics of one call's ``tensor``, read at once."""
        shift = self.values[_SHIFT]
        values = call_moments(tensor, watch._need, watch._scratch, shift, read_now=True, fused=watch.fused)
        with watch._lock:
            sums = self.values
            for slot in range(ADDITIVE):
                sums[slot] += values[slot]
            sums[NEG_MIN] = max(sums[NEG_MIN], values[NEG_MIN])
            sums[MAX] = max(sums[MAX], values[MAX])
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
            self.values = torch.zeros(_SLOTS, dtype=accumulator_dtype(first.device), device=first.device)
            self.values[ADDITIVE:_SHIFT] = -math.inf
            self.values[_SHIFT] = first_value(first)
        self.calls = 0
        self.count = 0

    def take(self, tensor: Tensor, watch: Watch) -> None:
        """Add the statistics of one call's ``tensor``, computed on its device."""
        values = call_moments(tensor, watch._need, watch._scratch, self.values[_SHIFT], read_now=False, fused=False)
        with watch._lock:
            self.values[:ADDITIVE].add_(values[:ADDITIVE])
            torch.fmax(self.values[ADDITIVE:_SHIFT], values[ADDITIVE:], out=self.values[ADDITIVE:_SHIFT])
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


class WatchOptions(TypedDict, total=False):
    """The keyword options of ``watch`` (and ``Watch``).

    Keys (all optional):
        grads: also watch the gradients with respect to the outputs. Default: ``True``.
        stats: which statistics to compute, from ``STATS`` (fewer is cheaper). Default: all of ``STATS``.
        fused: on the CPU, take every statistic of a call of at least 2048 values in one pass compiled by
            TorchInductor instead of several eager ones; the same statistics up to the summation order. The kernel
            is compiled once per process for each dtype (and thread count, and for inference tensors), at the
            first such call, and needs a C++ compiler: where it cannot be built that call raises
            ``RunFailedError``, and every later one at once. Default: ``False``.

    Examples:
        >>> import torch
        >>> from featurehooks.probes import WatchOptions, watch
        >>> options: WatchOptions = {"grads": False, "stats": ("mean",)}
        >>> with watch(torch.nn.Linear(4, 2), **options) as w:
        ...     _ = w.summary()
    """

    grads: bool
    stats: Sequence[str]
    fused: bool


class Watch(Observer[None], ProbeHandle):
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
        self._need = Need.of(self.stats)
        selection = select_modules(model, layers, default=_leaves_with_parameters, what="watch")
        self._order = {path: k for k, path in enumerate(selection.paths)}
        self._types = {path: type(model.get_submodule(path)).__name__ for path in selection.paths}
        self._lock = threading.Lock()
        self._sums: dict[tuple[str, int, str, torch.device], _HostSums | _DeviceSums] = {}
        self._scratch = Scratch()
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
                    [a + b for a, b in zip(old[:ADDITIVE], values[:ADDITIVE])]
                    + [max(a, b) for a, b in zip(old[ADDITIVE:_SHIFT], values[ADDITIVE:_SHIFT])]
                    + [old[_SHIFT]]
                )
                calls, count = calls + old_calls, count + old_count
            merged[row_key] = (values, calls, count)
        ordered = sorted(merged, key=lambda k: (self._order[k[0]], k[1], KINDS.index(k[2])))
        return [self._row(key, *merged[key]) for key in ordered]

    def _row(self, key: tuple[str, int, str], values: list[float], calls: int, count: int) -> WatchRow:
        path, call, kind = key
        nonfinite = round(values[NONFINITE])
        finite = count - nonfinite
        mean = values[SUM] / finite if finite else math.nan
        offset = mean - values[_SHIFT]
        variance = max(values[SQUARES] / finite - offset * offset, 0.0) if finite else math.nan
        low = -values[NEG_MIN] if finite else math.nan
        high = values[MAX] if finite else math.nan
        zeros = max(finite - round(values[NONZERO]), 0) / count if count else math.nan
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


def watch(model: nn.Module, layers: str | Sequence[str] | None = None, **options: Unpack[WatchOptions]) -> Watch:
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
        **options: the ``WatchOptions``: ``grads``, ``stats``, ``fused``.

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
    return Watch(model, layers, **options)


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
