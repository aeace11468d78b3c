"""The probes' one door to torch internals: each function answers one question with a private torch API.

Nothing else in ``probes/`` reaches ``torch._C``, ``torch._dynamo``, ``torch.utils._pytree``, autograd node names,
saved attributes or underscored tensor methods; ``tests/probes/test_torch_shim.py`` pins every answer on the
installed torch, so an upgrade that changes one fails there, not inside a user's training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils import _pytree

__all__ = [
    "at_backward_end",
    "backward_id",
    "compile_error_cause",
    "grad_passes_finite",
    "is_view",
    "mark_rows_dynamic",
    "pytree_flatten",
    "pytree_leaves",
    "pytree_unflatten",
    "tensor_version",
]

# torch's autograd nodes whose gradient with respect to their input holds, value by value, the gradient with respect
# to their output, 0, or that scaled by at most 1 (Hardsigmoid's 1/6, LeakyReLU's slope, checked), whatever the
# forward's values. Exact names: a custom Function's node is named after its class ("LeakyReluBackward" for a class
# LeakyRelu) and computes anything.
PASSES_FINITE = frozenset(
    {"ReluBackward0", "HardtanhBackward0", "ThresholdBackward0", "ThresholdBackward1", "HardsigmoidBackward0"}
)
LEAKY_RELU = frozenset({"LeakyReluBackward0", "LeakyReluBackward1"})


def backward_id() -> int:
    """The id of the backward pass (autograd graph task) running in this thread; -1 outside one."""
    return int(torch._C._current_graph_task_id())


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once when the backward pass running now ends (call it from inside a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def grad_passes_finite(node: Node) -> bool:
    """Whether torch's autograd ``node`` makes a finite input gradient wherever the output gradient it takes is."""
    name = node.name()
    if name in LEAKY_RELU:
        return bool(abs(getattr(node, "_saved_negative_slope", math.nan)) <= 1)  # False for NaN
    return name in PASSES_FINITE


def tensor_version(tensor: Tensor) -> int:
    """How many times ``tensor`` (not an inference tensor) was changed in place, by autograd's version counter."""
    return int(tensor._version)


def is_view(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory (autograd tracks it through its base)."""
    return bool(tensor._is_view())


def pytree_leaves(value: Any) -> list[Any]:
    """The leaves of a pytree (tuples, lists, dicts, namedtuples), in torch's order."""
    return _pytree.tree_leaves(value)


def pytree_flatten(value: Any) -> tuple[list[Any], Any]:
    """A pytree's leaves and the spec that ``pytree_unflatten`` rebuilds it from."""
    return _pytree.tree_flatten(value)


def pytree_unflatten(values: list[Any], spec: Any) -> Any:
    """The pytree of ``spec`` (from ``pytree_flatten``) holding ``values`` as its leaves."""
    return _pytree.tree_unflatten(values, spec)


def mark_rows_dynamic(rows: Tensor) -> None:
    """Have ``torch.compile`` build a graph for ``rows`` that serves any size of its first dimension."""
    torch._dynamo.mark_dynamic(rows, 0)


def compile_error_cause(error: BaseException) -> BaseException:
    """The compiler's own error inside one that ``torch.compile`` raised (TorchInductor wraps it), else ``error``."""
    return getattr(error, "inner_exception", None) or error
