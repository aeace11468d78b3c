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
    """The rows of a watched identity fed ``inputs`` one call each, a window (``reset``) per call."""
    model = nn.Sequential(nn.Identity())
    rows = []
    with watch(model, ["0"], grads=grads, fused=fused) as w:
        for x in inputs:
            model(x)
            rows += w.summary()
            w.reset()
    return rows


def assert_same_rows(fused: list[WatchRow], eager: list[WatchRow]) -> None:
    assert [(r.name, r.kind, r.calls, r.count, r.nonfinite) for r in fused] == [
        (r.name, r.kind, r.calls, r.count, r.nonfinite) for r in eager
    ]
    for a, b in zip(fused, eager):
        assert (a.min, a.max, a.absmax, a.zeros) == (b.min, b.max, b.absmax, b.zeros)  # exact either way
        assert a.mean == pytest.approx(b.mean, rel=1e-6, abs=1e-7 * b.absmax)  # rows of float32 sums, added in float64
        assert a.std == pytest.approx(b.std, rel=1e-6)


def assert_direct(row: WatchRow, x: Tensor) -> None:
    """``row`` against the statistics of ``x`` in float64."""
    values = x.detach().double().flatten()
    finite = values[torch.isfinite(values)]
    assert (row.count, row.nonfinite) == (values.numel(), values.numel() - finite.numel())
    assert (row.min, row.max) == (finite.min().item(), finite.max().item())
    assert row.zeros == (values == 0).double().mean().item()
    assert row.mean == pytest.approx(finite.mean().item(), rel=1e-6, abs=1e-7 * finite.abs().max().item())
    assert row.std == pytest.approx(finite.std(correction=0).item(), rel=1e-6)


def seeded(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def bf16_calls() -> list[Tensor]:
    """Calls that take every branch: rows with a tail, zeros, channels-last, a mean that would cancel the variance
    (1 +- 0.01: the second pass around the mean), a NaN and an inf, and magnitudes whose float32 squares underflow
    or overflow (the exact path), fewer than two rows (the eager passes), an inference tensor."""
    with torch.inference_mode():
        inference = seeded(40_000, seed=6).bfloat16()
    return [
        seeded(8, 64, 28, 28, seed=1).relu().bfloat16(),
        seeded(3, 7, 1001, seed=2).bfloat16(),
        seeded(4, 64, 30, 30, seed=3).bfloat16().to(memory_format=torch.channels_last),
        (1 + 0.01 * seeded(50_000, seed=4)).bfloat16(),
        torch.cat([seeded(30_000, seed=5), torch.tensor([math.nan, math.inf])]).bfloat16(),
        seeded(500, seed=7).bfloat16(),
        inference,
        (1e-30 * seeded(30_000, seed=15)).bfloat16(),
        (1e30 * seeded(30_000, seed=16)).bfloat16(),
    ]


@pytest.mark.slow
def test_fused_rows_equal_the_eager_rows_on_every_path() -> None:
    calls = bf16_calls()
    fused = rows_of(True, calls)
    assert_same_rows(fused, rows_of(False, calls))
    for row, x in zip(fused, calls):
        assert_direct(row, x)
    assert fused[3].std > 0.005  # 1 +- 0.01 kept its spread


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_rows_equal_the_eager_rows_in_other_dtypes(dtype: torch.dtype) -> None:
    calls = [seeded(2, 32, 33, 35, seed=8).relu().to(dtype), seeded(70_000, seed=9).to(dtype)]
    if dtype == torch.float32:
        calls.append(1000 + 0.01 * seeded(60_000, seed=10))  # cancels without the second pass
        calls += [1e-12 * seeded(5000, seed=17), 1e16 * seeded(5000, seed=18)]  # the ends of the fast range
        calls += [1e-40 * seeded(5000, seed=19), 3e37 * seeded(5000, seed=20)]  # past them: the exact path
    fused = rows_of(True, calls)
    assert_same_rows(fused, rows_of(False, calls))
    for row, x in zip(fused, calls):
        assert_direct(row, x)


@pytest.mark.slow
def test_fused_kernel_is_one_graph_for_every_size_and_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """One graph, built at the first call (the kernel runs compiled, not eagerly): a first call of exactly 1024 rows
    (as many rows as a row has values) does not tie the graph to that count, nor a view at offset 0 to offset 0."""
    torch._dynamo.reset()
    monkeypatch.setattr(_fused, "_compiled", set())
    before = counters["stats"]["unique_graphs"]
    calls = [seeded(1024 * 1024, seed=12).bfloat16()]
    calls += [seeded(size, seed=size).bfloat16() for size in (16_385, 2 * 16_385 + 1, 100_000, 3 * 1024 * 1024 + 5)]
    calls += [seeded(2, 40_000, seed=13).bfloat16()[1], seeded(3, 30_000, seed=14).bfloat16()[1:]]  # offsets
    fused = rows_of(True, calls)
    assert counters["stats"]["unique_graphs"] == before + 1
    for row, x in zip(fused, calls):
        assert_direct(row, x)


@pytest.mark.slow
def test_fused_past_the_recompile_limit_runs_eagerly() -> None:
    calls = [seeded(30_000, seed=11).bfloat16()]
    rows_of(True, calls)  # the graph of this thread count exists
    threads = torch.get_num_threads()
    # torch's own patch: pytest's monkeypatch deletes a config entry on undo, failing every later compile
    with torch._dynamo.config.patch(recompile_limit=1):
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
    class BackendFailed(RuntimeError):
        """Like dynamo's BackendCompilerFailed: the compiler's error inside."""

        def __init__(self, inner: Exception) -> None:
            super().__init__("backend='inductor' raised:")
            self.inner_exception = inner

    attempts = []

    def no_compiler(*args: object, **kwargs: object) -> object:
        def fail(rows: Tensor) -> Tensor:
            attempts.append(rows.shape)
            raise BackendFailed(RuntimeError("CppCompileError: C++ compile error\nlong compiler output"))

        return fail

    monkeypatch.setattr(_fused, "_kernel", None)
    monkeypatch.setattr(_fused, "_compiled", set())
    monkeypatch.setattr(_fused, "_failed", {})
    monkeypatch.setattr(torch, "compile", no_compiler)
    model = nn.Sequential(nn.Identity())
    message = r"for torch.float32 .*: CppCompileError: C\+\+ compile error\. watch\(fused=False\)"
    with watch(model, ["0"], fused=True) as w:
        assert repr(w) == "Watch(1 layers, grads=True, fused=True, active)"
        for _ in range(2):  # the second time at once, without compiling again
            with pytest.raises(RunFailedError, match=message):
                model(seeded(20_000))
        assert w.summary() == []  # the calls that raised left no row behind
        model(seeded(1000))  # fewer than two rows of 1024: the eager passes, nothing to compile
    assert len(attempts) == 1
    (row,) = w.summary()
    assert (row.calls, row.count) == (1, 1000)
    with watch(model, ["0"]) as eager:
        assert repr(eager) == "Watch(1 layers, grads=True, active)" and eager.fused is False
