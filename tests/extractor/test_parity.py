"""Parity by default: with every default, features and input gradients are bitwise those of the NCHW code a user
would write by hand (a truncated ``nn.Sequential``, a hand-written ResNet stem, torchvision FX, timm's
``forward_intermediates``) on the same weights; ``normalize=False`` hands the images over as they are; a
channels-last run without a graph stays within 1e-5 of scale, and a model that fails in channels-last
runs in NCHW, once, with the same results.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torchvision.models.feature_extraction import create_feature_extractor

import featurehooks as fh
from featurehooks.errors import InvalidTypeError, InvalidValueError

SEED = 0
# The smallest side every case takes (Inception v3 needs 75); the graph runs NCHW at any size.
SIDE = 80
# Large enough that "auto" runs VGG16 up to relu3_3 channels-last without a graph (each weight used 1756 times).
LARGE_SIDE = 128


def seeded(backbone: str, layers: list[str], **kwargs: object) -> fh.FeatureExtractor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return fh.FeatureExtractor(backbone, layers, weights=None, **kwargs)


def vgg_prefix(stop: int) -> Callable[[nn.Module], Callable[[Tensor], Tensor]]:
    """``model.features[:stop]``: how BasicSR, pix2pixHD and pytorch/examples truncate a VGG."""
    return lambda model: copy.deepcopy(model).features[:stop]


def resnet_to_layer3(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """A ResNet's forward written out by hand up to ``layer3``."""
    net = copy.deepcopy(model)
    return lambda x: net.layer3(net.layer2(net.layer1(net.maxpool(net.relu(net.bn1(net.conv1(x)))))))


def fx_node(node: str) -> Callable[[nn.Module], Callable[[Tensor], Tensor]]:
    """torchvision FX's extractor of one node, on a copy of the model."""

    def build(model: nn.Module) -> Callable[[Tensor], Tensor]:
        fx = create_feature_extractor(copy.deepcopy(model), [node])
        return lambda x: fx(x)[node]

    return build


def timm_stage(index: int) -> Callable[[nn.Module], Callable[[Tensor], Tensor]]:
    """timm's own ``forward_intermediates`` for one stage, stopping there."""

    def build(model: nn.Module) -> Callable[[Tensor], Tensor]:
        net = copy.deepcopy(model)
        return lambda x: net.forward_intermediates(x, indices=[index], intermediates_only=True, stop_early=True)[0]

    return build


CASES = {
    "vgg16 relu3_3": ("vgg16", "relu3_3", vgg_prefix(16)),
    "vgg19 relu5_4": ("vgg19", "relu5_4", vgg_prefix(36)),
    "resnet50 layer3": ("resnet50", "layer3", resnet_to_layer3),
    "inception_v3 Mixed_6e": ("inception_v3", "Mixed_6e", fx_node("Mixed_6e")),
    "timm resnet18d stage 3": ("timm/resnet18d", "layer3", timm_stage(3)),
}
# left out by make test-fast (VGG16's parity stays there through the perceptual loss's)
SLOW_CASES = ("vgg16 relu3_3", "vgg19 relu5_4", "inception_v3 Mixed_6e")


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case for case in CASES]
)
def test_default_grad_mode_gives_the_nchw_features_and_input_gradients_bitwise(case: str) -> None:
    backbone, layer, by_hand = CASES[case]
    extractor = seeded(backbone, [layer], mode="grad")
    reference = by_hand(extractor.backbone)
    images = torch.rand(2, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(SEED))
    ours_input, theirs_input = images.clone().requires_grad_(), images.clone().requires_grad_()
    ours = extractor(ours_input)[layer]
    theirs = reference(extractor.normalize(theirs_input))
    assert extractor.memory_format_in_use == "contiguous" and ours.is_contiguous()
    assert torch.equal(ours, theirs)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(SEED + 1))
    (ours_grad,) = torch.autograd.grad((ours * weights).sum(), ours_input)
    (theirs_grad,) = torch.autograd.grad((theirs * weights).sum(), theirs_input)
    assert torch.equal(ours_grad, theirs_grad)


def test_a_perceptual_loss_gives_the_gradients_of_the_nchw_loss_bitwise() -> None:
    loss_fn = fh.PerceptualLoss("vgg16", ["relu3_3"], weights=None)
    vgg = copy.deepcopy(loss_fn.extractor.backbone).features[:16]
    generator = torch.Generator().manual_seed(SEED)
    output, target = (
        torch.rand(2, 3, SIDE, SIDE, generator=generator),
        torch.rand(2, 3, SIDE, SIDE, generator=generator),
    )
    ours_input, theirs_input = output.clone().requires_grad_(), output.clone().requires_grad_()
    (ours,) = torch.autograd.grad(loss_fn(ours_input, target), ours_input)
    normalize = loss_fn.extractor.normalize
    with torch.no_grad():
        target_features = vgg(normalize(target))
    difference = (vgg(normalize(theirs_input)) - target_features).pow(2)
    (theirs,) = torch.autograd.grad(difference.reshape(2, -1).mean(dim=1).mean(), theirs_input)
    assert torch.equal(ours, theirs)


