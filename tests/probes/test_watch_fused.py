"""watch(fused=True): every statistic of a call in one pass compiled by TorchInductor, the same rows as the eager
passes (compiling takes seconds: the tests that compile are marked slow)."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from featurehooks.errors import RunFailedError
from featurehooks.probes import _fused
from featurehooks.probes.watch import WatchRow, watch


def rows_of(fused: bool, inputs: list[Tensor], grads: bool = False) -> list[WatchRow]:
    """The rows of a watched identity fed ``inputs`` one call each."""
    model = nn.Sequential(nn.Identity())
    with watch(model, ["0"], grads=grads, fused=fused) as w:
        for x in inputs:
            model(x)
    return w.summary()


def assert_same_rows(fused: list[WatchRow], eager: list[WatchRow]) -> None:
    assert [(r.name, r.kind, r.calls, r.count, r.nonfinite) for r in fused] == [
        (r.name, r.kind, r.calls, r.count, r.nonfinite) for r in eager
    ]
    for a, b in zip(fused, eager):
        assert (a.min, a.max, a.absmax, a.zeros) == (b.min, b.max, b.absmax, b.zeros)  # exact either way
        assert a.mean == pytest.approx(b.mean, rel=1e-6, abs=1e-7 * b.absmax)  # rows of float32 sums, added in float64
        assert a.std == pytest.approx(b.std, rel=1e-6)


def seeded(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bf16_calls() -> list[Tensor]:
    """Calls that take every branch: rows with a tail, zeros, channels-last, a mean that would cancel the variance,
    a NaN (the exact path), few values (float64 at once)."""
    with torch.inference_mode():
        inference = seeded(40_000, seed=6).bfloat16()
    return [
        seeded(8, 64, 28, 28, seed=1).relu().bfloat16(),
        seeded(3, 7, 1001, seed=2).bfloat16(),
        seeded(4, 64, 30, 30, seed=3).bfloat16().to(memory_format=torch.channels_last),
        (1000 + 0.01 * seeded(50_000, seed=4)).bfloat16(),
        torch.cat([seeded(30_000, seed=5), torch.tensor([math.nan, math.inf])]).bfloat16(),
        seeded(500, seed=7).bfloat16(),
        inference,
    ]


@pytest.mark.slow
def test_fused_rows_equal_the_eager_rows_on_every_path() -> None:
    calls = bf16_calls()
    fused = rows_of(True, calls)
    assert_same_rows(fused, rows_of(False, calls))
    values = torch.cat([x.flatten().double() for x in calls])
    finite = values[torch.isfinite(values)]
    (row,) = fused
    assert (row.count, row.nonfinite) == (values.numel(), 2)
    assert row.mean == pytest.approx(finite.mean().item(), rel=1e-6)
    assert row.std == pytest.approx(finite.std(correction=0).item(), rel=1e-6)
    assert row.zeros == (values == 0).double().mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_rows_equal_the_eager_rows_in_other_dtypes(dtype: torch.dtype) -> None:
    calls = [seeded(2, 32, 33, 35, seed=8).relu().to(dtype), seeded(70_000, seed=9).to(dtype)]
    assert_same_rows(rows_of(True, calls), rows_of(False, calls))


@pytest.mark.slow
def test_fused_kernel_is_compiled_once_for_every_size() -> None:
    rows_of(True, [seeded(20_000).bfloat16()])  # the bfloat16 graph exists
    before = counters["stats"]["unique_graphs"]
    sizes = [16_385, 2 * 16_385 + 1, 100_000, 1 << 20, 3 * 1024 * 1024 + 5]
    rows_of(True, [seeded(size, seed=size).bfloat16() for size in sizes])
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_fused_past_the_recompile_limit_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [seeded(30_000, seed=11).bfloat16()]
    rows_of(True, calls)  # the graph of this thread count exists
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # a guard of the graph: another one would be compiled
    try:
        fused = rows_of(True, calls)
    finally:
        torch.set_num_threads(threads)
    assert_same_rows(fused, rows_of(False, calls))


@pytest.mark.slow
def test_fused_training_under_bf16_autocast_in_threads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten())
    copies = {fused: copy.deepcopy(model) for fused in (True, False)}
    x = seeded(4, 3, 48, 48, seed=10)
    rows = {}
    for fused, net in copies.items():
        with watch(net, ["0", "2"], fused=fused) as w:
            threads = [threading.Thread(target=train_step, args=(net, x)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        rows[fused] = w.summary()
    assert [(r.name, r.kind, r.calls) for r in rows[True]] == [
        (name, kind, 2) for name in ("0", "2") for kind in ("output", "grad")
    ]
    assert_same_rows(rows[True], rows[False])


def train_step(net: nn.Module, x: Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    out.float().square().mean().backward()


def test_fused_compile_failure_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_compiler(*args: object, **kwargs: object) -> object:
        def fail(rows: Tensor) -> Tensor:
            raise RuntimeError("CppCompileError: C++ compile error\nlong compiler output")

        return fail

    monkeypatch.setattr(_fused, "_kernel", None)
    monkeypatch.setattr(_fused, "_compiled", set())
    monkeypatch.setattr(torch, "compile", no_compiler)
    model = nn.Sequential(nn.Identity())
    with watch(model, ["0"], fused=True) as w:
        assert repr(w) == "Watch(1 layers, grads=True, fused=True, active)"
        model(seeded(1000))  # few values: float64 at once, nothing to compile
        with pytest.raises(RunFailedError, match=r"CppCompileError: C\+\+ compile error\. watch\(fused=False\)"):
            model(seeded(20_000))
    with watch(model, ["0"]) as eager:
        assert repr(eager) == "Watch(1 layers, grads=True, active)" and eager.fused is False
