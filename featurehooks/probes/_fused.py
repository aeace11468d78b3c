"""One compiled pass over a CPU tensor for every statistic of ``watch(fused=True)``.

TorchInductor fuses the arithmetic of the eager row passes (min, max, sum, sum of squares, non-zero count) into one
loop over rows of ``ROW`` values, so each value is read once. The kernel is compiled once per process for each
dtype, thread count and inference-ness (it needs a C++ compiler), with the number of rows dynamic.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import RunFailedError
from ._torch import compile_error_cause, mark_rows_dynamic

__all__ = ["ROW", "fused_moments"]

ROW = 1024
"""Values per row: float32 sums of 1024 values, added in float64 (the eager fast path's accuracy)."""


def _row_moments(rows: Tensor) -> Tensor:
    """Min, max, sum, sum of squares and non-zero count of a ``(rows, ROW)`` tensor: per row in float32, over the
    rows in float64."""
    wide = rows.float()
    per_row = torch.stack(
        [wide.amin(1), wide.amax(1), wide.sum(1), (wide * wide).sum(1), (wide != 0).sum(1, dtype=torch.float32)]
    ).double()
    return torch.stack([per_row[0].amin(), per_row[1].amax(), per_row[2].sum(), per_row[3].sum(), per_row[4].sum()])


_lock = threading.Lock()
_kernel: Callable[[Tensor], Tensor] | None = None
_compiled: set[tuple[torch.dtype, bool, int]] = set()  # (dtype, inference tensor, threads): graphs built so far
_failed: dict[tuple[torch.dtype, bool, int], RunFailedError] = {}


def fused_moments(flat: Tensor) -> list[float]:
    """``[min, max, sum, sum of squares, non-zero count]`` of a 1-D CPU tensor of at least ``2 * ROW`` values (one
    row would make TorchInductor specialize the graph): its rows by the compiled kernel, the last ``len % ROW``
    values in float64.

    Raises ``RunFailedError`` when the kernel cannot be compiled (no C++ compiler, an unsupported platform), at
    once on every later call of the same kind.
    """
    body = flat.numel() - flat.numel() % ROW
    low, high, total, squares, nonzero = _kernel_moments(flat[:body].view(-1, ROW))
    if body == flat.numel():
        return [low, high, total, squares, nonzero]
    tail = flat[body:].double()
    t_low, t_high = torch.aminmax(tail)
    t_total, t_squares, t_nonzero = tail.sum(), torch.dot(tail, tail), torch.count_nonzero(tail)
    read = torch.stack([t_low, t_high, t_total, t_squares, t_nonzero.double()]).tolist()
    return [min(low, read[0]), max(high, read[1]), total + read[2], squares + read[3], nonzero + read[4]]


def _kernel_moments(rows: Tensor) -> list[float]:
    """The compiled kernel's moments of ``rows``; the first call of a kind compiles its graph, under the lock."""
    global _kernel
    kind = (rows.dtype, rows.is_inference(), torch.get_num_threads())  # what the graph's guards check
    with _lock:
        if kind in _failed:
            raise _failed[kind]
        if _kernel is None:
            # not fullgraph: past dynamo's recompile limit (8 graphs) the function runs eagerly instead of raising
            _kernel = torch.compile(_row_moments)
        kernel = _kernel
        if kind not in _compiled:  # two threads never build the same graph
            try:
                moments = _run(kernel, rows, first=True)
            except Exception as error:  # torch raises several kinds; the cause stays chained
                _failed[kind] = _compile_error(rows.dtype, error)
                raise _failed[kind] from error
            _compiled.add(kind)
            return moments
    return _run(kernel, rows)


def _run(kernel: Callable[[Tensor], Tensor], rows: Tensor, first: bool = False) -> list[float]:
    """Run ``kernel`` on ``rows`` so that one graph serves every size: under one global state (inference mode, no
    autocast, whoever calls), on a tensor that is no view (``detach``: on a view the guards check its base's shape
    and strides too), with the number of rows marked dynamic when the ``first`` call builds the graph (the row
    length stays a constant: no graph specializes on a row count that happens to equal it; later calls match the
    dynamic graph's guards unmarked, and skip the mark's Python)."""
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        rows = rows.detach()
        if first:
            mark_rows_dynamic(rows)
        return kernel(rows).tolist()


def _compile_error(dtype: torch.dtype, error: Exception) -> RunFailedError:
    """One line on why the kernel could not be built (inductor wraps the compiler's error: its first line is the
    inner one's)."""
    inner = compile_error_cause(error)
    text = str(inner).strip()
    reason = text.splitlines()[0] if text else type(inner).__name__
    return RunFailedError(
        f"watch(fused=True) could not compile its statistics kernel for {dtype} with TorchInductor (it needs a "
        f"working C++ compiler): {reason}. watch(fused=False) computes the same statistics without compiling."
    )