@pytest.mark.slow
def test_without_a_graph_channels_last_stays_within_float32_rounding_of_nchw() -> None:
    auto = seeded("vgg16", ["relu2_2", "relu3_3"])
    nchw = seeded("vgg16", ["relu2_2", "relu3_3"], memory_format="contiguous")
    images = torch.rand(4, 3, LARGE_SIDE, LARGE_SIDE, generator=torch.Generator().manual_seed(SEED))
    found, expected = auto(images), nchw(images)
    assert auto.memory_format_in_use == "channels_last"
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, rtol=0, atol=1e-5 * float(value.abs().max()))
    small = images[:1, :, :32, :32]
    assert all(torch.equal(auto(small)[k], nchw(small)[k]) for k in expected)  # too small to pay: NCHW
    assert auto.memory_format_in_use == "contiguous"


class GroupNormThenView(nn.Module):
    """Runs in NCHW; in channels-last, GroupNorm keeps the channels-last strides and the ``.view`` fails."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.head = nn.Linear(8 * 4 * 4, 2)

    def forward(self, x: Tensor) -> Tensor:
        pooled = self.pool(self.norm(self.conv(x)))
        return self.head(pooled.view(x.shape[0], -1))


def test_a_model_that_fails_in_channels_last_runs_in_nchw_with_the_same_results() -> None:
    torch.manual_seed(SEED)
    model = GroupNormThenView()
    images = torch.rand(2, 3, SIDE, SIDE)
    with pytest.raises(RuntimeError, match="view"):  # the model itself, handed channels-last images
        model(images.contiguous(memory_format=torch.channels_last))
    extractor = fh.FeatureExtractor(model, ["head"])
    assert extractor.memory_format_for(images.shape) == "contiguous"  # the meta check sees GroupNorm's strides
    expected = model(images)
    assert torch.equal(extractor(images)["head"], expected)
    assert extractor.memory_format_in_use == "contiguous"


@pytest.mark.slow
def test_normalize_false_feeds_the_images_as_they_are() -> None:
    raw = seeded("vgg19", ["relu1_1"], normalize=False, input_range=(-1, 1), mode="grad")  # NCHW: bitwise
    images = torch.rand(1, 3, 32, 32) * 2 - 1
    expected = copy.deepcopy(raw.backbone).features[:2](images)
    assert torch.equal(raw(images)["relu1_1"], expected)
    assert raw.preprocessing.mean is None and raw.preprocessing.std is None
    assert torch.equal(raw.normalize(images), images) and "normalize=False" in repr(raw)
    with pytest.raises(InvalidValueError, match="no mean or std"):
        fh.FeatureExtractor("vgg19", ["relu1_1"], weights=None, normalize=False, mean=(0.5,) * 3, std=(0.5,) * 3)
    with pytest.raises(InvalidTypeError, match="normalize must be"):
        fh.FeatureExtractor("vgg19", ["relu1_1"], weights=None, normalize="no")  # type: ignore[arg-type]


class UpAndConcat(nn.Module):
    """Runs in either format; a size the stride-2 branch cannot match fails in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2)
        self.c = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        a = self.a(x)
        return self.c(torch.cat([a, self.up(self.b(a))], 1))


def test_an_error_of_the_users_own_does_not_turn_channels_last_off() -> None:
    extractor = fh.FeatureExtractor(UpAndConcat(), ["c"])
    extractor(torch.rand(1, 3, 64, 64))
    assert extractor.memory_format_in_use == "channels_last"
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):  # the model's own error, in NCHW too
        extractor(torch.rand(1, 3, 63, 63))
    extractor(torch.rand(1, 3, 64, 64))
    assert extractor.memory_format_in_use == "channels_last"


def test_a_graph_runs_nchw_even_for_a_channels_last_model_and_channels_last_images() -> None:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    reference = copy.deepcopy(model)
    extractor = fh.FeatureExtractor(model.to(memory_format=torch.channels_last), ["2"], mode="grad")
    images = torch.rand(2, 3, SIDE, SIDE).contiguous(memory_format=torch.channels_last)
    ours_input, theirs_input = images.clone().requires_grad_(), images.contiguous().requires_grad_()
    ours, theirs = extractor(ours_input)["2"], reference(theirs_input)
    assert extractor.memory_format_in_use == "contiguous" and ours.is_contiguous() and torch.equal(ours, theirs)
    (ours_grad,) = torch.autograd.grad(ours.sum(), ours_input)
    (theirs_grad,) = torch.autograd.grad(theirs.sum(), theirs_input)
    assert ours_grad.is_contiguous(memory_format=torch.channels_last)  # the images' own layout
    assert torch.equal(ours_grad, theirs_grad)
