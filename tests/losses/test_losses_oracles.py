"""Losses equal the reference implementations (piq, lpips) on the same seeded cached VGG16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import featurehooks as fh
import featurehooks.losses as fl
from featurehooks import FeatureExtractor

piq = pytest.importorskip("piq")
lpips = pytest.importorskip("lpips")

RTOL = 1e-5


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.rand(2, 3, 64, 64, generator=generator), torch.rand(2, 3, 64, 64, generator=generator)


@pytest.fixture(scope="module")
def vgg16_default(vgg16_cached: Path) -> FeatureExtractor:
    """The real weights="DEFAULT" path (IMAGENET1K_V1, read from the seeded cache), shared by the losses."""
    layers = ["relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"]
    return FeatureExtractor("vgg16", layers, weights="DEFAULT", mode="grad")


@pytest.mark.slow
def test_perceptual_times_channels_equals_piq_content_loss(vgg16_default, pair) -> None:
    x, y = pair
    ours = fl.PerceptualLoss(vgg16_default, layers=["relu3_3"], reduction="none")(x, y)
    reference = piq.ContentLoss(layers=("relu3_3",), reduction="none")(x, y)
    assert ours.shape == (2,)
    torch.testing.assert_close(ours * 256, reference, rtol=RTOL, atol=0)


@pytest.mark.slow
def test_perceptual_l1_on_two_layers_equals_piq(vgg16_default, pair) -> None:
    x, y = pair
    layers = ("relu2_2", "relu3_3")
    ours = fl.PerceptualLoss(
        vgg16_default, layers, layer_weights=[128 * 0.5, 256 * 2.0], distance="l1", reduction="none"
    )(x, y)
    reference = piq.ContentLoss(layers=layers, weights=[0.5, 2.0], distance="mae", reduction="none")(x, y)
    torch.testing.assert_close(ours, reference, rtol=RTOL, atol=0)


@pytest.mark.slow
def test_style_with_unnormalized_grams_equals_piq_style_loss(vgg16_default, pair) -> None:
    x, y = pair
    layers = ("relu1_2", "relu2_2", "relu3_3")
    ours = fl.StyleLoss(vgg16_default, layers, gram_normalization="none", reduction="none")(x, y)
    reference = piq.StyleLoss(layers=layers, weights=[1.0, 1.0, 1.0], reduction="none")(x, y)
    torch.testing.assert_close(ours, reference, rtol=RTOL, atol=0)
    mean = fl.StyleLoss(vgg16_default, layers, gram_normalization="none")(x, y)
    torch.testing.assert_close(mean, reference.mean(), rtol=RTOL, atol=0)


@pytest.mark.slow
def test_normalized_features_with_channel_weights_equal_lpips_baseline(vgg16_cached, pair) -> None:
    x, y = (2 * t - 1 for t in pair)  # LPIPS takes images in [-1, 1]
    ours = fl.PerceptualLoss(
        "vgg16",
        ["relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"],
        layer_weights=[64, 128, 256, 512, 512],
        normalize_features=True,
        input_range=(-1, 1),
        reduction="none",
    )
    reference = lpips.LPIPS(net="vgg", lpips=False, verbose=False)
    with torch.no_grad():
        expected = reference(x, y).flatten()
        torch.testing.assert_close(ours(x, y), expected, rtol=RTOL, atol=0)
        # featurehooks.LPIPS uncalibrated is the same number; with (0, 1) input the same images give the same value
        uncalibrated = fh.LPIPS(net="vgg", calibrated=False, reduction="none")
        torch.testing.assert_close(uncalibrated((x + 1) / 2, (y + 1) / 2), expected, rtol=RTOL, atol=0)
