"""capture(..., grads=True): gradients of the captured outputs, checked against autograd on FX-extracted features.

The gradient of a captured output is defined as the gradient with respect to the value the module
returned. For a tap the model changes in place later (a BatchNorm output before an in-place ReLU,
``out += identity``), the captured feature is a copy of that value, and its gradient is the one that
flows back into the module: the reference is autograd on a copy of the model whose ReLUs are not
in place, and, on the model itself, the gradient of the changed tensor through the ReLU's mask.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import featurehooks as fh


def hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.fixture(scope="module")
def resnet18(seeded_weights: Callable[..., Path]) -> nn.Module:
    seeded_weights("resnet18")
    return tvm.resnet18(weights="DEFAULT").eval()


def top_score(logits: torch.Tensor) -> torch.Tensor:
    """The sum over the batch of each sample's top class logit (the class fixed from these logits)."""
    top = logits.detach().argmax(dim=1, keepdim=True)
    return logits.gather(1, top).sum()


def grad_cam(activation: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    weights = gradient.mean(dim=(2, 3), keepdim=True)
    return torch.relu((weights * activation).sum(dim=1))


def test_grad_cam_gradients_equal_autograd_on_fx_features(resnet18: nn.Module, images: torch.Tensor) -> None:
    with fh.capture(resnet18, ["layer3", "layer4"], grads=True) as feats:
        top_score(resnet18(images)).backward()
    fx = create_feature_extractor(resnet18, {"layer3": "layer3", "layer4": "layer4", "fc": "logits"})
    out = fx(images)
    grads = torch.autograd.grad(top_score(out["logits"]), [out["layer3"], out["layer4"]])
    expected = dict(zip(["layer3", "layer4"], grads))
    assert list(feats.grads) == ["layer3", "layer4"]
    for name in ("layer3", "layer4"):
        assert feats.grads[name].shape == feats[name].shape
        torch.testing.assert_close(feats[name], out[name])
        torch.testing.assert_close(feats.grads[name], expected[name])
    cam = grad_cam(feats["layer4"], feats.grads["layer4"])
    torch.testing.assert_close(cam, grad_cam(out["layer4"], expected["layer4"]))
    assert cam.shape == (2, 2, 2) and cam.abs().sum() > 0


def test_taps_changed_in_place_later_get_the_gradient_into_the_module(
    resnet18: nn.Module, images: torch.Tensor
) -> None:
    # layer1.0.bn1 is changed by the in-place ReLU after it; layer1.0.bn2 by `out += identity`, then that ReLU.
    # layer1.0.relu returns bn1's very tensor, changed; layer1.0.relu_1 is the second call of that ReLU.
    taps = ["layer1.0.bn1", "layer1.0.relu", "layer1.0.bn2", "layer1.0.relu_1"]
    with fh.capture(resnet18, taps, grads=True) as feats:
        top_score(resnet18(images)).backward()
    assert (feats["layer1.0.bn1"] < 0).any(), "captured before the in-place ReLU (a copy)"

    # Reference 1: the same weights with out-of-place ReLUs, where the module outputs stay as returned.
    apart = copy.deepcopy(resnet18)
    for module in apart.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    fx = create_feature_extractor(apart, {**{t: t for t in taps}, "fc": "logits"})
    out = fx(images)
    expected = torch.autograd.grad(top_score(out["logits"]), [out[t] for t in taps])
    torch.testing.assert_close(feats["layer1.0.bn1"], out["layer1.0.bn1"])
    for name, grad in zip(taps, expected):
        torch.testing.assert_close(feats.grads[name], grad)

    # Reference 2: on the model itself FX hands back the tensor after the in-place ReLU; the gradient with
    # respect to that changed value, through the ReLU's mask, is the gradient with respect to the captured one.
    fx_inplace = create_feature_extractor(resnet18, {"layer1.0.bn1": "bn1", "fc": "logits"})
    out = fx_inplace(images)
    assert (out["bn1"] >= 0).all(), "FX returns the tensor the ReLU changed"
    (after_relu,) = torch.autograd.grad(top_score(out["logits"]), [out["bn1"]])
    torch.testing.assert_close(feats.grads["layer1.0.bn1"], after_relu * (feats["layer1.0.bn1"] > 0))
    assert not torch.equal(feats.grads["layer1.0.bn1"], after_relu)


def test_conv_taps_before_inplace_relu_match_a_hand_written_forward(images: torch.Tensor) -> None:
    torch.manual_seed(0)
    features = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True)
    )
    head = nn.Linear(8, 5)
    net = nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten(), head)
    with fh.capture(net, ["0.0", "0.2", "0.3"], grads=True) as feats:
        top_score(net(images)).backward()
    conv0 = features[0](images)  # by hand, nothing in place
    conv2 = features[2](torch.relu(conv0))
    relu3 = torch.relu(conv2)
    logits = head(relu3.mean(dim=(2, 3)))
    expected = torch.autograd.grad(top_score(logits), [conv0, conv2, relu3])
    for name, value, grad in zip(["0.0", "0.2", "0.3"], [conv0, conv2, relu3], expected):
        torch.testing.assert_close(feats[name], value)
        torch.testing.assert_close(feats.grads[name], grad)


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        y = self.conv(x)
        return y, {"pooled": y.mean(dim=(2, 3)), "unused": y * 2, "index": y.argmax(dim=1), "count": 3}


class UsesStructured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Structured()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, extra = self.block(x)
        return y.sum() * 2 + extra["pooled"].sum() * 3


