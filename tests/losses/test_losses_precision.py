"""Losses on a ``precision="bf16"`` backbone: float32 values within 2% of float32's on photos, float32 gradients to
float32 images, the same direction; the option reaches the extractor through ``**extractor_options``; fp16's
gradients underflow as docs/performance.md says."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import featurehooks.losses as fl
from featurehooks import FeatureExtractor
from featurehooks.losses import FeatureLoss

from helpers import bf16_anywhere, degraded_photos, needs_cpu_bf16, tiny_extractor, value_and_grad

LAYERS = ["relu1_2", "relu2_2", "relu3_3"]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    return degraded_photos()


@pytest.fixture(scope="module")
def extractors() -> Callable[[str], FeatureExtractor]:
    """VGG16 extractors by precision, each built once when first asked for and shared by the losses (building VGG16
    costs more than these forwards)."""

    @functools.cache
    def build(precision: str) -> FeatureExtractor:
        torch.manual_seed(0)
        return FeatureExtractor("vgg16", LAYERS, mode="grad", weights=None, precision=precision)  # type: ignore[arg-type]

    return build


def build(kind: str, extractor: FeatureExtractor) -> FeatureLoss:
    if kind == "style":
        return fl.StyleLoss(extractor, LAYERS)
    return fl.PerceptualLoss(extractor, LAYERS, normalize_features=kind == "normalized")


@needs_cpu_bf16
@pytest.mark.parametrize("kind", ["perceptual", "normalized", "style"])
def test_bf16_losses_are_within_2_percent_of_float32(pair, extractors, kind: str) -> None:
    x, y = pair
    if kind == "style":  # style transfer: the style of other photos (a noisy copy has nearly the same Grams)
        y = y.flip(0)
    low, full = build(kind, extractors("bf16")), build(kind, extractors("float32"))
    assert low.extractor.compute_dtype == torch.bfloat16
    value, grad = value_and_grad(low, x, y)
    expected, expected_grad = value_and_grad(full, x, y)
    assert value.dtype == torch.float32 and grad.dtype == torch.float32
    assert abs(value.item() / expected.item() - 1) < 0.02, (value.item(), expected.item())
    assert torch.nn.functional.cosine_similarity(grad.flatten(), expected_grad.flatten(), dim=0) > 0.98


@bf16_anywhere
def test_the_option_is_forwarded_and_statistics_of_bf16_features_are_float32(pair) -> None:
    x, y = pair
    seen: list[torch.dtype] = []

    class ChannelMeans(FeatureLoss):
        def __init__(self) -> None:
            torch.manual_seed(0)
            net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
            super().__init__(
                net,
                ["2"],
                layer_weights=None,
                distance="l1",
                reduction="mean",
                input_size=None,
                extractor_options={"precision": "bf16"},  # what PerceptualLoss(..., precision=) forwards
            )

        def statistic(self, features: torch.Tensor) -> torch.Tensor:
            seen.append(features.dtype)
            return features.mean(dim=(2, 3))

    loss = ChannelMeans()
    assert loss.extractor.precision == "bf16" and "precision='bf16'" in repr(loss)
    loss.set_target(y)
    assert loss(x).dtype == torch.float32 and set(seen) == {torch.float32}


@needs_cpu_bf16
def test_real_esrgans_preset_runs_in_bf16(pair) -> None:
    """Real-ESRGAN's layers are the convolutions before each in-place ReLU: built and run in bf16 as in float32."""
    x, y = pair
    weights = {"conv1_2": 0.1, "conv2_2": 0.1, "conv3_4": 1.0, "conv4_4": 1.0, "conv5_4": 1.0}
    values = {}
    for precision in ("float32", "bf16"):
        torch.manual_seed(0)
        loss = fl.presets.basicsr(weights, weights=None, precision=precision)
        values[precision] = float(loss(x, y))
    assert values["bf16"] == pytest.approx(values["float32"], rel=2e-2)


@bf16_anywhere
@pytest.mark.parametrize("precision", ["float32", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_input_size_takes_half_precision_images(pair, precision: str, dtype: torch.dtype) -> None:
    """``input_size=`` resizes half-precision images in float32, as the extractor takes them (torch's antialiased
    resize has no half kernels on the CPU): the loss of the float32 copies, bitwise, gradients in their dtype."""
    x, y = (t[:, :, :40, :44] for t in pair)
    loss = fl.PerceptualLoss(tiny_extractor(mode="grad", precision=precision), ["relu1", "conv2"], input_size=32)
    half = x.to(dtype).requires_grad_()
    value = loss(half, y.to(dtype))
    assert torch.equal(value, loss(half.detach().float(), y.to(dtype).float()))
    value.backward()
    assert half.grad is not None and half.grad.dtype == dtype


def fp16_input_gradient(loss: FeatureLoss, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (loss(leaf, y) * scale).backward()
    assert leaf.grad is not None
    return leaf.grad.flatten() / scale


@pytest.mark.slow  # emulated float16 VGG16 steps (no CPU here has float16 kernels)
def test_fp16_gradients_underflow_unless_the_loss_is_scaled(pair, extractors, monkeypatch) -> None:
    """What docs/performance.md says of fp16 (emulated here, where the CPU has no float16 kernels: the device check
    is bypassed; the rounding is a GPU's): a perceptual loss's input gradients lose entries to float16's range, the
    loss times 2^10 brings them back; a Gram loss's are all 0."""
    monkeypatch.setattr("featurehooks._precision.unsupported", lambda *args: "")
    x, y = pair
    torch.manual_seed(0)
    fp16 = FeatureExtractor("vgg16", LAYERS[:2], mode="grad", weights=None, precision="fp16")  # emulated: slow
    perceptual, reference = fl.PerceptualLoss(fp16, ["relu2_2"]), fl.PerceptualLoss(extractors("float32"), ["relu2_2"])
    expected = fp16_input_gradient(reference, x, y, 1.0)
    plain, scaled = (fp16_input_gradient(perceptual, x, y, scale) for scale in (1.0, 2.0**10))
    cosine = torch.nn.functional.cosine_similarity
    zeros = [float((gradient == 0).float().mean()) for gradient in (expected, plain, scaled)]
    assert zeros[0] == 0 and zeros[1] > 0.01 and zeros[2] < zeros[1] / 100, zeros
    assert cosine(plain, expected, dim=0) < cosine(scaled, expected, dim=0) and cosine(scaled, expected, dim=0) > 0.999
    assert (fp16_input_gradient(fl.StyleLoss(fp16, LAYERS[:2]), x, y, 2.0**10) == 0).all()
