"""Edge cases: copies and pickles, capture's hook state between forwards, side effects of the meta dry run,
weights files that do not fit, empty batches."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import featurehooks as fh


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3), nn.ReLU())


class NoMeta(nn.Module):
    """Data-dependent Python control flow: cannot run on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean().item() > 10:
            x = x * 2
        return self.conv2(self.relu(self.conv(x)))


class Cached(nn.Module):
    """Keeps a per-size table in a plain attribute, as positional-embedding caches do."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None or self.table.shape[-2:] != x.shape[-2:]:
            self.table = torch.ones(x.shape[-2:], device=x.device)
        return self.conv(x) + self.table


def test_deepcopy_and_pickle_of_a_parent_holding_an_extractor() -> None:
    parent = nn.ModuleDict({"ext": fh.FeatureExtractor(tiny(), ["0", "2"])})
    x = torch.rand(1, 3, 16, 16)
    expected = parent["ext"](x)
    ema = copy.deepcopy(parent)  # EMA copies of a model that holds a loss
    buffer = io.BytesIO()
    torch.save(parent, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (ema, loaded):
        got = other["ext"](x)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        other["ext"].close()
    assert torch.equal(parent["ext"](x)["2"], expected["2"])  # the original keeps its own hooks


def test_extractor_without_dry_run_works_under_inference_mode(count_clones: Callable[[], Any]) -> None:
    ext = fh.FeatureExtractor(NoMeta(), ["conv"])
    with torch.inference_mode():
        ext(torch.rand(1, 3, 16, 16))
        built_inside = fh.FeatureExtractor(tiny(), ["0", "2"])
        assert [row.channels for row in built_inside.feature_info] == [4, 4]  # traced inside inference mode
        with count_clones() as clones:
            feats = built_inside(torch.rand(1, 3, 16, 16))
        # the trace saw the in-place ReLU change tap "0": it runs out of place instead of the tap being cloned
        assert clones.count == 0 and not built_inside.backbone[1].inplace and (feats["0"] < 0).any()


def test_capture_hooks_store_nothing_between_forwards() -> None:
    net = tiny()
    with fh.capture(net, ["0", "2"]) as feats:
        net(torch.rand(1, 3, 16, 16))
        net[0](torch.rand(1, 3, 16, 16))  # a tapped layer used on its own
        assert set(feats) == {"0", "2"}


def test_capture_without_dry_run_is_right_on_the_first_forward() -> None:
    torch.manual_seed(0)
    model, x = NoMeta(), torch.randn(1, 3, 16, 16)
    expected = model.conv(x).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fh.capture(model, ["conv"]) as feats:
            model(x)
            assert torch.equal(feats["conv"].detach(), expected)  # not post-ReLU


@pytest.mark.parametrize("how", ["extractor", "capture"])
def test_dry_run_leaves_no_meta_tensor_in_the_model(how: str) -> None:
    model, x = Cached(), torch.rand(1, 3, 224, 224)
    if how == "extractor":
        ext = fh.FeatureExtractor(model, ["conv"], early_exit=False)
        ext(x)
        assert ext.backbone.table is None or not ext.backbone.table.is_meta
    else:
        with fh.capture(model, ["conv"]):
            model(x)
        assert not model.table.is_meta
        model(x)


def test_half_precision_weights_file_loads_into_a_float_model(tmp_path) -> None:
    import torchvision

    path = tmp_path / "half.pth"
    torch.save(torchvision.models.resnet18().half().state_dict(), path)
    ext = fh.FeatureExtractor("resnet18", ["layer1"], weights=str(path))
    assert ext(torch.rand(1, 3, 32, 32))["layer1"].dtype == torch.float32


def test_weights_file_that_does_not_fit_is_a_weights_error(tmp_path) -> None:
    import torchvision

    state = torchvision.models.resnet18().state_dict()
    state["extra"] = torch.zeros(1)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(fh.WeightsUnavailableError, match="do not fit ResNet.*extra"):
        fh.FeatureExtractor("resnet18", ["layer1"], weights=str(tmp_path / "bad.pth"))


def test_empty_batch_on_the_first_call() -> None:
    ext = fh.FeatureExtractor(tiny(), ["2"])
    assert ext(torch.rand(0, 3, 16, 16))["2"].shape == (0, 4, 12, 12)


def test_list_layers_at_a_small_input_size() -> None:
    rows = {row.path: row for row in fh.list_layers("resnet18", input_size=32)}
    assert rows["layer4"].channels == 512 and rows["layer4"].stride == 32
    model = tiny().train()
    fh.list_layers(model)
    assert model.training  # the caller's mode is restored


def test_list_layers_leaves_no_meta_tensor_in_the_callers_module() -> None:
    model = Cached()
    fh.list_layers(model, input_size=32)
    model(torch.rand(1, 3, 32, 32))
