"""Probes on the hook engine: watch (statistics without host syncs) and detect_nonfinite (origin of a NaN/inf)."""

from __future__ import annotations

import contextlib
import csv
import gc
import importlib
import math
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from probe_helpers import direct
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

import featurehooks as fh
from featurehooks.errors import InvalidValueError, LayerNotFoundError, NonFiniteError
from featurehooks.probes import _backward, _finite
from featurehooks.probes.nonfinite import INPUT, OUTPUT, detect_nonfinite
from featurehooks.probes.watch import STATS, Watch, WatchRow, watch

from helpers import ChangesGradient, Scale

watch_module = importlib.import_module("featurehooks.probes.watch")  # the package exports the function by that name


@pytest.fixture(params=["host", "device"])
def sums_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of summing: on the host, read at once (the CPU), and on the device with no sync (an accelerator's,
    taken on the CPU here)."""
    if request.param == "device":
        monkeypatch.setattr(watch_module, "READ_AT_ONCE", frozenset())
    return str(request.param)


# --------------------------------------------------------------------------------------------------
# models


class Twice(nn.Module):
    """A block whose activation module runs twice per forward (rows ``act`` and ``act_1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.conv1(x))
        h = self.act(self.conv2(h) - 0.05)
        return self.head(h.mean((2, 3)))


class _InfBackward(torch.autograd.Function):
    clean_thread = ""  # the thread of this name gets a finite gradient

    @staticmethod
    def forward(ctx: Any, x: Tensor, in_place: bool) -> Tensor:
        if not in_place:
            return x.clone()
        ctx.mark_dirty(x)
        return x.mul_(1.0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return (grad if threading.current_thread().name == _InfBackward.clean_thread else grad * math.inf), None


class InfBackward(nn.Module):
    """Identity forward (``in_place``: its output is its input tensor, changed), infinite gradient backward."""

    def __init__(self, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = in_place

    def forward(self, x: Tensor) -> Tensor:
        return _InfBackward.apply(x, self.in_place)


class Boom(nn.Module):
    armed = True

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return x


class Keep(nn.Module):
    """Identity that keeps its output, to inspect the tensor hooks left on it."""

    def forward(self, x: Tensor) -> Tensor:
        self.kept = x * 1
        return self.kept


def mlp(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), *middle, nn.Linear(8, 3))


# --------------------------------------------------------------------------------------------------
# helpers


def module_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in model.modules()
    )


def gradient_hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The calls of the probes' gradient hooks (on tensors or on the autograd nodes that made them), from now on."""
    calls: list[object] = []
    for owner in (watch_module._GradStats, _backward.GradFlag, _backward.NodeGradFlag, _backward.PassingGradFlag):
        fire = owner.__call__
        monkeypatch.setattr(owner, "__call__", lambda self, *grads, fire=fire: calls.append(self) or fire(self, *grads))
    return calls


def live_hook_handles() -> int:
    """How many hook handles are alive in the process."""
    gc.collect()
    return sum(type(o) is RemovableHandle for o in gc.get_objects())


def merged(*tensors: Tensor) -> Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


def assert_row(row: WatchRow, expected: dict[str, float], rel: float = 1e-5) -> None:
    for stat, value in expected.items():
        assert getattr(row, stat) == pytest.approx(value, rel=rel, abs=1e-6), (row.name, row.kind, stat)


def rows_by(rows: list[WatchRow]) -> dict[tuple[str, str], WatchRow]:
    return {(row.name, row.kind): row for row in rows}


