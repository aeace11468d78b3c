"""The hook engine is one place: one meta forward (conv work counted by the trace itself) and one stop signal."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch
from test_memory_formats import FlattensWithView  # a .view that fails with channels-last strides
from torch import nn

import featurehooks as fh
from featurehooks import _copy, _trace
from featurehooks._hooks import StopForward
from featurehooks._trace import trace, trace_images


def test_an_extractor_runs_one_meta_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = []

    def counting(model: nn.Module) -> nn.Module:
        copies.append(model)
        return _copy.meta_copy(model)

    monkeypatch.setattr(_trace, "meta_copy", counting)
    extractor = fh.FeatureExtractor("resnet18", ["layer2"], weights=None)
    assert len(copies) == 1  # the trace that lists shapes and in-place changes also counted the convolution work
    assert extractor._conv_work is not None and extractor._conv_work.share > 0.9


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


def test_a_channels_last_failure_keeps_the_work_counted_before_it() -> None:
    found = trace(FlattensWithView(), (torch.empty(2, 3, 8, 8),), count_conv=True)
    assert ("head", 0) in found.outputs  # traced again in NCHW: the whole forward is known
    assert ("conv", 0) in found.conv_work and ("head", 0) not in found.conv_work and None not in found.conv_work
    assert not found.inputs.count_conv  # Trace.again repeats the NCHW forward
    early = fh.FeatureExtractor(FlattensWithView(), ["conv"], weights=None)
    assert early._conv_share == pytest.approx(1.0)  # the failing view runs after the last tap: never reached


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
