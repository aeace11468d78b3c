"""Pins every answer of ``featurehooks.probes._torch`` (the probes' torch internals) on the installed torch.

Each test exercises one shim function the way the probes use it: a torch release that renames, removes or changes
what the function relies on fails here, by name, instead of inside a user's training step.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from featurehooks.probes import _torch


def _output(op: Callable[[Tensor], Tensor]) -> Tensor:
    """What ``op`` makes of a tensor that requires grad (cloned first, so in-place ops are allowed). Keep it while
    its node is used: a custom Function's node can no longer be asked its name once its output is gone (torch 2.11),
    and the probes only ask while it lives."""
    out = op(torch.randn(8, requires_grad=True).clone())
    assert out.grad_fn is not None
    return out


PASSING: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "relu_": lambda t: F.relu(t, inplace=True),
    "relu6": F.relu6,
    "hardtanh_": lambda t: F.hardtanh(t, inplace=True),
    "threshold": lambda t: F.threshold(t, 0.1, 0.0),
    "threshold_": lambda t: F.threshold(t, 0.1, 0.0, inplace=True),
    "hardsigmoid": F.hardsigmoid,
    "leaky_relu": lambda t: F.leaky_relu(t, 0.2),
    "leaky_relu_": lambda t: F.leaky_relu(t, 0.2, inplace=True),
    "leaky_relu_slope_1": lambda t: F.leaky_relu(t, -1.0),
}
NOT_PASSING: dict[str, Callable[[Tensor], Tensor]] = {
    "leaky_relu_slope_2": lambda t: F.leaky_relu(t, 2.0),
    "leaky_relu_slope_nan": lambda t: F.leaky_relu(t, math.nan),
    "elu": F.elu,  # scales by exp(x) * alpha: unbounded alpha
    "mul": lambda t: t * 3,
    "add": lambda t: t + 1,
    "gelu": F.gelu,  # its derivative exceeds 1 near x = 1.5
}


@pytest.mark.parametrize("op", PASSING, ids=list(PASSING))
def test_grad_passes_finite_for_torch_nodes(op: str) -> None:
    out = _output(PASSING[op])
    assert _torch.grad_passes_finite(out.grad_fn)


@pytest.mark.parametrize("op", NOT_PASSING, ids=list(NOT_PASSING))
def test_grad_passes_finite_not_for_other_nodes(op: str) -> None:
    out = _output(NOT_PASSING[op])
    assert not _torch.grad_passes_finite(out.grad_fn)


def test_grad_passes_finite_names_are_the_ones_torch_makes() -> None:
    """Every name the shim knows is one torch's ops produce now (a renamed node would silently stop passing)."""
    outputs = [_output(op) for op in PASSING.values()]
    assert {out.grad_fn.name() for out in outputs} == _torch.PASSES_FINITE | _torch.LEAKY_RELU
    for op in ("leaky_relu", "leaky_relu_"):  # the slope the shim reads is saved on both nodes, as given
        out = _output(PASSING[op])
        assert out.grad_fn._saved_negative_slope == pytest.approx(0.2)


def test_grad_passes_finite_not_for_a_custom_function_named_alike() -> None:
    class LeakyRelu(torch.autograd.Function):  # its node is "LeakyReluBackward", and computes anything
        @staticmethod
        def forward(ctx: object, x: Tensor) -> Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: object, grad: Tensor) -> Tensor:
            return grad * 1e30

    out = _output(LeakyRelu.apply)
    assert out.grad_fn.name() == "LeakyReluBackward"
    assert not _torch.grad_passes_finite(out.grad_fn)


def test_backward_id_and_at_backward_end() -> None:
    seen: list[int] = []
    ended: list[tuple[int, int]] = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad: Tensor) -> None:
        task = _torch.backward_id()
        seen.append(task)
        if len(seen) == 1:
            _torch.at_backward_end(lambda: ended.append((task, len(seen))))

    y = x * 2
    y.register_hook(hook)
    z = y.clone()
    z.register_hook(hook)
    z.sum().backward()
    assert _torch.backward_id() == -1  # outside a backward pass
    assert len(seen) == 2 and seen[0] == seen[1] >= 0  # one id for the whole pass
    assert ended == [(seen[0], 2)]  # once, after every hook of the pass ran
    (x * 2).sum().backward(inputs=[x])
    y = x * 2
    y.register_hook(hook)
    seen.clear()
    y.sum().backward()
    assert seen[0] != ended[0][0]  # a new pass, a new id
    assert ended[1] == (seen[0], 1)


def test_tensor_version_counts_in_place_changes() -> None:
    t = torch.zeros(3)
    before = _torch.tensor_version(t)
    t.add_(1)
    t[0] = 2
    assert _torch.tensor_version(t) == before + 2
    t.data.add_(1)  # a write autograd does not count
    assert _torch.tensor_version(t) == before + 2


def test_is_view() -> None:
    base = torch.zeros(4, 4)
    assert _torch.is_view(base[0]) and _torch.is_view(base.view(16)) and _torch.is_view(base.t())
    assert not _torch.is_view(base) and not _torch.is_view(base.clone()) and not _torch.is_view(base.reshape(2, -1) * 1)


def test_pytree_round_trip() -> None:
    Pair = namedtuple("Pair", "a b")
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    tree = {"x": (a, [b, 3]), "y": Pair(c, None)}
    leaves, spec = _torch.pytree_flatten(tree)
    assert leaves[0] is a and leaves[1] is b and leaves[2] == 3 and leaves[3] is c and leaves[4] is None
    assert _torch.pytree_leaves(tree) == leaves
    rebuilt = _torch.pytree_unflatten([x * 1 if isinstance(x, Tensor) else x for x in leaves], spec)
    assert isinstance(rebuilt["y"], Pair) and rebuilt["x"][1][1] == 3 and torch.equal(rebuilt["y"].a, c)


def test_mark_rows_dynamic_makes_one_graph_for_every_row_count() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda rows: rows.sum(1), backend="eager")
    with torch.inference_mode():
        for count in (5, 9, 33):
            rows = torch.ones(count, 8)
            if count == 5:
                _torch.mark_rows_dynamic(rows)
            assert compiled(rows).shape == (count,)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


def test_compile_error_cause_unwraps_a_backends_error() -> None:
    inner = RuntimeError("no C++ compiler here")

    def failing_backend(graph: object, example_inputs: object) -> object:
        raise inner

    torch._dynamo.reset()
    with pytest.raises(Exception) as caught:  # torch wraps the backend's error in one of its own
        torch.compile(lambda t: t.sum(1), backend=failing_backend)(torch.ones(4, 8))
    torch._dynamo.reset()
    assert caught.value is not inner
    assert _torch.compile_error_cause(caught.value) is inner
    plain = ValueError("x")
    assert _torch.compile_error_cause(plain) is plain
