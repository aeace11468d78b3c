"""The hook engine is one place: one meta forward (conv work counted by the trace itself), one stop signal,
sessions split by purpose over one base that owns the handles, and probes fed a selection of module calls."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import featurehooks as fh
from featurehooks import _copy, _trace
from featurehooks._hooks import Hooks, Observer, ObserverSession, StopForward
from featurehooks._taps import Selection
from featurehooks._trace import trace, trace_images
from featurehooks.layers import select_modules

from helpers import FlattensWithView  # a .view that fails with channels-last strides


def test_an_extractor_runs_one_meta_trace_and_at_most_one_channels_last_check(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []

    def counting(model: nn.Module) -> nn.Module:
        copies.append(model)
        return _copy.meta_copy(model)

    monkeypatch.setattr(_trace, "meta_copy", counting)
    forced = fh.FeatureExtractor("resnet18", ["layer2"], weights=None, memory_format="contiguous")
    assert len(copies) == 1 and forced.conv_work is None
    copies.clear()
    extractor = fh.FeatureExtractor("resnet18", ["layer2"], weights=None)
    # the trace that lists shapes and in-place changes also counted the convolution work; where that says
    # channels-last could pay, "auto" runs one channels-last meta forward more (it never re-runs a real one)
    assert len(copies) == 2
    assert extractor.conv_work is not None and extractor.conv_work.share > 0.9


def test_the_trace_counts_conv_work_per_call_only_when_asked() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
    plain, _ = trace_images(model, 4, 3)
    assert not plain.conv_work
    counted, _ = trace_images(model, 4, 3, count_conv=True)
    assert dict(counted.calls) == dict(plain.calls) and dict(counted.outputs) == dict(plain.outputs)
    at_conv = counted.conv_work[("0", 0)]
    macs = 8 * 3 * 9 * 4 * 4  # per image: output elements times the inputs of each
    assert at_conv.share == pytest.approx(1.0)
    assert at_conv.reuse(4, 4) == pytest.approx(macs / (8 * 3 * 9))
    whole = counted.conv_work[None]
    assert whole.share == pytest.approx(macs / (macs + 8 * 4 * 4 * 5))


def test_the_counting_trace_runs_in_the_images_own_format() -> None:
    found = trace(FlattensWithView(), (torch.empty(2, 3, 8, 8),), count_conv=True)
    assert ("head", 0) in found.conv_work and None in found.conv_work  # a .view that needs NCHW strides runs
    plain = trace(FlattensWithView(), (torch.empty(2, 3, 8, 8),))
    assert dict(found.changes) == dict(plain.changes)  # the clones planned are those of the NCHW forward


def test_stop_forward_is_the_only_stop_signal() -> None:
    stops = set()
    for info in pkgutil.walk_packages(fh.__path__, "featurehooks."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and not issubclass(value, Exception):
                stops.add(value)
    assert stops == {StopForward}


def test_hooks_remove_module_and_tensor_hooks_together() -> None:
    net = nn.Linear(2, 2)
    x = torch.ones(1, 2, requires_grad=True)
    hooks = Hooks()
    hooks.adopt(net.register_forward_hook(lambda *_: None))
    hooks.hold(x, lambda grad: None)
    assert hooks.active and net._forward_hooks and x._backward_hooks
    hooks.remove()
    hooks.remove()  # safe twice
    assert not hooks.active and not net._forward_hooks and not x._backward_hooks


class Calls(Observer[list[tuple[str, int]]]):
    """Records the calls it is told of, per forward."""

    def __init__(self) -> None:
        self.forwards: list[list[tuple[str, int]]] = []

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, int]]:
        self.forwards.append([])
        return self.forwards[-1]

    def after(
        self, state: list[tuple[str, int]], path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        state.append((path, call))


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.out = nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.lin(self.lin(x)))


def test_an_observer_hears_only_the_selected_calls() -> None:
    model = Twice()
    selection = select_modules(model, ["lin_1", "out*"], default=lambda m: [], what="observe")
    assert selection == Selection({"lin": frozenset({1}), "out": None})
    observer = Calls()
    session = ObserverSession(model, selection, observer)
    try:
        model(torch.ones(1, 2))
        model.lin(torch.ones(1, 2))  # a top-level call of a submodule: a forward of its own, call 0
    finally:
        session.remove()
    assert observer.forwards == [[("lin", 1), ("out", 0)], []]
    assert not session.active and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