def test_structured_outputs_get_gradients_of_the_same_structure(images: torch.Tensor) -> None:
    net = UsesStructured()
    with fh.capture(net, ["block"], grads=True) as feats:
        net(images).backward()
    y, extra = feats["block"]
    grad_y, grad_extra = feats.grads["block"]
    assert set(grad_extra) == set(extra)
    torch.testing.assert_close(grad_y, torch.full_like(y, 2.0 + 3.0 / (y.shape[-2] * y.shape[-1])))
    torch.testing.assert_close(grad_extra["pooled"], torch.full_like(extra["pooled"], 3.0))
    assert grad_extra["unused"] is None and grad_extra["index"] is None, "no gradient reached them"
    assert grad_extra["count"] == 3, "non-tensor leaves are kept"


def test_gradients_before_backward_and_from_the_latest_forward_only(images: torch.Tensor) -> None:
    net = UsesStructured()
    with fh.capture(net, ["block.conv"], grads=True) as feats:
        first = net(images)
        assert list(feats.grads) == ["block.conv"] and feats.grads["block.conv"] is None
        second = net(images * 0.5)
        first.backward()
        assert feats.grads["block.conv"] is None, "the mapping shows the second forward"
        second.backward()
    assert feats.grads["block.conv"] is not None
    with torch.no_grad(), fh.capture(net, ["block.conv"], grads=True) as feats:
        net(images)
    assert feats.grads["block.conv"] is None, "no graph, no gradient"


def test_backward_after_the_block_fills_the_gradients(images: torch.Tensor) -> None:
    net = UsesStructured()
    with fh.capture(net, ["block.conv"], grads=True) as feats:
        loss = net(images)
    loss.backward()
    conv = feats["block.conv"]
    torch.testing.assert_close(feats.grads["block.conv"], torch.full_like(conv, 2.0 + 3.0 / conv[0, 0].numel()))


def test_an_input_passed_through_gets_its_gradient_and_keeps_no_hook(images: torch.Tensor) -> None:
    net = nn.Sequential(nn.Identity(), nn.Conv2d(3, 2, 3))
    x = images.clone().requires_grad_(True)
    with fh.capture(net, ["0"], grads=True) as feats:
        net(x).sum().backward()
        net(x).sum().backward()  # a second forward releases the first one's hook
        assert len(x._backward_hooks) == 1
    torch.testing.assert_close(feats.grads["0"], x.grad / 2)
    assert not x._backward_hooks, "a hook on a leaf would outlive the block"


def test_view_changed_in_place_later_has_no_gradient(images: torch.Tensor) -> None:
    """Documented limitation: autograd routes the gradient around a view changed in place."""

    class Half(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :2]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.front = nn.Conv2d(3, 4, 1), Half()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            self.front(y).mul_(2)
            return y.sum()

    net = Net()
    with fh.capture(net, ["front"], grads=True) as feats:
        net(images).backward()
    assert feats.grads["front"] is None


def test_nothing_is_left_after_the_block_also_after_an_exception(resnet18: nn.Module, images: torch.Tensor) -> None:
    with pytest.raises(RuntimeError, match="boom"), fh.capture(resnet18, ["layer4"], grads=True):
        resnet18(images)
        raise RuntimeError("boom")
    assert hooks(resnet18) == 0

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside the forward")

    net = nn.Sequential(nn.Identity(), Fails())
    x = images.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="inside the forward"), fh.capture(net, ["0"], grads=True):
        net(x)
    assert hooks(net) == 0 and not x._backward_hooks

    # The graph, the features and the gradients are freed once nothing refers to them.
    with fh.capture(resnet18, ["layer4"], grads=True) as feats:
        score = top_score(resnet18(images))
    score.backward()
    activation, grad = weakref.ref(feats["layer4"]), weakref.ref(feats.grads["layer4"])
    del feats, score
    gc.collect()
    assert activation() is None and grad() is None
    assert hooks(resnet18) == 0
    resnet18.zero_grad(set_to_none=True)


def test_works_twice_in_a_row(resnet18: nn.Module, images: torch.Tensor) -> None:
    results = []
    for _ in range(2):
        with fh.capture(resnet18, {"layer4": "maps"}, grads=True) as feats:
            top_score(resnet18(images)).backward()
        assert hooks(resnet18) == 0
        results.append(feats.grads["maps"])
    assert torch.equal(results[0], results[1])
    resnet18.zero_grad(set_to_none=True)


def test_each_thread_reads_the_gradients_of_its_own_forward(images: torch.Tensor) -> None:
    net = UsesStructured()
    seen: dict[int, torch.Tensor] = {}
    with fh.capture(net, ["block.conv"], grads=True) as feats:

        def work(scale: float) -> None:
            (net(images) * scale).backward()
            seen[int(scale)] = feats.grads["block.conv"]

        threads = [threading.Thread(target=work, args=(float(s),)) for s in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    torch.testing.assert_close(seen[2], seen[1] * 2)


def test_bad_requests() -> None:
    net = UsesStructured()
    with (
        pytest.raises(fh.InvalidValueError, match="grads=True needs mode='grad'"),
        fh.capture(net, ["block"], mode="detach", grads=True),
    ):
        pass
    assert hooks(net) == 0
    with (
        pytest.raises(fh.InvalidTypeError, match="grads must be True or False"),
        fh.capture(
            net,
            ["block"],
            grads="yes",  # type: ignore[arg-type]
        ),
    ):
        pass
    with fh.capture(net, ["block"]) as feats:
        pass
    with pytest.raises(fh.InvalidValueError, match="grads=True"):
        feats.grads  # noqa: B018
