"""Loss modules: semantics, targets, shapes and errors, frozen backbone, one forward for several losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import featurehooks.losses as fl
from featurehooks import FeatureExtractor, capture
from featurehooks.functional import gram_matrix

LAYERS = ["relu1_2", "relu2_2", "relu3_3"]


@pytest.fixture(scope="module")
def ext() -> FeatureExtractor:
    """One seeded random-weight VGG16 extractor shared by the losses in this file (construction is the slow part)."""
    torch.manual_seed(0)
    return FeatureExtractor("vgg16", LAYERS, weights=None, mode="grad")


@pytest.fixture(scope="module")
def owned() -> fl.PerceptualLoss:
    """A loss that builds its own backbone by name."""
    torch.manual_seed(0)
    return fl.PerceptualLoss("vgg16", ["relu2_2"], weights=None)


@pytest.fixture
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.rand(2, 3, 32, 32, generator=generator), torch.rand(2, 3, 32, 32, generator=generator)


class ForwardCounter:
    """Counts backbone forwards by a pre-hook on its first module."""

    def __init__(self, extractor: FeatureExtractor) -> None:
        self.calls = 0
        first = next(m for m in extractor.backbone.modules() if isinstance(m, nn.Conv2d))
        self.handle = first.register_forward_pre_hook(self._count)

    def _count(self, *_: object) -> None:
        self.calls += 1

    def __enter__(self) -> ForwardCounter:
        return self

    def __exit__(self, *_: object) -> None:
        self.handle.remove()


# -- PerceptualLoss -------------------------------------------------------------------------------------


def test_perceptual_is_weighted_sum_of_per_layer_means(ext, pair) -> None:
    x, y = pair
    loss = fl.PerceptualLoss(
        ext, ["relu1_2", "relu3_3"], layer_weights={"relu1_2": 0.5, "relu3_3": 2.0}, reduction="none"
    )
    fx, fy = ext(x), ext(y)
    expected = 0.5 * ((fx["relu1_2"] - fy["relu1_2"]) ** 2).mean((1, 2, 3)) + 2.0 * (
        (fx["relu3_3"] - fy["relu3_3"]) ** 2
    ).mean((1, 2, 3))
    value = loss(x, y)
    assert value.shape == (2,)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(
        fl.PerceptualLoss(ext, ["relu1_2", "relu3_3"], layer_weights=[0.5, 2.0])(x, y), expected.mean()
    )
    sum_loss = fl.PerceptualLoss(ext, ["relu1_2", "relu3_3"], layer_weights=[0.5, 2.0], reduction="sum")
    torch.testing.assert_close(sum_loss(x, y), expected.sum())


def test_perceptual_distances_and_normalized_features(ext, pair) -> None:
    x, y = pair
    fx, fy = ext(x)["relu2_2"], ext(y)["relu2_2"]
    torch.testing.assert_close(
        fl.PerceptualLoss(ext, "relu2_2", distance="l1", reduction="none")(x, y), (fx - fy).abs().mean((1, 2, 3))
    )
    unit = fl.PerceptualLoss(ext, "relu2_2", normalize_features=True, reduction="none")(x, y)
    nx, ny = (f / f.pow(2).sum(1, keepdim=True).sqrt() for f in (fx, fy))
    torch.testing.assert_close(unit, ((nx - ny) ** 2).mean((1, 2, 3)))
    assert fl.PerceptualLoss(ext, "relu2_2", distance="cosine")(x, x) < 1e-6


def test_gradients_reach_the_input_and_not_the_backbone(owned, pair) -> None:
    x, y = pair
    x = x.clone().requires_grad_(True)
    owned(x, y).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is None and not p.requires_grad for p in owned.extractor.backbone.parameters())


def test_target_has_no_graph_unless_it_requires_grad(ext, pair) -> None:
    x, y = pair
    loss = fl.PerceptualLoss(ext, "relu2_2")
    assert all(not f.requires_grad for f in loss.target_features(y).values())
    y = y.clone().requires_grad_(True)
    assert all(f.requires_grad for f in loss.target_features(y).values())
    loss(x, y).backward()
    assert y.grad is not None and y.grad.abs().sum() > 0


def test_batch_one_target_broadcasts(ext, pair) -> None:
    x, y = pair
    loss = fl.PerceptualLoss(ext, ["relu1_2", "relu2_2"], reduction="none")
    torch.testing.assert_close(loss(x, y[:1]), loss(x, y[:1].expand(2, -1, -1, -1)))


@pytest.mark.parametrize(
    "target_shape", [(2, 3, 16, 16), (3, 3, 32, 32), (2, 1, 32, 32)], ids=["size", "batch", "channels"]
)
def test_mismatched_shapes_raise_before_the_forward(ext, pair, target_shape) -> None:
    loss = fl.PerceptualLoss(ext, "relu2_2")
    with ForwardCounter(ext) as counter, pytest.raises(ValueError, match="do not match"):
        loss(pair[0], torch.rand(target_shape))
    assert counter.calls == 0


def test_input_size_lets_different_sizes_meet(ext, pair) -> None:
    x, _ = pair
    loss = fl.PerceptualLoss(ext, "relu2_2", input_size=32)
    y = torch.nn.functional.interpolate(x, size=(48, 48), mode="bilinear", antialias=True)
    assert loss(x, y) < loss(x, torch.rand(2, 3, 48, 48))
    assert loss.features(y)["relu2_2"].shape[-2:] == (16, 16)


@pytest.mark.parametrize("build", [fl.PerceptualLoss, fl.StyleLoss])
def test_resize_is_the_old_spelling_of_input_size(ext, pair, build) -> None:
    x, y = pair
    new = build(ext, "relu2_2", input_size=24)
    with pytest.warns(FutureWarning, match="write input_size=") as warned:
        old = build(ext, "relu2_2", resize=24)
    assert len(warned) == 1 and warned[0].filename == __file__  # one warning, pointing at the caller
    assert old.input_size == (24, 24) and "input_size=(24, 24)" in repr(old)
    assert torch.equal(old(x, y), new(x, y))
    with pytest.warns(FutureWarning, match="loss.input_size"):
        assert old.resize == (24, 24)
    with pytest.raises(TypeError, match="both input_size= and resize= were given"):
        build(ext, "relu2_2", input_size=24, resize=24)


def test_a_subclass_may_still_pass_resize_to_the_base(ext, pair) -> None:
    class Means(fl.FeatureLoss):
        def __init__(self, **size: int) -> None:
            super().__init__(ext, ["relu1_2"], None, "l1", "mean", extractor_options={}, **size)  # type: ignore[arg-type]

        def statistic(self, features: torch.Tensor) -> torch.Tensor:
            return features.mean(dim=(2, 3))

    with pytest.warns(FutureWarning, match="input_size="):
        old = Means(resize=16)
    assert old.input_size == (16, 16) and torch.equal(old(*pair), Means(input_size=16)(*pair))


def test_loss_group_checks_targets_through_the_public_check(ext, pair) -> None:
    x, _ = pair
    content, style = fl.PerceptualLoss(ext, "relu2_2"), fl.StyleLoss(ext, "relu2_2")
    style.check_target(x, torch.rand(1, 3, 48, 48))  # a Gram is C x C whatever the size
    with pytest.raises(ValueError, match="do not match"):
        content.check_target(x, torch.rand(1, 3, 48, 48))
    group = fl.LossGroup({"content": content, "style": style})
    with ForwardCounter(ext) as counter, pytest.raises(ValueError, match="do not match"):
        group(x, torch.rand(1, 3, 48, 48))
    assert counter.calls == 0


def test_construction_errors(ext) -> None:
    with pytest.raises(ValueError, match="one per layer"):
        fl.PerceptualLoss(ext, ["relu1_2", "relu2_2"], layer_weights=[1.0])
    with pytest.raises(ValueError, match="no weight for"):
        fl.PerceptualLoss(ext, ["relu1_2", "relu2_2"], layer_weights={"relu1_2": 1.0})
    with pytest.raises(ValueError, match="not in layers"):
        fl.PerceptualLoss(ext, ["relu1_2"], layer_weights={"relu9_9": 1.0})
    with pytest.raises(ValueError, match="reduction"):
        fl.PerceptualLoss(ext, "relu1_2", reduction="avg")
    with pytest.raises(ValueError, match="distance"):
        fl.PerceptualLoss(ext, "relu1_2", distance="l3")
    with pytest.raises(ValueError, match="not computed by the shared FeatureExtractor"):
        fl.PerceptualLoss(ext, "relu4_3")
    with pytest.raises(ValueError, match="come from the shared FeatureExtractor"):
        fl.PerceptualLoss(ext, "relu1_2", input_range=(-1, 1))
    with pytest.raises(ValueError, match="input_size"):
        fl.PerceptualLoss(ext, "relu1_2", input_size=(0, 4))
    with pytest.raises(ValueError, match="needs a target"):
        fl.PerceptualLoss(ext, "relu1_2")(torch.rand(1, 3, 32, 32))
    detached = FeatureExtractor(tiny_backbone(), ["3"], mode="detach")
    with pytest.raises(ValueError, match="mode='grad'"):
        fl.PerceptualLoss(detached)


# -- frozen backbone in a training model ---------------------------------------------------------------


class Generator(nn.Module):
    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 3, 3, padding=1))
        self.loss = loss


def test_parent_train_state_dict_and_parameters_leave_the_backbone_alone(owned) -> None:
    model = Generator(owned)
    model.train()
    assert owned.training and not owned.extractor.backbone.training
    assert not any(m.training for m in owned.extractor.backbone.modules())
    assert all(key.startswith("net.") for key in model.state_dict())
    assert len(list(model.parameters())) == len(list(model.net.parameters()))
    assert list(owned.parameters()) == [] and owned.state_dict() == {}


def tiny_backbone() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())


def test_to_moves_the_backbone_and_keeps_fixed_targets_in_float32() -> None:
    local = FeatureExtractor(tiny_backbone(), ["3"], mode="grad")
    style = fl.StyleLoss(local, gram_normalization="none", target=torch.rand(1, 3, 32, 32))
    style.double()
    assert next(local.backbone.parameters()).dtype == torch.float64
    assert style._target[0].dtype == torch.float32
    assert torch.isfinite(style(torch.rand(1, 3, 32, 32, dtype=torch.float64)))


# -- StyleLoss ------------------------------------------------------------------------------------------


def test_style_is_mean_squared_gram_difference(ext, pair) -> None:
    x, y = pair
    loss = fl.StyleLoss(ext, ["relu1_2", "relu2_2"], layer_weights=[1.0, 3.0], reduction="none")
    fx, fy = ext(x), ext(y)
    expected = sum(
        w * ((gram_matrix(fx[k]) - gram_matrix(fy[k])) ** 2).mean((1, 2))
        for k, w in (("relu1_2", 1.0), ("relu2_2", 3.0))
    )
    torch.testing.assert_close(loss(x, y), expected)
    hw = fl.StyleLoss(ext, ["relu1_2"], gram_normalization="hw", distance="l1", reduction="none")(x, y)
    gx, gy = gram_matrix(fx["relu1_2"], "hw"), gram_matrix(fy["relu1_2"], "hw")
    torch.testing.assert_close(hw, (gx - gy).abs().mean((1, 2)))


def test_style_target_may_differ_in_size(ext, pair) -> None:
    x, _ = pair
    loss = fl.StyleLoss(ext, ["relu1_2", "relu2_2"])
    big = torch.rand(1, 3, 48, 40)
    assert torch.isfinite(loss(x, big))
    with pytest.raises(ValueError, match="channels"):
        loss(x, torch.rand(1, 1, 48, 48))


def test_fixed_style_grams_are_computed_once_and_kept_out_of_state_dict(ext, pair) -> None:
    x, _ = pair
    style = torch.rand(1, 3, 40, 40)
    per_call = fl.StyleLoss(ext, LAYERS)
    expected = per_call(x, style)
    fixed = fl.StyleLoss(ext, LAYERS, target=style)
    assert fixed.has_target
    with ForwardCounter(ext) as counter:
        first, second = fixed(x), fixed(x)
    assert counter.calls == 2  # the input only, once per call
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert fixed.state_dict() == {}
    with pytest.raises(ValueError, match="fixed target"):
        fixed(x, style)
    fixed.clear_target()
    with pytest.raises(ValueError, match="needs a target"):
        fixed(x)


# -- mixed precision and degenerate features -------------------------------------------------------------


def test_finite_losses_and_gradients_under_bf16_autocast(ext, pair) -> None:
    x, y = pair
    group = fl.LossGroup(
        {
            "perceptual": fl.PerceptualLoss(ext, LAYERS),
            "normalized": fl.PerceptualLoss(ext, LAYERS, normalize_features=True),
            "style": fl.StyleLoss(ext, LAYERS),
            "style_none": fl.StyleLoss(ext, LAYERS, gram_normalization="none"),
        }
    )
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ext(x[:1])["relu3_3"].dtype == torch.bfloat16  # the backbone really runs in bf16
        terms = group.terms(x, y)
    reference = group.terms(x.detach(), y)
    for name, value in terms.items():
        assert value.dtype == torch.float32 and torch.isfinite(value), name
        (grad,) = torch.autograd.grad(value, x, retain_graph=True)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        torch.testing.assert_close(value, reference[name], rtol=0.1, atol=0)


def test_all_zero_features_give_finite_losses_and_gradients() -> None:
    dead = nn.Sequential(nn.Conv2d(3, 8, 1))
    nn.init.zeros_(dead[0].weight)
    nn.init.zeros_(dead[0].bias)  # every feature vector is exactly zero
    ext = FeatureExtractor(dead, ["0"], mode="grad")
    x = torch.rand(2, 3, 8, 8, requires_grad=True)
    y = torch.rand(2, 3, 8, 8)
    losses = [
        fl.PerceptualLoss(ext, normalize_features=True),
        fl.StyleLoss(ext),
        fl.PerceptualLoss(ext, distance="cosine"),
    ]
    for loss in losses:
        value = loss(x, y)
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(x.grad).all(), loss


# -- one forward for several losses ---------------------------------------------------------------------


def test_loss_group_runs_the_backbone_once_per_image(ext, pair) -> None:
    x, y = pair
    content = fl.PerceptualLoss(ext, ["relu2_2"])
    style = fl.StyleLoss(ext, LAYERS)
    tv = fl.TotalVariationLoss()
    group = fl.LossGroup({"content": content, "style": style, "tv": tv}, weights={"style": 10.0, "tv": 0.1})
    x = x.clone().requires_grad_(True)
    with ForwardCounter(ext) as counter:
        terms = group.terms(x, y)
    assert counter.calls == 2  # one forward of the input, one of the target, for both losses
    torch.testing.assert_close(terms["content"], content(x, y))
    torch.testing.assert_close(terms["style"], 10.0 * style(x, y))
    torch.testing.assert_close(terms["tv"], 0.1 * tv(x))
    total = group(x, y)
    torch.testing.assert_close(total, sum(terms.values()))
    total.backward()
    assert x.grad.abs().sum() > 0


def test_loss_group_with_fixed_targets_needs_one_forward(ext, pair) -> None:
    x, y = pair
    content = fl.PerceptualLoss(ext, ["relu3_3"])
    content.set_target(y)
    style = fl.StyleLoss(ext, ["relu1_2", "relu2_2"], target=torch.rand(1, 3, 40, 40))
    group = fl.LossGroup({"content": content, "style": style})
    with ForwardCounter(ext) as counter:
        group(x)
    assert counter.calls == 1
    with pytest.raises(ValueError, match="no fixed target"):
        fl.LossGroup({"c": fl.PerceptualLoss(ext, "relu1_2")})(x)
    with pytest.raises(ValueError, match="share one reduction"):
        fl.LossGroup({"a": fl.PerceptualLoss(ext, "relu1_2"), "b": fl.StyleLoss(ext, reduction="none")})
    with pytest.raises(ValueError, match="not in the group"):
        fl.LossGroup({"a": content}, weights={"b": 1.0})


def test_from_features_equals_forward(ext, pair) -> None:
    x, y = pair
    content, style = fl.PerceptualLoss(ext, ["relu2_2"]), fl.StyleLoss(ext, LAYERS)
    fx, fy = ext(x), ext(y)  # one forward each, shared
    torch.testing.assert_close(content.from_features(fx, fy), content(x, y))
    torch.testing.assert_close(style.from_features(fx, fy), style(x, y))
    with pytest.raises(ValueError, match="lack layers"):
        content.from_features({"relu1_2": fx["relu1_2"]}, fy)


# -- FeatureMatchingLoss and total variation ---------------------------------------------------------------


def test_feature_matching_on_dicts_lists_and_multiscale() -> None:
    fake = {"a": torch.randn(2, 4, 8, 8, requires_grad=True), "b": torch.randn(2, 8, 4, 4, requires_grad=True)}
    real = {"a": torch.randn(2, 4, 8, 8, requires_grad=True), "b": torch.randn(2, 8, 4, 4, requires_grad=True)}
    loss = fl.FeatureMatchingLoss({"a": 1.0, "b": 0.5}, reduction="none")
    expected = (fake["a"] - real["a"]).abs().mean((1, 2, 3)) + 0.5 * (fake["b"] - real["b"]).abs().mean((1, 2, 3))
    value = loss(fake, real)
    torch.testing.assert_close(value, expected)
    torch.testing.assert_close(
        fl.FeatureMatchingLoss([1.0, 0.5])(list(fake.values()), list(real.values())), expected.mean()
    )
    value.sum().backward()
    assert fake["a"].grad is not None and real["a"].grad is None  # the real side is detached
    scale2_fake = [torch.randn(2, 4, 4, 4), torch.randn(2, 8, 2, 2)]
    scale2_real = [torch.randn(2, 4, 4, 4), torch.randn(2, 8, 2, 2)]
    multi = fl.FeatureMatchingLoss([1.0, 0.5], distance="mse")(
        [list(fake.values()), scale2_fake], [list(real.values()), scale2_real]
    )
    per_scale = [
        fl.FeatureMatchingLoss([1.0, 0.5], distance="mse")(f, r)
        for f, r in ((list(fake.values()), list(real.values())), (scale2_fake, scale2_real))
    ]
    torch.testing.assert_close(multi, (per_scale[0] + per_scale[1]) / 2)


def test_feature_matching_errors() -> None:
    a, b = torch.rand(2, 4, 8, 8), torch.rand(2, 4, 4, 4)
    loss = fl.FeatureMatchingLoss()
    with pytest.raises(ValueError, match="do not match"):
        loss([a], [b])
    with pytest.raises(ValueError, match="layers"):
        loss({"x": a}, {"y": a})
    with pytest.raises(ValueError, match="discriminators"):
        loss([[a]], [[a], [a]])
    with pytest.raises(TypeError, match="single Tensor"):
        loss(a, a)
    with pytest.raises(TypeError, match="by name"):
        fl.FeatureMatchingLoss({"0": 1.0})([a], [a])


def test_feature_matching_with_capture_on_a_discriminator() -> None:
    torch.manual_seed(0)
    disc = nn.Sequential(
        nn.Conv2d(3, 8, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(8, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 1, 3)
    )
    gen = nn.Conv2d(3, 3, 3, padding=1)
    real = torch.rand(2, 3, 16, 16)
    fake = gen(torch.rand(2, 3, 16, 16))
    with capture(disc, ["1", "3"]) as feats:
        disc(fake)
        fake_feats = dict(feats)
        disc(real)
        real_feats = dict(feats)
    loss = fl.FeatureMatchingLoss()(fake_feats, real_feats)
    loss.backward()
    assert list(fake_feats) == ["1", "3"] and torch.isfinite(loss) and loss > 0
    assert gen.weight.grad is not None and gen.weight.grad.abs().sum() > 0


def test_total_variation_loss_module() -> None:
    x = torch.rand(2, 3, 16, 16, requires_grad=True)
    loss = fl.TotalVariationLoss("l2", reduction="sum")
    value = loss(x)
    value.backward()
    dy, dx = x[:, :, 1:] - x[:, :, :-1], x[..., 1:] - x[..., :-1]
    torch.testing.assert_close(value, (dy.pow(2).mean((1, 2, 3)) + dx.pow(2).mean((1, 2, 3))).sum())
    assert torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="norm"):
        fl.TotalVariationLoss("tv")


# -- presets ---------------------------------------------------------------------------------------------


def test_johnson_preset_shares_one_vgg16_forward(pair) -> None:
    x, y = pair
    torch.manual_seed(0)
    group = fl.johnson2016(torch.rand(1, 3, 40, 40), weights=None)
    content, style = group.losses["content"], group.losses["style"]
    assert content.extractor is style.extractor and content.extractor.backbone_name == "vgg16"
    assert content.layers == ["relu2_2"] and style.layers == ["relu1_2", "relu2_2", "relu3_3", "relu4_3"]
    assert group.weights == {"content": 1e5, "style": 1e10} and style.has_target
    with ForwardCounter(content.extractor) as counter:
        value = group(x, y)
    assert counter.calls == 2 and torch.isfinite(value)


def test_pix2pixhd_and_lpips_presets_configuration() -> None:
    torch.manual_seed(0)
    vgg = fl.pix2pixhd(weights=None)
    assert vgg.extractor.backbone_name == "vgg19" and vgg.distance == "l1"
    assert vgg.layers == ["relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1"]
    assert vgg.layer_weights == [1 / 32, 1 / 16, 1 / 8, 1 / 4, 1.0]
    assert [row.channels for row in vgg.extractor.feature_info] == [64, 128, 256, 512, 512]
