"""Losses on a ``precision="bf16"`` backbone: float32 values within 2% of float32's on photos, float32 gradients to
float32 images, the same direction; the option reaches the extractor through ``**extractor_options``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import featurehooks.losses as fl
from featurehooks import FeatureExtractor
from featurehooks.losses import FeatureLoss

from helpers import degraded_photos, needs_cpu_bf16, value_and_grad

pytestmark = needs_cpu_bf16

LAYERS = ["relu1_2", "relu2_2", "relu3_3"]


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    return degraded_photos()


@pytest.fixture(scope="module")
def extractors() -> dict[str, FeatureExtractor]:
    """One VGG16 extractor per precision, shared by the losses (building VGG16 costs more than these forwards)."""
    built = {}
    for precision in ("float32", "bf16"):
        torch.manual_seed(0)
        built[precision] = FeatureExtractor("vgg16", LAYERS, mode="grad", weights=None, precision=precision)
    return built


def build(kind: str, extractor: FeatureExtractor) -> FeatureLoss:
    if kind == "style":
        return fl.StyleLoss(extractor, LAYERS)
    return fl.PerceptualLoss(extractor, LAYERS, normalize_features=kind == "normalized")


@pytest.mark.parametrize("kind", ["perceptual", "normalized", "style"])
def test_bf16_losses_are_within_2_percent_of_float32(pair, extractors, kind: str) -> None:
    x, y = pair
    if kind == "style":  # style transfer: the style of other photos (a noisy copy has nearly the same Grams)
        y = y.flip(0)
    low, full = build(kind, extractors["bf16"]), build(kind, extractors["float32"])
    assert low.extractor.compute_dtype == torch.bfloat16
    value, grad = value_and_grad(low, x, y)
    expected, expected_grad = value_and_grad(full, x, y)
    assert value.dtype == torch.float32 and grad.dtype == torch.float32
    assert abs(value.item() / expected.item() - 1) < 0.02, (value.item(), expected.item())
    assert torch.nn.functional.cosine_similarity(grad.flatten(), expected_grad.flatten(), dim=0) > 0.98


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
                resize=None,
                extractor_options={"precision": "bf16"},  # what PerceptualLoss(..., precision=) forwards
            )

        def statistic(self, features: torch.Tensor) -> torch.Tensor:
            seen.append(features.dtype)
            return features.mean(dim=(2, 3))

    loss = ChannelMeans()
    assert loss.extractor.precision == "bf16" and "precision='bf16'" in repr(loss)
    loss.set_target(y)
    assert loss(x).dtype == torch.float32 and set(seen) == {torch.float32}