class CountSyncs:
    """Counts host reads of tensor values (item, tolist, cpu, numpy, bool/float/int conversions)."""

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in self.names:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original: Any) -> Any:
        def counted(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(tensor, *args, **kwargs)

        return counted


# --------------------------------------------------------------------------------------------------
# watch: statistics


def test_watch_statistics_equal_a_direct_computation(images: torch.Tensor, sums_path: str) -> None:
    model = Twice()
    names = ["conv1", "conv2", "head"]
    seen: dict[str, list[Tensor]] = {name: [] for name in names}
    with watch(model, grads=False) as w, fh.capture(model, names, mode="detach") as feats:
        for x in (images, images.flip(-1)):
            model(x)
            for name in names:
                seen[name].append(feats[name])
    rows = rows_by(w.summary())
    assert set(rows) == {(name, "output") for name in names}  # default: the leaves with parameters
    for name in names:
        assert rows[(name, "output")].calls == 2
        assert_row(rows[(name, "output")], direct(merged(*seen[name])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [1, 3, 508, 509, 4 * 127 * 9 + 7, (1 << 20) + 5])
def test_watch_counts_zeros_exactly_at_any_size(size: int, dtype: torch.dtype, sums_path: str) -> None:
    x = torch.randn(size, generator=torch.Generator().manual_seed(size)).to(dtype)
    x[::3] = 0.0
    model = nn.Sequential(nn.Identity())
    with watch(model, layers="0", grads=False) as w:
        model(x)
    (row,) = w.summary()
    assert round(row.zeros * size) == int((x == 0).sum())


LOW_PRECISION_CASES = {
    "activations": lambda g, n: torch.randn(n, generator=g).relu(),
    "gradients": lambda g, n: 1e-6 * torch.randn(n, generator=g),
    "mean far above the spread": lambda g, n: 3000 + 20 * torch.randn(n, generator=g),
    "squares past float32": lambda g, n: 1e25 * torch.randn(n, generator=g),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(LOW_PRECISION_CASES))
@pytest.mark.parametrize("size", [(1 << 14) + 1, 64 * 1024, 200_000 + 77])
def test_watch_low_precision_statistics_equal_float64(size: int, case: str, dtype: torch.dtype, sums_path: str) -> None:
    """bfloat16 and float16 calls (rows of 1024 and a tail, summed without a float32 copy) as float64 says."""
    if case == "squares past float32" and dtype == torch.float16:
        pytest.skip("float16 ends at 65504")
    x = LOW_PRECISION_CASES[case](torch.Generator().manual_seed(size), size).to(dtype)
    x[-1] = 1.5 * x.abs().max()  # the maximum in the tail, past the last row of 1024
    model = nn.Sequential(nn.Identity())
    with watch(model, layers="0", grads=False) as w:
        model(x)
        model(x + 1)
    (row,) = w.summary()
    assert_row(row, direct(torch.cat([x, x + 1])), rel=1e-6)


def test_watch_adds_a_persistent_outputs_gradient_once_per_backward() -> None:
    class Same(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x  # the same leaf every step

    model = nn.Sequential(Same())
    x = torch.randn(4, 6, requires_grad=True)
    with watch(model, layers="0") as w:
        for _ in range(3):
            model(x).sum().backward()
        assert len(x._backward_hooks) == 1
    rows = {row.kind: row for row in w.summary()}
    assert (rows["grad"].calls, rows["grad"].count, rows["grad"].mean) == (3, 3 * x.numel(), 1.0)


def test_watch_under_bf16_autocast(images: torch.Tensor, sums_path: str) -> None:
    model = Twice()
    with (
        watch(model, grads=False) as w,
        fh.capture(model, ["conv1", "conv2"], mode="detach") as feats,
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        model(images)
    assert feats["conv1"].dtype == torch.bfloat16
    rows = rows_by(w.summary())
    for name in ("conv1", "conv2"):
        assert_row(rows[(name, "output")], direct(feats[name]))  # bf16 values summed in float32


def test_watch_rows_per_call_of_a_module_called_twice(images: torch.Tensor) -> None:
    model = Twice()
    with watch(model, ["act", "conv*"], grads=False) as w, fh.capture(model, ["act", "act_1"], mode="detach") as feats:
        model(images)
    rows = w.summary()
    assert [(row.name, row.path, row.call) for row in rows] == [
        ("conv1", "conv1", 0),
        ("conv2", "conv2", 0),
        ("act", "act", 0),
        ("act_1", "act", 1),
    ]
    by = rows_by(rows)
    assert_row(by[("act", "output")], direct(feats["act"]))
    assert_row(by[("act_1", "output")], direct(feats["act_1"]))
    assert by[("act", "output")].zeros > 0.2  # ReLU zeros are counted


def test_watch_only_the_requested_call() -> None:
    model = Twice()
    with watch(model, "act_1", grads=False) as w:
        model(torch.rand(1, 3, 8, 8))
    assert [row.name for row in w.summary()] == ["act_1"]


def test_watch_gradients_equal_autograd_grad(images: torch.Tensor) -> None:
    model = Twice()
    outputs: list[Tensor] = []  # conv1, act, act_1, head: the very tensors of the graph, not clones
    handles = [
        getattr(model, name).register_forward_hook(lambda _m, _a, out: outputs.append(out))
        for name in ("conv1", "act", "head")
    ]
    try:
        with watch(model, ["conv1", "act", "head"]) as w:
            loss = model(images).pow(2).sum()
            grads = torch.autograd.grad(loss, outputs)
    finally:
        for handle in handles:
            handle.remove()
    rows = rows_by(w.summary())
    for name, output, grad in zip(["conv1", "act", "act_1", "head"], outputs, grads):
        assert rows[(name, "grad")].calls == 1
        assert_row(rows[(name, "grad")], direct(grad))
        assert_row(rows[(name, "output")], direct(output))
    assert [(row.name, row.kind) for row in w.summary()][:2] == [("conv1", "output"), ("conv1", "grad")]


def test_watch_counts_accumulate_over_calls_per_step_and_reset(images: torch.Tensor) -> None:
    model = mlp()
    x = torch.randn(5, 6)
    with watch(model, ["0"]) as w:
        for _ in range(3):  # three forwards, one backward
            out = sum(model(x * k).sum() for k in (1.0, 2.0))
        out.backward()
        rows = rows_by(w.summary())
        assert rows[("0", "output")].calls == 6 and rows[("0", "output")].count == 6 * 5 * 8
        assert rows[("0", "grad")].calls == 2
        w.reset()
        assert w.summary() == []
        model(x)
        assert rows_by(w.summary())[("0", "output")].calls == 1


def test_watch_nonfinite_values_do_not_poison_the_moments(sums_path: str) -> None:
    model = mlp(Scale(1.0))
    x = torch.randn(4, 6)
    with watch(model, ["1"], grads=False) as w, fh.capture(model, ["1"], mode="detach") as feats:
        model(torch.cat([x, torch.full((1, 6), math.nan)]))
    row = w.summary()[0]
    assert row.nonfinite == 8 and row.count == 40
    assert_row(row, direct(feats["1"]))  # moments, min and max over the 32 finite values
    assert math.isfinite(row.mean) and math.isfinite(row.std)


def test_watch_min_max_are_over_finite_values_only(sums_path: str) -> None:
    class Exp(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.exp(x)  # positive, no zeros, inf where x is large

    model = nn.Sequential(Exp())
    x = torch.tensor([[1.0, 2.0, 100.0, 3.0]])
    with watch(model, ["0"], grads=False) as w:
        model(x)
    row = w.summary()[0]
    assert row.nonfinite == 1 and row.zeros == 0.0
    assert row.min == pytest.approx(math.exp(1.0)) and row.max == pytest.approx(math.exp(3.0))


def test_watch_stats_subset_and_tuple_outputs(sums_path: str) -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            y = self.lin(x)
            return y, y * 100

    model = nn.Sequential(Pair())
    x = torch.randn(4, 3)
    with watch(model, ["0"], grads=False, stats=("mean", "nonfinite")) as w:
        y, _ = model(x)
    (row,) = w.summary()
    assert row.mean == pytest.approx(y.mean().item(), rel=1e-5)  # the first tensor of the tuple
    assert row.nonfinite == 0 and row.count == 12
    assert row.std is None and row.min is None and row.zeros is None


def test_watch_bad_requests() -> None:
    model = Twice()
    with pytest.raises(LayerNotFoundError, match="'conv1'"):
        watch(model, ["conv_1"])
    with pytest.raises(LayerNotFoundError, match=r"matches 'block\*'; did you mean"):
        watch(model, ["block*"])
    with pytest.raises(InvalidValueError, match="'median'"):
        watch(model, stats=("mean", "median"))
    with pytest.raises(InvalidValueError, match="no modules"):
        watch(nn.Sequential(nn.ReLU()))
    assert module_hooks(model) == 0


def test_watch_summary_is_the_only_sync(images: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path every accelerator takes (taken here on the CPU) reads no value on the host until ``summary()``;
    only the CPU reads each call's sums, where there is no device to wait for."""
    monkeypatch.setattr(watch_module, "READ_AT_ONCE", frozenset())
    model = Twice()
    with watch(model) as w:
        model(images).sum().backward()  # first calls allocate the running sums
        syncs = CountSyncs(monkeypatch)
        for _ in range(2):
            loss = model(images).pow(2).mean()
            loss.backward()
        assert syncs.count == 0, "watch read a value on the host during forward or backward"
        rows = w.summary()
        assert syncs.count == 1  # one tolist of the stacked sums
    assert len(rows) == 6 and all(row.calls == 3 for row in rows)


def test_watch_log_and_csv(tmp_path: Path) -> None:
    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

    model = mlp()
    writer = Writer()
    path = tmp_path / "watch.csv"
    with watch(model, ["0", "2"], stats=("mean", "std")) as w:
        for step in range(2):
            model(torch.randn(3, 6)).sum().backward()
            rows = w.log(writer, step)
            w.to_csv(path, step=step, append=True)
            w.reset()
        model(torch.randn(3, 6))
        w.to_csv(tmp_path / "once.csv")  # a fresh file, no step
    assert len(writer.scalars) == 2 * len(rows) * 2  # two steps, two statistics per row
    assert writer.scalars[0][0] == "watch/0/output/mean" and writer.scalars[0][2] == 0
    last = {tag: value for tag, value, step in writer.scalars if step == 1}
    assert last["watch/2/grad/std"] == pytest.approx(rows[-1].std) and last["watch/0/output/mean"] == rows[0].mean
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 2 * 4 and table[0]["step"] == "0" and table[-1]["step"] == "1"
    assert table[0]["name"] == "0" and table[0]["kind"] == "output" and table[0]["type"] == "Linear"
    assert table[0]["min"] == "" and float(table[-1]["std"]) == pytest.approx(rows[-1].std)
    with open(tmp_path / "once.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(row["step"], row["name"], row["kind"]) for row in table] == [("", "0", "output"), ("", "2", "output")]


def test_watch_threads_do_not_mix() -> None:
    model = mlp()
    x = torch.randn(4, 6)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                model(x).sum().backward()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with watch(model, ["0", "2"]) as w:
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    rows = w.summary()
    assert [row.name for row in rows] == ["0", "0", "2", "2"]  # every call is call 0 of its own forward
    assert all(row.calls == 60 for row in rows)
    expected = direct(model[0](x))
    assert rows[0].mean == pytest.approx(expected["mean"], rel=1e-2)  # weights move a little while training


# --------------------------------------------------------------------------------------------------
# detect_nonfinite


@pytest.fixture(params=["at once", "deferred"])
def flags_read(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of reading the flags: classified when checked (the CPU) and left on the device (a GPU), here on
    the CPU by taking it off the devices read at once."""
    if request.param == "deferred":
        monkeypatch.setattr(_finite, "READ_AT_ONCE", frozenset())
    return str(request.param)


def test_nonfinite_forward_origin_is_the_module_that_made_it(flags_read: str) -> None:
    model = mlp(nn.ReLU(), Scale(math.nan), nn.Tanh())
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(2, 6))
    assert (info.value.path, info.value.call, info.value.phase, info.value.tensor) == ("3", 0, "forward", "output")
    assert "'3' (Scale)" in str(info.value)


class NaNReLU(nn.ReLU):
    """A ReLU subclass computing something else: checked as any module, not taken for a ReLU."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * math.nan


OVERFLOWING = {  # modules near ReLU that make inf or NaN from a finite input
    "relu subclass": (NaNReLU(), torch.ones(64)),
    "leaky relu, slope -1e38": (nn.LeakyReLU(negative_slope=-1e38), torch.full((64,), -5.0)),
    "dropout in training": (nn.Dropout(0.5).train(), torch.full((64,), 3e38)),
}


@pytest.mark.parametrize("case", list(OVERFLOWING))
def test_nonfinite_finite_input_made_nonfinite_near_relu_is_found(case: str, flags_read: str) -> None:
    module, x = OVERFLOWING[case]
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model := nn.Sequential(module)):
        model(x)
    assert (info.value.path, info.value.phase, info.value.tensor) == ("0", "forward", "output")


@pytest.mark.parametrize("in_place", [False, True])
def test_nonfinite_reads_no_relu_output_of_a_finite_input(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ReLU keeps finite values finite: its output is not read again (13% of a ResNet50 training step's reads)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=in_place), nn.Dropout(0.5).eval(), nn.Linear(8, 3))
    read: list[tuple[int, ...]] = []
    classify = _finite.cpu_kind
    monkeypatch.setattr(_finite, "cpu_kind", lambda values: read.append(tuple(values.shape)) or classify(values))
    with detect_nonfinite(model):
        model(torch.randn(2, 6)).sum().backward()
    forward_reads = [(2, 6), (2, 8), (2, 3)]  # the input, the first Linear's output, the head's output
    assert read[: len(forward_reads)] == forward_reads


PASSES_FINITE = {  # activations whose input gradient is finite wherever their output gradient is: not read
    "relu": nn.ReLU(),
    "relu in place": nn.ReLU(inplace=True),
    "relu6": nn.ReLU6(),
    "hardtanh in place": nn.Hardtanh(-2.0, 3.0, inplace=True),
    "threshold": nn.Threshold(0.1, 2.0),
    "hardsigmoid": nn.Hardsigmoid(),
    "leaky relu": nn.LeakyReLU(0.1),
    "leaky relu in place": nn.LeakyReLU(0.5, inplace=True),
    "leaky relu, slope -1": nn.LeakyReLU(-1.0),
}
READ = {"gelu": nn.GELU(), "silu": nn.SiLU(), "sigmoid": nn.Sigmoid(), "leaky relu, slope 2": nn.LeakyReLU(2.0)}


@pytest.mark.parametrize("case", [*PASSES_FINITE, *READ])
def test_nonfinite_reads_no_gradient_an_activation_keeps_finite(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient with respect to a ReLU's input is not read where the one with respect to its output was finite;
    nor is a gradient that reaches the next checked tensor unchanged (through the addition)."""
    activation = {**PASSES_FINITE, **READ}[case]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.act, self.head = nn.Linear(6, 8), activation, nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.act(self.body(x)) + 1.0)

    torch.manual_seed(0)
    model = Net()
    read: list[tuple[int, ...]] = []
    classify = _finite.cpu_kind
    with detect_nonfinite(model):
        out = model(torch.randn(2, 6))
        monkeypatch.setattr(_finite, "cpu_kind", lambda values: read.append(tuple(values.shape)) or classify(values))
        out.sum().backward()
    # the gradients with respect to the output, the head's input (which the addition hands on to the activation's
    # output unchanged) and, unless the activation keeps it finite, the activation's input
    assert read == [(2, 3), (2, 8)] + ([] if case in PASSES_FINITE else [(2, 8)])


class LeakyRelu(torch.autograd.Function):
    """A user's own leaky ReLU: its autograd node is named ``LeakyReluBackward`` (after the class), not torch's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.where(x > 0, x, 0.01 * x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.where(x > 0, grad, 0.01 * grad)


class OwnLeakyReLU(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return LeakyRelu.apply(x)


def test_nonfinite_a_custom_function_named_like_torchs_node_is_checked_as_any() -> None:
    """Only torch's own nodes are taken to keep gradients finite: a custom Function named LeakyRelu is read."""
    model = nn.Sequential(nn.Linear(4, 8), OwnLeakyReLU(), nn.Linear(8, 1))
    assert model[1](torch.randn(2, 8, requires_grad=True)).grad_fn.name() == "LeakyReluBackward"
    with detect_nonfinite(model):
        model(torch.randn(3, 4)).sum().backward()  # finite all along: no error
    model[2].register_full_backward_pre_hook(lambda module, grad: (grad[0] * math.inf,))
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 4)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("2", "backward", "grad_output")


class PostHooked(nn.Module):
    """A ReLU whose autograd node gets, in the forward (before the detector's hooks), a post-hook of the user's that
    changes the gradient the node made: into a new tensor or in place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.body, self.act, self.head = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)
        self.in_place = in_place

    def forward(self, x: Tensor) -> Tensor:
        y = self.act(self.body(x))
        y.grad_fn.register_hook(self.nan_in_place if self.in_place else self.nan)
        return self.head(y)

    @staticmethod
    def nan(grad_inputs: tuple[Tensor, ...], _grad_outputs: tuple[Tensor, ...]) -> tuple[Tensor]:
        return (grad_inputs[0] * math.nan,)

    @staticmethod
    def nan_in_place(grad_inputs: tuple[Tensor, ...], _grad_outputs: tuple[Tensor, ...]) -> None:
        grad_inputs[0].mul_(math.nan)


@pytest.mark.parametrize("in_place", [False, True])
def test_nonfinite_backward_a_node_post_hook_run_before_the_detectors_is_not_trusted(in_place: bool) -> None:
    """The gradient a ReLU's node made is handed on as finite only where the detector's post-hook runs first."""
    torch.manual_seed(0)
    model = PostHooked(in_place)
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 4)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("act", "backward", "grad_input")


def scale_output(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
    return output * 1e39


def nan_input(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
    return (args[0] * math.nan,)


@pytest.mark.parametrize(
    "hook",
    ["forward hook", "forward hook, global", "pre-hook after the detector's", "forward on the instance"],
)
@pytest.mark.parametrize("activation", [nn.ReLU, nn.Sigmoid])
def test_nonfinite_an_activation_changed_by_a_hook_is_read(hook: str, activation: type[nn.Module]) -> None:
    """An activation's output is taken for finite without reading it only where nothing but its class computes it:
    a user's hook or an instance ``forward`` may scale or replace what it takes or returns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), activation(), nn.Linear(8, 2))
    act = model[1]
    with contextlib.ExitStack() as stack:
        if hook == "forward hook":
            act.register_forward_hook(scale_output)
        elif hook == "forward hook, global":
            stack.callback(nn.modules.module.register_module_forward_hook(scale_output).remove)
        elif hook == "forward on the instance":
            act.forward = lambda x: type(act).forward(act, x) * math.nan
        detector = stack.enter_context(detect_nonfinite(model))
        if hook == "pre-hook after the detector's":
            act.register_forward_pre_hook(nan_input)
        with pytest.raises(NonFiniteError) as info:
            model(torch.randn(3, 4))
        assert detector.active
    expected = "0" if hook == "forward hook, global" else "1"  # a global hook scales the first Linear's output too
    assert (info.value.path, info.value.phase, info.value.tensor) == (expected, "forward", "output")


class Fork(nn.Module):
    """A ReLU's input is also used by another module (``other``), whose gradient is added to the ReLU's."""

    def __init__(self, other: nn.Module, other_first: bool) -> None:
        super().__init__()
        self.body, self.act, self.other, self.head = nn.Linear(6, 8), nn.ReLU(), other, nn.Linear(8, 3)
        self.other_first = other_first

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        parts = (self.other(h), self.act(h)) if self.other_first else (self.act(h), self.other(h))
        return self.head(parts[0] + parts[1])


@pytest.mark.parametrize("other_first", [False, True])
def test_nonfinite_backward_a_relu_input_shared_with_an_infinite_gradient(other_first: bool, flags_read: str) -> None:
    """The ReLU hands its input's gradient on as finite; the sum with the other module's infinite one is read."""
    torch.manual_seed(0)
    model = Fork(InfBackward(), other_first)
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 6)).sum().backward()
    assert (info.value.phase, info.value.tensor) == ("backward", "grad_input")
    assert {info.value.path, *re.findall(r"'(\w+)' \(", str(info.value))} == {"act", "other"}


@pytest.mark.parametrize("after", ["linear", "relu"])
def test_nonfinite_backward_a_gradient_changed_in_place_is_read_again(after: str) -> None:
    """A custom backward that changes the gradient it was given (found finite) in place and hands it on: the same
    tensor arrives, changed, and is read again."""
    torch.manual_seed(0)
    head = nn.Linear(8, 3) if after == "linear" else nn.Sequential(nn.ReLU(), nn.Linear(8, 3))
    model = nn.Sequential(nn.Linear(6, 8), ChangesGradient(lambda grad: grad.mul_(math.inf)), head)  # handed on
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 6)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("1", "backward", "grad_input")


def test_nonfinite_backward_leaky_relu_slope_above_one_overflows() -> None:
    """A slope over 1 can make an infinite gradient from a finite one: that LeakyReLU's input gradient is read."""
    model = nn.Sequential(Scale(1.0), nn.LeakyReLU(-1e38))
    x = torch.full((2, 4), -1e-38, requires_grad=True)
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        out = model(x)  # finite: about 1
        out.backward(torch.full_like(out, 10.0))  # 10 * -1e38 overflows float32
    assert (info.value.path, info.value.phase, info.value.tensor) == ("1", "backward", "grad_input")


def fail(grad: Tensor) -> Tensor:
    raise RuntimeError("backward failed")


def test_nonfinite_lets_go_of_the_gradient_of_a_backward_that_raised() -> None:
    """The gradient known finite is held until the next one arrives; a backward pass that raised never ends, and
    the next backward pass lets go of its gradient."""
    failing = ChangesGradient(fail)
    model = nn.Sequential(nn.Linear(6, 8), failing, nn.ReLU(), nn.Linear(8, 3))
    with detect_nonfinite(model) as detector:
        with pytest.raises(RuntimeError, match="backward failed"):
            model(torch.randn(3, 6)).sum().backward()
        assert detector._backwards.holding() == [True]
        failing.change = lambda grad: grad
        model(torch.randn(3, 6)).sum().backward()
        assert detector._backwards.holding() == [False]


def test_nonfinite_keeps_a_bounded_number_of_backwards_that_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward pass that raised never ends; a training loop that skips such batches does not pile them up."""
    monkeypatch.setattr(_backward, "BACKWARDS_KEPT", 4)
    failing = ChangesGradient(fail)
    model = nn.Sequential(nn.Linear(6, 8), failing, nn.ReLU(), nn.Linear(8, 3))
    with detect_nonfinite(model) as detector:
        for _ in range(10):
            with pytest.raises(RuntimeError, match="backward failed"):
                model(torch.randn(3, 6)).sum().backward()
        assert len(detector._backwards) == 4
        failing.change = lambda grad: grad * math.inf  # a backward after them still names its origin
        with pytest.raises(NonFiniteError) as info:
            model(torch.randn(3, 6)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("1", "backward", "grad_input")


@pytest.mark.parametrize("probed", [False, True])
def test_nonfinite_leaves_a_leafs_gradient_to_be_taken_into_grad(probed: bool) -> None:
    """Autograd moves a leaf's gradient into ``.grad`` when nothing else holds it: detect_nonfinite holds none of a
    leaf's (it would be copied instead)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    image = torch.randn(3, 6, requires_grad=True)  # an image being optimized
    arrived: list[int] = []
    image.register_hook(lambda grad: arrived.append(grad.data_ptr()))  # runs after the probe's hook
    with detect_nonfinite(model) if probed else contextlib.nullcontext():
        model(image).sum().backward()
    assert image.grad is not None and image.grad.data_ptr() == arrived[0], "moved, not copied"


def test_nonfinite_backward_origin_in_a_resnet_block(flags_read: str) -> None:
    """A ResNet's gradients through its batch norms, ReLUs and residual additions, most handed on unread."""
    import torchvision.models as tvm

    torch.manual_seed(0)
    model = tvm.resnet18(weights=None)
    model.layer2[1].bn1 = nn.Sequential(model.layer2[1].bn1, InfBackward())
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.rand(2, 3, 32, 32)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("layer2.1.bn1.1", "backward", "grad_input")


def test_nonfinite_forward_nan_weight_in_a_resnet_block(flags_read: str) -> None:
    import torchvision.models as tvm

    torch.manual_seed(0)
    model = tvm.resnet18(weights=None)
    with torch.no_grad():
        model.layer2[1].conv2.weight[0, 0, 0, 0] = math.nan
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.rand(2, 3, 32, 32))
    assert (info.value.path, info.value.phase) == ("layer2.1.conv2", "forward")
    assert module_hooks(model) == 0


@pytest.mark.parametrize(
    "wrap",
    [
        lambda t: (t, None, 1),  # a plain tuple (the fast path)
        lambda t: [torch.ones(1), t],  # a plain list
        lambda t: {"x": t},  # a dict (the pytree path)
        lambda t: (t.new_ones(1), [t]),  # nested
        lambda t: torch.return_types.max((t, t.new_zeros(t.shape, dtype=torch.long))),  # a named tuple
    ],
)
def test_nonfinite_output_found_in_any_container(wrap: Any) -> None:
    class Wrapped(nn.Module):
        def forward(self, x: Tensor) -> Any:
            return wrap(x * math.nan)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Wrapped()

        def forward(self, x: Tensor) -> Tensor:
            return next(t for t in tree_leaves(self.inner(x)) if t.shape == x.shape and t.is_floating_point())

    model = Model()
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.ones(2, 3))
    assert (info.value.path, info.value.phase) == ("inner", "forward")


def test_nonfinite_forward_nan_in_the_input_is_the_input(flags_read: str) -> None:
    model = mlp()
    x = torch.randn(2, 6)
    x[1, 2] = math.nan
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(x)
    assert (info.value.path, info.value.phase, info.value.tensor) == (INPUT, "forward", "input")


def test_nonfinite_forward_from_the_models_own_code() -> None:
    class Log(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x).log())  # log of negatives: NaN made outside any submodule

    torch.manual_seed(0)
    model = Log()
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(8, 4))
    assert (info.value.path, info.value.tensor) == ("", "output")


def test_nonfinite_backward_origin_is_the_module_that_made_it(flags_read: str) -> None:
    model = mlp(InfBackward(), nn.Tanh())
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 6)).sum().backward()
    assert (info.value.path, info.value.call, info.value.phase) == ("2", 0, "backward")
    assert info.value.tensor == "grad_input"
    assert "'2' (InfBackward)" in str(info.value)


def test_nonfinite_backward_origin_changed_its_input_in_place(flags_read: str) -> None:
    model = mlp(nn.Linear(8, 8), InfBackward(in_place=True))  # its input and output: one tensor, two versions
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        model(torch.randn(3, 6)).sum().backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == ("3", "backward", "grad_input")


def test_nonfinite_backward_from_the_loss_is_the_output(flags_read: str) -> None:
    model = mlp()
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        (model(torch.randn(3, 6)).sum() * math.nan).backward()
    assert (info.value.path, info.value.phase, info.value.tensor) == (OUTPUT, "backward", "grad_output")


def test_nonfinite_quiet_when_all_is_finite_and_one_sync_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_finite, "READ_AT_ONCE", frozenset())  # a GPU's way: flags stay on the device
    model = mlp(nn.ReLU(), nn.Identity())
    x = torch.randn(3, 6, requires_grad=True)
    with detect_nonfinite(model):
        model(x).sum().backward()  # warm
        syncs = CountSyncs(monkeypatch)
        out = model(x)
        assert syncs.count == 1, "one host read when the forward ends"
        out.sum().backward()
        assert syncs.count == 2, "one host read when the backward ends"
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_finite_values_whose_sum_overflows_are_finite(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max / 2  # four of them sum past the dtype's range: the CPU check's sum is inf
    model = nn.Sequential(Scale(1.0), Scale(1.0))
    x = torch.full((2, 6), big, dtype=dtype, requires_grad=True)
    with detect_nonfinite(model):
        out = model(x)
        out.backward(torch.full_like(out, big))  # gradients as large, finite
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert _finite.cpu_kind(torch.full((4,), big, dtype=dtype)) == _finite.FINITE
    assert _finite.cpu_kind(torch.tensor([big, -math.inf], dtype=dtype)) == _finite.MINUS_INF
    assert _finite.cpu_kind(torch.tensor([-math.inf, math.inf], dtype=dtype)) == _finite.NONFINITE
    assert _finite.cpu_kind(torch.tensor([big, big, math.nan], dtype=dtype)) == _finite.NONFINITE


def test_nonfinite_one_gradient_hook_on_an_input_fed_to_every_step() -> None:
    model = mlp()
    image = torch.randn(3, 6, requires_grad=True)  # an image being optimized: the same leaf every step
    with detect_nonfinite(model):
        for _ in range(5):
            model(image).sum().backward()
        assert len(image._backward_hooks) == 1, "a hook a forward would pile up"
        with pytest.raises(NonFiniteError) as info:
            (model(image).sum() * math.nan).backward()
    assert (info.value.path, info.value.phase) == (OUTPUT, "backward")
    assert not image._backward_hooks


def test_nonfinite_one_gradient_hook_on_a_tensor_fed_twice_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = gradient_hook_calls(monkeypatch)
    model = mlp(InfBackward(), nn.Tanh())
    fake = torch.randn(3, 6, requires_grad=True) * 2  # a generator's output: not a leaf, fed to the model twice
    with detect_nonfinite(model):
        loss = model(fake).sum() + model(fake).sum()
        with pytest.raises(NonFiniteError) as info:
            loss.backward()
    # per forward the outputs of the five modules, and the shared input once, though both forwards checked it
    assert len(calls) == 2 * 5 + 1
    assert len({id(hook) for hook in calls}) == len(calls)
    assert (info.value.path, info.value.phase, info.value.tensor) == ("2", "backward", "grad_input")


def test_nonfinite_in_threads_names_its_own_forward() -> None:
    model = mlp(Scale(1.0))
    results: dict[str, BaseException | None] = {}

    def run(name: str, x: Tensor) -> None:
        try:
            for _ in range(10):
                model(x)
            results[name] = None
        except NonFiniteError as exc:
            results[name] = exc

    clean, dirty = torch.randn(2, 6), torch.randn(2, 6)
    dirty[0, 0] = math.inf
    with detect_nonfinite(model):
        threads = [threading.Thread(target=run, args=(name, x)) for name, x in (("clean", clean), ("dirty", dirty))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results["clean"] is None
    assert isinstance(results["dirty"], NonFiniteError) and results["dirty"].path == INPUT


def test_nonfinite_backward_in_threads_names_its_own_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = mlp(InfBackward(), nn.Tanh())
    monkeypatch.setattr(_InfBackward, "clean_thread", "clean")
    results: dict[str, BaseException | None] = {}

    def run() -> None:
        name = threading.current_thread().name
        try:
            for _ in range(10):
                model(torch.randn(2, 6)).sum().backward()
            results[name] = None
        except NonFiniteError as exc:
            results[name] = exc

    with detect_nonfinite(model):
        threads = [threading.Thread(target=run, name=name) for name in ("clean", "dirty")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results["clean"] is None
    assert isinstance(results["dirty"], NonFiniteError)
    assert (results["dirty"].path, results["dirty"].phase) == ("2", "backward")


# --------------------------------------------------------------------------------------------------
# lifetime of the hooks


@pytest.fixture(params=["watch", "detect_nonfinite"])
def probe(request: pytest.FixtureRequest) -> Any:
    return watch if request.param == "watch" else detect_nonfinite


def test_probes_leave_no_hooks(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = gradient_hook_calls(monkeypatch)
    model = mlp(Keep())
    x = torch.randn(2, 6)
    with probe(model, ["0", "2", "3"]) as handle:
        assert module_hooks(model) > 0
        out = model(x)
        out.sum().backward(retain_graph=True)
        assert calls  # the gradients were checked
    calls.clear()
    assert not handle.active and module_hooks(model) == 0
    out.sum().backward()  # the graph still works, with nothing left to fire
    assert calls == []


def test_probes_leave_no_hooks_after_an_exception(probe: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = gradient_hook_calls(monkeypatch)
    model = mlp(Keep(), Boom())
    with pytest.raises(RuntimeError, match="boom"), probe(model):
        model(torch.randn(2, 6))
    kept = model[2].kept
    kept.sum().backward()
    assert module_hooks(model) == 0 and calls == []
    model[3].armed = False
    with probe(model):  # the failed forward was closed: the next one is checked from a clean start
        model(torch.randn(2, 6)).sum().backward()
    assert module_hooks(model) == 0


def test_probes_close_is_idempotent_and_stack_with_capture(probe: Any, images: torch.Tensor) -> None:
    model = Twice()
    handle = probe(model)
    with fh.capture(model, ["conv2"]) as feats, watch(model, ["head"]) as w:
        model(images).sum().backward()
    assert feats["conv2"].shape == (2, 8, 64, 64)
    assert [row.kind for row in w.summary()] == ["output", "grad"]
    handle.close()
    handle.close()
    assert module_hooks(model) == 0


def test_capture_inside_probes_still_traces_and_keeps_the_graph(images: torch.Tensor) -> None:
    model = Twice()
    with watch(model), detect_nonfinite(model), fh.capture(model, ["conv1", "act_1"]) as feats:
        out = model(images)
    # capture's meta trace deep-copies the model: the probes' hooks copy as no-ops, so the trace
    # succeeds and nothing needs a clone; the features are the graph's own tensors
    grads = torch.autograd.grad(out.sum(), [feats["conv1"], feats["act_1"]])
    assert [g.shape for g in grads] == [(2, 8, 64, 64)] * 2


def test_nested_probes_and_stale_hooks_are_pruned() -> None:
    model = mlp()
    with detect_nonfinite(model), watch(model) as w:
        model(torch.randn(2, 6)).sum().backward()
        first = live_hook_handles()
        for _ in range(20):
            model(torch.randn(2, 6)).sum().backward()
        assert live_hook_handles() < first + 10  # handles of finished graphs were dropped: no pile a step
    assert rows_by(w.summary())[("0", "grad")].calls == 21


def test_a_copy_of_a_probed_model_is_not_probed(probe: Any) -> None:
    import copy
    import pickle

    model = mlp()
    with probe(model, ["0", "2"]) as handle:
        twin = copy.deepcopy(model)  # an EMA model, say: made while the probe runs
        twin[0].weight.data.fill_(math.nan)
        twin(torch.randn(2, 6)).sum().backward()  # neither checked nor counted
        pickle.loads(pickle.dumps(model))(torch.randn(2, 6))
        model(torch.randn(2, 6)).sum().backward()
        if isinstance(handle, Watch):
            assert all(row.calls == 1 for row in handle.summary())
    assert module_hooks(model) == 0


def test_probes_across_inference_mode_and_training(probe: Any) -> None:
    model = mlp()
    with probe(model) as handle:
        for _ in range(2):
            with torch.inference_mode():  # validation: inference tensors, no graph
                model(torch.randn(3, 6))
            model(torch.randn(3, 6)).sum().backward()
    if isinstance(handle, Watch):
        rows = rows_by(handle.summary())
        assert rows[("0", "output")].calls == 4 and rows[("0", "grad")].calls == 2


def test_stats_names() -> None:
    assert STATS == ("count", "mean", "std", "min", "max", "absmax", "zeros", "nonfinite")


def test_std_survives_a_mean_far_larger_than_the_spread() -> None:
    """Sums of squares about the first value, not about 0: 1000 ± 0.01 keeps its std (it cancelled to 0.11)."""
    torch.manual_seed(0)
    identity = nn.Sequential(nn.Identity())
    x = 1000 + 0.01 * torch.randn(2, 1_000_000)
    with fh.watch(identity, ["0"], grads=False) as probe:
        identity(x)
        identity(x + 0.5)
    (row,) = probe.summary()
    both = torch.cat([x, x + 0.5]).double()
    assert row.std == pytest.approx(both.std(unbiased=False).item(), rel=1e-3)
    assert row.mean == pytest.approx(both.mean().item(), rel=1e-7)
