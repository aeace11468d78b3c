"""Presets: what each one builds, its defaults and its options (their values are pinned in test_porting.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from featurehooks.errors import InvalidValueError
from featurehooks.losses import presets

VGG19_STYLE_CHANNELS = (64, 128, 256, 512, 512)
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


@pytest.fixture(scope="module", autouse=True)
def cached(seeded_weights: Callable[..., Path]) -> None:
    seeded_weights("vgg19")
    seeded_weights("vgg16")


@pytest.mark.slow
def test_johnson2016_defaults_are_pytorch_examples() -> None:
    group = presets.johnson2016(torch.rand(1, 3, 40, 40), input_range=(0, 255))
    content, style = group.losses["content"], group.losses["style"]
    assert group.weights == {"content": 1e5, "style": 1e10}
    assert content.extractor is style.extractor and content.extractor.backbone_name == "vgg16"
    assert content.extractor.input_range == (0.0, 255.0)  # extractor options reach the shared extractor
    assert content.layers == ["relu2_2"] and style.layers == ["relu1_2", "relu2_2", "relu3_3", "relu4_3"]
    assert style.gram_normalization == "chw" and style.has_target and not content.has_target
    assert content.distance == style.distance == "mse"


def test_gatys2016_is_the_notebooks_formula() -> None:
    content_image, style_image = torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32)
    group = presets.gatys2016(content_image, style_image)
    content, style = group.losses["content"], group.losses["style"]
    assert group.weights == {"content": 1.0, "style": 1e3}
    assert content.extractor is style.extractor and content.extractor.backbone_name == "vgg19"
    assert content.layers == ["relu4_2"] and style.layers == ["relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1"]
    assert style.gram_normalization == "hw"
    assert style.layer_weights == pytest.approx([1 / c**2 for c in VGG19_STYLE_CHANNELS])
    assert content.has_target and style.has_target


def test_neural_style_tutorial_taps_convolutions() -> None:
    group = presets.neural_style_tutorial(torch.rand(1, 3, 32, 32), torch.rand(1, 3, 32, 32), style_weight=1e5)
    content, style = group.losses["content"], group.losses["style"]
    assert group.weights == {"content": 1.0, "style": 1e5}
    assert content.layers == ["conv2_2"] and style.layers == ["conv1_1", "conv1_2", "conv2_1", "conv2_2", "conv3_1"]
    assert [row.type for row in content.extractor.feature_info] == ["Conv2d"] * 5
    assert style.gram_normalization == "chw" and style.layer_weights == [1.0] * 5


def test_pix2pixhd_feeds_images_as_they_are() -> None:
    loss = presets.pix2pixhd(reduction="none")
    assert not loss.extractor.normalizes and loss.extractor.input_range == (-1.0, 1.0)
    assert loss.layers == list(presets.PIX2PIXHD_LAYERS) and loss.layer_weights == list(presets.PIX2PIXHD_WEIGHTS)
    assert loss.distance == "l1" and loss.reduction == "none"
    x = torch.rand(2, 3, 8, 8) * 2 - 1
    assert torch.equal(loss.extractor.normalize(x), x)
    normalized = presets.pix2pixhd(normalize=True)  # the user's choice wins
    assert normalized.extractor.normalizes and not torch.equal(normalized.extractor.normalize(x), x)


@pytest.mark.parametrize(
    ("config", "mapped"),
    [
        ({}, lambda x: (x - MEAN) / STD),
        ({"range_norm": True}, lambda x: ((x + 1) / 2 - MEAN) / STD),
        ({"use_input_norm": False}, lambda x: x),
        ({"use_input_norm": False, "range_norm": True}, lambda x: (x + 1) / 2),
    ],
    ids=["norm", "range_norm", "no_norm", "range_norm_only"],
)
def test_basicsr_input_modes(config: dict, mapped: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """use_input_norm / range_norm map to input_range, normalize and mean/std as BasicSR's forward does."""
    loss = presets.basicsr({"relu1_1": 1.0}, **config)
    x = torch.rand(2, 3, 8, 8) * 2 - 1 if config.get("range_norm") else torch.rand(2, 3, 8, 8)
    torch.testing.assert_close(loss.losses["perceptual"].extractor.normalize(x), mapped(x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_basicsr_terms_and_criteria() -> None:
    weights = {"conv5_4": 1.0, "conv1_2": 0.1}  # BasicSR keeps the dict's order
    group = presets.basicsr(weights, perceptual_weight=0.5, style_weight=50, criterion="l2")
    assert group.weights == {"perceptual": 0.5, "style": 50.0}
    perceptual, style = group.losses["perceptual"], group.losses["style"]
    assert perceptual.extractor is style.extractor and perceptual.extractor.backbone_name == "vgg19"
    assert perceptual.layers == style.layers == ["conv5_4", "conv1_2"]
    assert perceptual.layer_weights == style.layer_weights == [1.0, 0.1]
    assert perceptual.distance == style.distance == "mse" and style.gram_normalization == "chw"
    style_only = presets.basicsr({"relu2_1": 1.0}, vgg_type="vgg16", perceptual_weight=0, style_weight=1)
    assert list(style_only.losses) == ["style"] and style_only.losses["style"].extractor.backbone_name == "vgg16"
    assert list(presets.basicsr({"conv5_4": 1.0}, criterion="fro").losses) == ["perceptual"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"criterion": "l3"}, "criterion"),
        ({"perceptual_weight": 0}, "both 0"),
        ({"range_norm": True, "input_range": (0, 1)}, "input_range"),
        ({"use_input_norm": False, "normalize": True}, "normalize"),
    ],
)
def test_basicsr_refuses_contradictions(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        presets.basicsr({"conv5_4": 1.0}, **kwargs)


def test_dino_vits16_takes_resize_as_the_old_spelling_of_input_size() -> None:
    with pytest.raises(TypeError, match="both input_size= and resize= were given"):
        presets.dino_vits16(input_size=224, resize=None, weights=None)
    with pytest.warns(FutureWarning, match="write input_size="):
        loss = presets.dino_vits16(resize=(32, 48), weights=None)
    assert loss.input_size == (32, 48)


def test_presets_are_exported_from_their_module() -> None:
    for name in ("basicsr", "dino_vits16", "gatys2016", "johnson2016", "neural_style_tutorial", "pix2pixhd"):
        assert name in presets.__all__ and callable(getattr(presets, name))


@pytest.mark.parametrize(
    "build",
    [
        lambda: presets.johnson2016(weights=None, mode="detach"),
        lambda: presets.pix2pixhd(weights=None, mode="detach"),
        lambda: presets.basicsr({"conv1_2": 1.0}, weights=None, mode="detach"),
    ],
)
def test_presets_refuse_a_mode_clearly(build: Callable[[], object]) -> None:
    with pytest.raises(InvalidValueError, match="always runs in mode='grad'"):
        build()
