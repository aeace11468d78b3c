"""Taps changed in place later: the extractor's private backbone runs such activations out of place instead of
cloning the tap; values and input gradients stay bitwise those of the cloned path and of torchvision FX."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import featurehooks as fh
from featurehooks import _tap_session
from featurehooks._trace import trace

VGG_TAPS = ["conv1_2", "relu1_2", "conv3_3", "relu3_3"]
RESNET_TAPS = ["layer1.0.bn1", "layer1.0.relu", "layer1.0.bn2", "layer2.1.bn1"]  # bn2: `out += identity` next


def cloning(monkeypatch: pytest.MonkeyPatch, build: Callable[[], fh.FeatureExtractor]) -> fh.FeatureExtractor:
    """An extractor built as before this change: every tap changed in place later is cloned."""
    with monkeypatch.context() as patch:
        patch.setattr(_tap_session, "release_inplace", lambda model, found, sites, stop_early: found)
        return build()


def fx_out_of_place(name: str, nodes: list[str]) -> nn.Module:
    """torchvision's FX extractor over the cached weights, its ReLUs out of place (true pre-activation taps)."""
    model = tvm.get_model(name, weights="DEFAULT").eval()
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return create_feature_extractor(model, {node: node for node in nodes})


def input_grad(extractor: fh.FeatureExtractor, images: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Features and the input gradient of a loss that weighs every tap differently."""
    x = images.detach().requires_grad_(True)
    feats = extractor(x)
    loss = sum((index + 1) * (value * value).mean() for index, value in enumerate(feats.values()))
    (grad,) = torch.autograd.grad(loss, x)
    return {name: value.detach() for name, value in feats.items()}, grad


def paths_of(extractor: fh.FeatureExtractor, names: list[str]) -> list[str]:
    return [tap.path for tap in extractor.taps if tap.name in names]


@pytest.mark.slow
def test_vgg16_conv_and_relu_taps_and_input_gradients_equal_fx_with_no_clone(
    vgg16_cached: Path, images: torch.Tensor, count_clones: Callable[[], Any]
) -> None:
    extractor = fh.FeatureExtractor("vgg16", VGG_TAPS, mode="grad", memory_format="contiguous")  # NCHW as FX
    with count_clones() as clones:
        ours, grad = input_grad(extractor, images)
    assert clones.count == 0
    paths = paths_of(extractor, VGG_TAPS)
    x = images.clone().requires_grad_(True)
    theirs = fx_out_of_place("vgg16", paths)(extractor.normalize(x))
    loss = sum((index + 1) * (theirs[path] * theirs[path]).mean() for index, path in enumerate(paths))
    for name, path in zip(VGG_TAPS, paths):
        assert torch.equal(ours[name], theirs[path]), name
    assert torch.equal(grad, torch.autograd.grad(loss, x)[0])
    assert (ours["conv3_3"] < 0).any() and (ours["conv1_2"] < 0).any(), "conv taps are pre-activation"
    backbone = extractor.backbone
    assert not backbone.get_submodule("features.3").inplace and not backbone.get_submodule("features.15").inplace
    assert backbone.get_submodule("features.1").inplace, "a ReLU after no tap stays in place"


def test_vgg16_values_and_input_gradients_equal_the_cloned_path(
    vgg16_cached: Path, images: torch.Tensor, monkeypatch: pytest.MonkeyPatch, count_clones: Callable[[], Any]
) -> None:
    def build() -> fh.FeatureExtractor:
        return fh.FeatureExtractor("vgg16", VGG_TAPS, mode="grad", early_exit=False)

    cloned = cloning(monkeypatch, build)
    released = build()
    with count_clones() as clones:
        before, grad_before = input_grad(cloned, images)
    assert clones.count == 2, "conv1_2 and conv3_3"
    with count_clones() as clones:
        after, grad_after = input_grad(released, images)
    assert clones.count == 0
    for name in VGG_TAPS:
        assert torch.equal(after[name], before[name]), name
    assert torch.equal(grad_after, grad_before)


def test_resnet_bn_taps_before_the_shared_relu_are_not_cloned_but_a_tap_before_add_is(
    resnet18_cached: Path, images: torch.Tensor, monkeypatch: pytest.MonkeyPatch, count_clones: Callable[[], Any]
) -> None:
    def build() -> fh.FeatureExtractor:
        return fh.FeatureExtractor("resnet18", RESNET_TAPS, mode="grad", memory_format="contiguous")

    cloned = cloning(monkeypatch, build)
    released = build()
    before, grad_before = input_grad(cloned, images)
    with count_clones() as clones:
        after, grad_after = input_grad(released, images)
    assert clones.count == 1, "only layer1.0.bn2, changed by `out += identity`, is cloned"
    theirs = fx_out_of_place("resnet18", RESNET_TAPS)(released.normalize(images))
    for name in RESNET_TAPS:
        assert torch.equal(after[name], before[name]), name
        assert torch.equal(after[name], theirs[name]), name
    assert torch.equal(grad_after, grad_before)
    assert (after["layer1.0.bn1"] < 0).any() and (after["layer1.0.bn2"] < 0).any()
    backbone = released.backbone
    assert not backbone.get_submodule("layer1.0.relu").inplace  # its three calls are all out of place now
    assert backbone.get_submodule("layer1.1.relu").inplace and backbone.relu.inplace


class ConvAct(nn.Module):
    """A tapped convolution, an in-place activation, a head."""

    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = act if act is not None else nn.ReLU(inplace=True)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.conv(x)))


class AddThenAct(ConvAct):
    """The tap is changed in place by a functional ``+=`` before the in-place ReLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        out += 1.0
        return self.head(self.act(out))


class SideEffect(ConvAct):
    """Relies on the in-place ReLU changing its input: out of place, the head would see the pre-activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        self.act(out)
        return self.head(out)


class Untraceable(ConvAct):
    """Python control flow on values: no meta trace, so real forwards are checked for in-place changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        if out.sum() > -1e9:
            out = self.act(out)
        return self.head(out)


def elu_net() -> ConvAct:
    """An in-place ELU: out of place its gradients differ in the last bit, so it is never switched."""
    return ConvAct(nn.ELU(inplace=True))


def extracted(
    net: nn.Module, x: torch.Tensor, count_clones: Callable[[], Any]
) -> tuple[fh.FeatureExtractor, dict[str, torch.Tensor], int]:
    """An NCHW extractor of ``net``'s conv and head, its features of ``x``, and the clones that forward made."""
    extractor = fh.FeatureExtractor(net, ["conv", "head"], memory_format="contiguous")
    with count_clones() as clones:
        feats = extractor(x)
    return extractor, feats, clones.count


@pytest.mark.parametrize("build", [AddThenAct, SideEffect, elu_net], ids=["add", "side_effect", "elu"])
def test_in_place_changes_that_a_switch_cannot_remove_keep_the_clone(
    build: Callable[[], ConvAct], count_clones: Callable[[], Any]
) -> None:
    torch.manual_seed(0)
    net = build().eval()
    x = torch.rand(2, 3, 8, 8)
    extractor, feats, clones = extracted(net, x, count_clones)
    assert clones == 1
    assert torch.equal(feats["conv"], net.conv(x)) and (feats["conv"] < 0).any()
    assert torch.equal(feats["head"], net(x))
    assert extractor.backbone.act.inplace and net.act.inplace


def test_the_users_module_keeps_its_in_place_relu(count_clones: Callable[[], Any]) -> None:
    torch.manual_seed(0)
    net = ConvAct().eval()
    x = torch.rand(2, 3, 8, 8)
    extractor, feats, clones = extracted(net, x, count_clones)
    assert clones == 0 and not extractor.backbone.act.inplace
    assert net.act.inplace, "FeatureExtractor switches its own copy only"
    with count_clones() as captured_clones, fh.capture(net, ["conv", "head"]) as captured:
        net(x)
    assert captured_clones.count == 1 and net.act.inplace, "capture() clones and leaves the user's modules alone"
    assert torch.equal(captured["conv"], feats["conv"]) and (feats["conv"] < 0).any()


def test_an_untraceable_model_keeps_cloning(count_clones: Callable[[], Any]) -> None:
    torch.manual_seed(0)
    net = Untraceable().eval()
    x = torch.rand(2, 3, 8, 8)
    with pytest.warns(UserWarning, match="changed in place"):
        extractor, feats, clones = extracted(net, x, count_clones)
    assert extractor.backbone.act.inplace and clones == 1
    assert torch.equal(feats["conv"], net.conv(x))


def test_trace_names_the_module_call_that_changed_a_tap() -> None:
    net = nn.Sequential(AddThenAct(), nn.ReLU(inplace=True))
    sites = [("0.conv", 0), ("0.head", 0)]
    found = trace(net, (torch.empty(1, 3, 8, 8),), watch=sites)
    assert found.changed_by(sites, stop_early=False) == {
        ("0.conv", 0): frozenset({None, "0.act"}),
        ("0.head", 0): frozenset({"1"}),
    }
    assert found.changed_by(sites, stop_early=True) == {("0.conv", 0): frozenset({None, "0.act"})}
    assert found.changed_in_place(sites, stop_early=True) == {("0.conv", 0)}
