"""Cutting a batch in pieces (CPU micro-batches) only where every row provably depends on its own image alone: a
model with batch statistics gets one forward per batch, so dumped rows and statistics are those of that forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torchvision
from torch import nn

import featurehooks as fh
from featurehooks._stream import pipeline
from featurehooks._stream.independence import rows_independent


def batch_statistics_net() -> nn.Sequential:
    """torch.nn modules only, one of which normalizes each channel with the statistics of the batch it is given."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, track_running_stats=False), nn.ReLU())


@pytest.fixture
def tiny_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache budget of one byte: the smallest micro-batches (two images) wherever micro-batches are allowed."""
    monkeypatch.setattr(pipeline, "cache_budget", lambda: 1)


def test_dumped_rows_of_a_batch_statistics_model_are_one_forward_of_each_batch(
    tmp_path: Path, tiny_budget: None
) -> None:
    extractor = fh.FeatureExtractor(batch_statistics_net(), ["1"])
    images = torch.rand(8, 3, 24, 24)
    result = fh.dump_features(extractor, images, tmp_path / "out", batch_size=4, num_workers=0, progress=False)
    expected = np.concatenate([extractor(batch)["1"].numpy() for batch in images.split(4)])
    np.testing.assert_array_equal(result.load("1"), expected)


def test_statistics_of_a_batch_statistics_model_are_those_of_one_forward_of_each_batch(tiny_budget: None) -> None:
    extractor = fh.FeatureExtractor(batch_statistics_net(), ["2"])
    images = torch.rand(8, 3, 24, 24)
    stats = fh.feature_statistics(extractor, images, pool="avg", batch_size=4, num_workers=0)
    vectors = torch.cat([extractor(batch)["2"].mean((2, 3)) for batch in images.split(4)]).double()
    torch.testing.assert_close(stats.mean, vectors.mean(0), rtol=0, atol=1e-7)


def test_a_per_sample_model_still_runs_in_micro_batches(micro_batch_sizes: list[int], tiny_budget: None) -> None:
    torch.manual_seed(0)
    extractor = fh.FeatureExtractor(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8).eval(), nn.ReLU()), ["2"])
    fh.feature_statistics(extractor, torch.rand(5, 3, 24, 24), pool="avg", batch_size=5, num_workers=0)
    assert micro_batch_sizes == [2, 3]  # never a piece of one image: ATen picks other kernels for it


def _hooked(model: nn.Module) -> nn.Module:
    model[0].register_forward_hook(lambda module, args, output: None)
    return model


def _patched(model: nn.Module) -> nn.Module:
    """A known module whose forward the user replaced on the instance, with one that mixes the batch."""
    conv = model[0]
    model[0].forward = lambda x: nn.Conv2d.forward(conv, x - x.mean(0))
    return model


class OwnForward(nn.Module):
    """A forward of the user's own: nothing proves that it keeps the rows apart."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x - x.mean(0))


@pytest.mark.parametrize(
    ("build", "independent"),
    [
        (lambda: torchvision.models.resnet18(), True),
        (lambda: timm.create_model("resnet10t"), True),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(1), nn.Linear(4, 2), nn.Softmax(-1)), True),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.GroupNorm(2, 4), nn.Dropout()), True),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False)), False),
        (lambda: torchvision.models.resnet18().train(), False),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(0)), False),
        (lambda: nn.Sequential(nn.Flatten(1), nn.Softmax(0)), False),
        (lambda: nn.Sequential(nn.Flatten(1), nn.Softmax()), False),  # dim=None: axis 0 of a 3-d tensor
        (lambda: nn.Sequential(OwnForward()), False),
        (lambda: _hooked(nn.Sequential(nn.Conv2d(3, 4, 3))), False),
        (lambda: _patched(nn.Sequential(nn.Conv2d(3, 4, 3))), False),
    ],
)
def test_rows_are_independent_only_where_every_module_is_known_to_keep_them_apart(
    build: object, independent: bool
) -> None:
    model = build()  # type: ignore[operator]
    if independent or not model.training:
        model.eval()
    assert rows_independent(model) is independent


def test_a_global_forward_hook_makes_no_model_independent() -> None:
    handle = nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        assert not rows_independent(nn.Sequential(nn.Conv2d(3, 4, 3)).eval())
    finally:
        handle.remove()
