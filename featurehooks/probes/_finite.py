"""Whether a checked tensor is finite, for ``detect_nonfinite``: classified at once on the CPU, where the host reads
a value at no cost; elsewhere its minimum and maximum are left on the device and read later, in one transfer."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["FINITE", "MINUS_INF", "NONFINITE", "READ_AT_ONCE", "Flags", "cpu_kind", "flag_of", "kind"]

FINITE, MINUS_INF, NONFINITE = 0, 1, 2  # what a tensor's (min, max) says about its values
READ_AT_ONCE = frozenset({"cpu"})  # device types whose values the host reads at no cost: classified when checked


class Flags:
    """What each checked tensor holds (FINITE, MINUS_INF or NONFINITE), by the index ``add`` returns.

    A CPU tensor is classified when it is added (``cpu_kind``); another device's tensor leaves its min and max
    on the device, read by ``kinds`` in one transfer per device.
    """

    __slots__ = ("_kinds", "_pending")

    def __init__(self) -> None:
        self._kinds: list[int] = []
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}  # index -> (min, max) still on their device

    def add(self, flag: int | tuple[Tensor, Tensor]) -> int:
        """Keep one tensor's ``flag_of``; its index."""
        index = len(self._kinds)
        if isinstance(flag, int):
            self._kinds.append(flag)
        else:
            self._kinds.append(FINITE)
            self._pending[index] = flag
        return index

    def finite_now(self, index: int) -> bool:
        """Whether the tensor is known to be finite already (not a device's flag waiting to be read)."""
        return self._kinds[index] == FINITE and index not in self._pending

    def kinds(self) -> list[int]:
        """Every tensor's kind, by index; reads what is still on a device."""
        by_device: dict[torch.device, list[tuple[int, Tensor, Tensor]]] = {}
        for index, (low, high) in self._pending.items():
            by_device.setdefault(low.device, []).append((index, low, high))
        for items in by_device.values():
            with torch.no_grad():
                read = torch.stack([t.float() for _index, low, high in items for t in (low, high)]).tolist()
            for (index, _low, _high), low, high in zip(items, read[::2], read[1::2]):
                self._kinds[index] = kind(low, high)
        self._pending.clear()
        return self._kinds


def flag_of(tensor: Tensor) -> int | tuple[Tensor, Tensor]:
    """What a tensor's elements (a nested tensor's packed values) hold: on the CPU its kind, read now (the host
    has it at no cost); elsewhere its min and max, left on the device so that checking never waits for it."""
    values = tensor.detach()
    if values.is_nested:
        values = values.values()
    if values.device.type in READ_AT_ONCE:
        return cpu_kind(values)
    return tuple(torch.aminmax(values))  # type: ignore[return-value]


def cpu_kind(values: Tensor) -> int:
    """The kind of a CPU tensor's values from one summing pass (cheaper than ``aminmax``, which runs only when the
    sum is not finite: a NaN or infinity makes it so, and so does a sum past the dtype's range, told apart)."""
    if math.isfinite(values.sum().item()):
        return FINITE
    low, high = torch.aminmax(values)
    return kind(low.item(), high.item())


def kind(low: float, high: float) -> int:
    """FINITE, MINUS_INF (-inf the only non-finite value, all -inf included) or NONFINITE (NaN or +inf)."""
    if math.isfinite(low) and math.isfinite(high):
        return FINITE
    return MINUS_INF if low == -math.inf and high < math.inf else NONFINITE  # NaN fails both comparisons
