"""Masked losses (issue 43): inside a mask, every loss class equals a masked loss written by hand (the mask resized
to each layer's grid by area average, as documented) in value and input gradient, under both normalizations; an
all-ones mask gives the unmasked loss bitwise, an all-zeros one 0 with a warning; bad masks are refused in one line;
per-layer terms sum to the total; the cosine distance equals one written by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import featurehooks.losses as fl
from featurehooks import FeatureExtractor
from featurehooks.errors import InvalidTypeError, InvalidValueError
from featurehooks.metrics import DISTS, LPIPS

from helpers import tiny_extractor

NORMALIZATIONS = ("mask", "image")
MASKS = ("binary", "soft")
LAYERS = ("relu1", "conv2")  # grids of 15x15 and 13x13 on a 32x32 image: cells straddle the mask's edges
WEIGHTS = (0.5, 2.0)
Loss = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module")
def ext() -> FeatureExtractor:
    return tiny_extractor(LAYERS, mode="grad")


@pytest.fixture(scope="module")
def images() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.rand(2, 3, 32, 32, generator=generator), torch.rand(2, 3, 32, 32, generator=generator)


def make_mask(kind: str, size: tuple[int, int] = (32, 32)) -> torch.Tensor:
    """Two different holes (binary), or seeded weights in [0, 1] (soft)."""
    if kind == "soft":
        return torch.rand(2, 1, *size, generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(2, 1, *size)
    mask[0, :, 4:20, 6:30] = 1
    mask[1, :, 10:, :12] = 1
    return mask


@pytest.fixture(scope="module")
def dists() -> DISTS:
    """DISTS on random VGG16 weights, with seeded alpha and beta (the calibration's arithmetic, offline); each test
    sets the ``mask_normalization`` it needs."""
    generator = torch.Generator().manual_seed(11)
    alpha_beta = {key: torch.rand(1475, generator=generator) for key in ("alpha", "beta")}
    return DISTS(weights=None, alpha_beta=alpha_beta, reduction="none")


# -------------------------------------------------------------------------------------------- by hand


def on_grid(mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The documented rule, in its other spelling: each cell's area average of the mask."""
    return F.interpolate(mask, size=tuple(features.shape[-2:]), mode="area")


def hand_mean(values: torch.Tensor, mask: torch.Tensor, normalization: str) -> torch.Tensor:
    """``(B, K, h, w)`` values weighted by a ``(B, 1, h, w)`` mask: ``sum(v m) / (K sum m)``, or ``/ (K h w)``."""
    weighted = (values * mask).sum(dim=(1, 2, 3))
    positions = mask.sum(dim=(1, 2, 3)) if normalization == "mask" else mask[0].numel()
    return weighted / (values.shape[1] * positions)


def hand_distance(a: torch.Tensor, b: torch.Tensor, distance: str) -> torch.Tensor:
    if distance == "cosine":
        dot = (a * b).sum(dim=1, keepdim=True)
        return 1 - dot / (a.norm(dim=1, keepdim=True) * b.norm(dim=1, keepdim=True)).clamp_min(1e-8)
    return (a - b).abs() if distance == "l1" else (a - b) ** 2


def hand_gram(features: torch.Tensor, mask: torch.Tensor, gram: str, normalization: str) -> torch.Tensor:
    batch, channels, height, width = features.shape
    flat = (features * mask).reshape(batch, channels, -1)
    raw = flat @ flat.transpose(1, 2)
    if gram == "none":
        return raw
    positions = mask.sum(dim=(1, 2, 3)).view(-1, 1, 1) if normalization == "mask" else height * width
    return raw / positions / (channels if gram == "chw" else 1)


def value_and_grad(loss: Loss, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.clone().requires_grad_(True)
    value = loss(leaf)
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    return value.detach(), grad


def assert_same_value_and_grad(ours: Loss, expected: Loss, x: torch.Tensor) -> None:
    value, grad = value_and_grad(ours, x)
    expected_value, expected_grad = value_and_grad(expected, x)
    assert expected_value.abs().min() > 0
    torch.testing.assert_close(value, expected_value, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------- each class against hand


@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("distance", ["mse", "l1", "cosine"])
def test_perceptual_equals_a_masked_loss_by_hand(ext, images, distance: str, normalization: str, kind: str) -> None:
    x, y = images
    mask = make_mask(kind)
    loss = fl.PerceptualLoss(
        ext, LAYERS, layer_weights=WEIGHTS, distance=distance, mask_normalization=normalization, reduction="none"
    )

    def by_hand(leaf: torch.Tensor) -> torch.Tensor:
        fx, fy = ext(leaf), ext(y)
        terms = [
            weight * hand_mean(hand_distance(fx[name], fy[name], distance), on_grid(mask, fx[name]), normalization)
            for name, weight in zip(LAYERS, WEIGHTS)
        ]
        return terms[0] + terms[1]

    assert_same_value_and_grad(lambda leaf: loss(leaf, y, mask=mask), by_hand, x)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("gram", ["chw", "hw", "none"])
def test_style_equals_masked_grams_by_hand(ext, images, gram: str, normalization: str) -> None:
    x, y = images
    mask = make_mask("binary")
    loss = fl.StyleLoss(
        ext, LAYERS, layer_weights=WEIGHTS, gram_normalization=gram, mask_normalization=normalization, reduction="sum"
    )

    def by_hand(leaf: torch.Tensor) -> torch.Tensor:
        fx, fy = ext(leaf), ext(y)
        total = torch.zeros(())
        for name, weight in zip(LAYERS, WEIGHTS):
            grid = on_grid(mask, fx[name])
            difference = hand_gram(fx[name], grid, gram, normalization) - hand_gram(fy[name], grid, gram, normalization)
            total = total + weight * difference.pow(2).mean(dim=(1, 2)).sum()
        return total

    assert_same_value_and_grad(lambda leaf: loss(leaf, y, mask=mask), by_hand, x)


def test_style_fixed_target_keeps_the_grams_of_its_own_mask(ext, images) -> None:
    """A style image of another size, masked by its own mask once (set_target), against masked input Grams."""
    x, _ = images
    style = torch.rand(1, 3, 40, 36, generator=torch.Generator().manual_seed(2))
    style_mask = torch.zeros(1, 1, 40, 36)
    style_mask[..., 5:30, 3:] = 1
    mask = make_mask("soft")
    loss = fl.StyleLoss(ext, LAYERS)
    loss.set_target(style, mask=style_mask)

    def by_hand(leaf: torch.Tensor) -> torch.Tensor:
        fx, fs = ext(leaf), ext(style)
        total = torch.zeros(())
        for name in LAYERS:
            target = hand_gram(fs[name], on_grid(style_mask, fs[name]), "chw", "mask")
            total = total + (hand_gram(fx[name], on_grid(mask, fx[name]), "chw", "mask") - target).pow(2).mean()
        return total

    assert_same_value_and_grad(lambda leaf: loss(leaf, mask=mask), by_hand, x)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_feature_matching_equals_a_masked_loss_by_hand(normalization: str) -> None:
    """Two discriminators (one with a channels-last layer) share one mask in image coordinates."""
    generator = torch.Generator().manual_seed(4)
    fake = [
        {"a": torch.randn(2, 4, 16, 16, generator=generator), "b": torch.randn(2, 5, 7, 9, generator=generator)},
        {"a": torch.randn(2, 4, 8, 8, generator=generator), "b": torch.randn(2, 6, 3, 5, generator=generator)},
    ]
    real = [{name: torch.randn(value.shape, generator=generator) for name, value in scale.items()} for scale in fake]
    for scale in (fake, real):  # "b" comes channels last (as Swin gives its maps)
        for features in scale:
            features["b"] = features["b"].permute(0, 2, 3, 1)
    mask = make_mask("soft")
    loss = fl.FeatureMatchingLoss({"a": 1.0, "b": 0.5}, layout={"b": "NHWC"}, mask_normalization=normalization)
    leaves = [{name: value.clone().requires_grad_(True) for name, value in scale.items()} for scale in fake]
    value = loss(leaves, real, mask=mask)
    (grad,) = torch.autograd.grad(value, [leaves[1]["b"]])

    def hand(scale: int, name: str, leaf: torch.Tensor) -> torch.Tensor:
        a, b = leaf, real[scale][name]
        if name == "b":
            a, b = a.permute(0, 3, 1, 2), b.permute(0, 3, 1, 2)
        return hand_mean((a - b).abs(), on_grid(mask, a), normalization)

    hand_leaf = leaves[1]["b"].detach().clone().requires_grad_(True)
    per_scale = [hand(s, "a", fake[s]["a"]) + 0.5 * hand(s, "b", fake[s]["b"] if s == 0 else hand_leaf) for s in (0, 1)]
    expected = ((per_scale[0] + per_scale[1]) / 2).mean()
    (expected_grad,) = torch.autograd.grad(expected, [hand_leaf])
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_lpips_equals_a_masked_lpips_by_hand(images, normalization: str) -> None:
    x, y = images
    x, y = F.interpolate(x, size=48), F.interpolate(y, size=48)  # AlexNet needs 31 pixels a side
    mask = make_mask("binary", (48, 48))
    metric = LPIPS("alex", weights=None, reduction="none", mask_normalization=normalization)

    def by_hand(leaf: torch.Tensor) -> torch.Tensor:
        fx, fy = metric.extractor(leaf), metric.extractor(y)
        total = torch.zeros(2)
        for name in metric.layers:
            a, b = (f * torch.rsqrt(f.pow(2).sum(dim=1, keepdim=True) + 1e-10) for f in (fx[name], fy[name]))
            per_position = ((a - b) ** 2 * metric.head(name).view(1, -1, 1, 1)).sum(dim=1, keepdim=True)
            total = total + hand_mean(per_position, on_grid(mask, per_position), normalization)
        return total

    assert_same_value_and_grad(lambda leaf: metric(leaf, y, mask=mask), by_hand, x)


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_dists_equals_region_statistics_by_hand(dists, images, normalization: str) -> None:
    """DISTS of a region: every mean, variance and covariance weighted by the mask on the term's grid."""
    x, y = images
    mask = make_mask("binary")
    dists.mask_normalization = normalization
    alphas, betas = dists.alpha.split((3, 64, 128, 256, 512, 512)), dists.beta.split((3, 64, 128, 256, 512, 512))

    def by_hand(leaf: torch.Tensor) -> torch.Tensor:
        fx, fy = dists.extractor(leaf), dists.extractor(y)
        pairs = [(leaf, y)] + [(fx[name], fy[name]) for name in ("relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3")]
        similarity = torch.zeros(2)
        for (a, b), alpha, beta in zip(pairs, alphas, betas):
            grid = on_grid(mask, a)
            area = grid.sum(dim=(2, 3))

            def mean(values: torch.Tensor, grid: torch.Tensor = grid, area: torch.Tensor = area) -> torch.Tensor:
                return (values * grid).sum(dim=(2, 3)) / area

            mu_a, mu_b = mean(a), mean(b)
            var_a, var_b = mean((a - mu_a[..., None, None]) ** 2), mean((b - mu_b[..., None, None]) ** 2)
            cov = mean((a - mu_a[..., None, None]) * (b - mu_b[..., None, None]))
            structure = 1 - (2 * mu_a * mu_b + 1e-6) / (mu_a**2 + mu_b**2 + 1e-6)
            texture = 1 - (2 * cov + 1e-6) / (var_a + var_b + 1e-6)
            coverage = grid.mean(dim=(2, 3)) if normalization == "image" else 1.0
            similarity = similarity + ((alpha * structure + beta * texture) * coverage).sum(dim=1)
        return similarity

    value, grad = value_and_grad(lambda leaf: dists(leaf, y, mask=mask), x)
    expected_value, expected_grad = value_and_grad(by_hand, x)
    torch.testing.assert_close(value, expected_value, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-3, atol=1e-7)


# ----------------------------------------------------------------------------- all ones, all zeros, where


def every_loss(ext: FeatureExtractor, dists: DISTS, normalization: str) -> dict[str, Callable[..., torch.Tensor]]:
    """Each loss class as ``f(x, y, **call)`` under ``normalization``, on 32x32 images (48x48 for AlexNet)."""
    lpips = LPIPS("squeeze", weights=None, reduction="none", mask_normalization=normalization)
    perceptual = fl.PerceptualLoss(ext, LAYERS, mask_normalization=normalization, reduction="none")
    cosine = fl.PerceptualLoss(ext, LAYERS, distance="cosine", mask_normalization=normalization, reduction="none")
    style = fl.StyleLoss(ext, LAYERS, mask_normalization=normalization, reduction="none")
    matching = fl.FeatureMatchingLoss(mask_normalization=normalization, reduction="none")

    def with_dists(x: torch.Tensor, y: torch.Tensor, **call: torch.Tensor) -> torch.Tensor:
        dists.mask_normalization = normalization
        return dists(x, y, **call)

    return {
        "perceptual": perceptual,
        "cosine": cosine,
        "style": style,
        "matching": lambda x, y, **call: matching(ext(x), ext(y), **call),
        "lpips": lpips,
        "dists": with_dists,
    }


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_an_all_ones_mask_is_the_unmasked_loss_bitwise(ext, dists, images, normalization: str) -> None:
    x, y = images
    for name, loss in every_loss(ext, dists, normalization).items():
        for mask in (torch.ones(2, 1, 32, 32), torch.ones(1, 1, 32, 32, dtype=torch.bool)):
            value, grad = value_and_grad(lambda leaf: loss(leaf, y), x)  # noqa: B023
            masked_value, masked_grad = value_and_grad(lambda leaf: loss(leaf, y, mask=mask), x)  # noqa: B023
            assert torch.equal(masked_value, value), name
            assert torch.equal(masked_grad, grad), name


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_an_all_zeros_mask_gives_zero_with_a_warning(ext, dists, images, normalization: str) -> None:
    x, y = images
    mask = make_mask("binary")
    mask[1] = 0  # the second sample has nothing to compare; the first keeps its hole
    for name, loss in every_loss(ext, dists, normalization).items():
        with pytest.warns(UserWarning, match=r"the mask of sample\(s\) \[1\] is all zeros"):
            value, grad = value_and_grad(lambda leaf: loss(leaf, y, mask=mask), x)  # noqa: B023
        assert value[1] == 0 and value[0] > 0, name
        assert torch.isfinite(grad).all() and grad[1].abs().max() == 0 and grad[0].abs().max() > 0, name


def test_gradients_reach_only_the_masked_pixels() -> None:
    """Through 1x1 convolutions a pixel feeds its own position only: outside the mask the gradient is exactly 0."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Tanh(), nn.Conv2d(8, 8, 1))
    pointwise = FeatureExtractor(net, ["1", "2"], mode="grad", normalize=False)
    x, y, mask = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16), make_mask("binary", (16, 16))
    mask[0, :, 2:5, 2:5] = 0.5
    for loss in (fl.PerceptualLoss(pointwise, distance="cosine"), fl.StyleLoss(pointwise)):
        _, grad = value_and_grad(lambda leaf: loss(leaf, y, mask=mask), x)  # noqa: B023
        inside = (mask > 0).expand_as(grad)
        assert grad[~inside].abs().max() == 0
        assert (grad[inside] != 0).float().mean() > 0.99


def test_vit_patch_tokens_take_a_mask_as_maps_and_refuse_it_as_tokens(images) -> None:
    """Patch tokens laid out as maps (output_format="nchw") are a grid like any other; (B, L, C) tokens are not."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    vit = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    x, y = images
    mask = make_mask("binary")
    maps = FeatureExtractor(vit.eval(), ["blocks.1"], weights=None, mode="grad", output_format="nchw")
    a, b = maps(x)["blocks.1"], maps(y)["blocks.1"]  # (2, 32, 4, 4): the 8-pixel patches' grid, class token left out
    expected = hand_mean(hand_distance(a, b, "cosine"), on_grid(mask, a), "mask")
    torch.testing.assert_close(fl.PerceptualLoss(maps, distance="cosine", reduction="none")(x, y, mask=mask), expected)
    tokens = FeatureExtractor(vit, ["blocks.1"], weights=None, mode="grad")
    with pytest.raises(InvalidValueError, match=r"layer 'blocks.1' gives .* \(2, 32, 17\).* output_format='nchw'"):
        fl.PerceptualLoss(tokens)(x, y, mask=mask)


# ---------------------------------------------------------------------------------------- terms, cosine


def test_per_layer_terms_sum_to_the_total_and_the_default_is_one_tensor(ext, images) -> None:
    x, y = images
    mask = make_mask("soft")
    for loss in (
        fl.PerceptualLoss(ext, LAYERS, layer_weights=WEIGHTS),
        fl.StyleLoss(ext, LAYERS, layer_weights=WEIGHTS, reduction="sum"),
        fl.PerceptualLoss(ext, LAYERS, layer_weights=WEIGHTS, distance="fro"),  # one norm over the batch per layer
    ):
        assert isinstance(loss(x, y), torch.Tensor) and loss(x, y).shape == ()
        total, terms = loss(x, y, return_layers=True)
        assert list(terms) == list(LAYERS)
        torch.testing.assert_close(terms["relu1"] + terms["conv2"], total)
        assert torch.equal(total, loss(x, y))
        for name, weight in zip(LAYERS, WEIGHTS):  # each term is that layer's loss, weighted
            alone = type(loss)(ext, [name], layer_weights=[weight], distance=loss.distance, reduction=loss.reduction)
            torch.testing.assert_close(terms[name], alone(x, y))
    masked = fl.PerceptualLoss(ext, LAYERS, layer_weights=WEIGHTS, reduction="none")
    total, terms = masked(x, y, mask=mask, return_layers=True)
    assert total.shape == terms["conv2"].shape == (2,)
    torch.testing.assert_close(terms["relu1"] + terms["conv2"], total)
    shared_total, shared_terms = masked.from_features(ext(x), ext(y), mask=mask, return_layers=True)
    assert torch.equal(shared_total, total) and all(torch.equal(shared_terms[k], terms[k]) for k in terms)


def test_feature_matching_and_dists_terms_sum_to_the_total(dists, images) -> None:
    x, y = images
    generator = torch.Generator().manual_seed(8)
    fake = [[torch.randn(2, 4, 8, 8, generator=generator)] * 2, [torch.randn(2, 4, 4, 4, generator=generator)] * 2]
    real = [[torch.randn(2, 4, 8, 8, generator=generator)] * 2, [torch.randn(2, 4, 4, 4, generator=generator)] * 2]
    total, terms = fl.FeatureMatchingLoss([1.0, 3.0])(fake, real, return_layers=True)
    assert list(terms) == ["0/0", "0/1", "1/0", "1/1"]
    torch.testing.assert_close(sum(terms.values()), total)
    torch.testing.assert_close(terms["0/1"], 3 * (fake[0][1] - real[0][1]).abs().mean() / 2)
    total, terms = dists(x, y, mask=make_mask("soft"), return_layers=True)
    assert list(terms) == ["image", "relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"]
    torch.testing.assert_close(sum(terms.values()), total)


def test_cosine_distance_equals_one_written_by_hand(ext, images) -> None:
    """One minus the cosine over channels at each position, averaged over positions, for maps and for tokens."""
    x, y = images
    fx, fy = ext(x), ext(y)
    loss = fl.PerceptualLoss(ext, LAYERS, layer_weights=WEIGHTS, distance="cosine", reduction="none")
    expected = sum(w * hand_distance(fx[n], fy[n], "cosine").mean(dim=(1, 2, 3)) for n, w in zip(LAYERS, WEIGHTS))
    torch.testing.assert_close(loss(x, y), expected)
    tokens_fake, tokens_real = (f["relu1"].flatten(2).transpose(1, 2) for f in (fx, fy))  # (B, L, C)
    matching = fl.FeatureMatchingLoss(distance="cosine", layout="NLC", reduction="none")
    by_hand = hand_distance(fx["relu1"].flatten(2), fy["relu1"].flatten(2), "cosine").mean(dim=(1, 2))
    torch.testing.assert_close(matching([tokens_fake], [tokens_real]), by_hand)


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("mask", "error", "message"),
    [
        (torch.ones(2, 32, 32), InvalidValueError, r"shape \(2 or 1, 1, 32, 32\).*add the channel axis"),
        (torch.ones(2, 3, 32, 32), InvalidValueError, r"must have shape \(2 or 1, 1, 32, 32\)"),
        (torch.ones(2, 1, 16, 16), InvalidValueError, r"\(the images' size\), got \(2, 1, 16, 16\)"),
        (torch.ones(3, 1, 32, 32), InvalidValueError, r"got \(3, 1, 32, 32\)"),
        (torch.full((2, 1, 32, 32), -0.5), InvalidValueError, r"weights in \[0, 1\]; it holds values in \[-0.5"),
        (torch.full((2, 1, 32, 32), 255.0), InvalidValueError, r"values in \[255, 255\]"),
        (torch.full((2, 1, 32, 32), float("nan")), InvalidValueError, r"no finite value and NaN"),
        (torch.ones(2, 1, 32, 32, dtype=torch.uint8), InvalidTypeError, r"not torch.uint8.*mask / 255.0"),
        ([[1.0]], InvalidTypeError, r"mask must be a Tensor"),
    ],
)
def test_bad_masks_are_refused_in_one_line(ext, dists, images, mask: object, error: type, message: str) -> None:
    x, y = images
    for name, loss in every_loss(ext, dists, "mask").items():
        if name == "matching":  # features: the images' size is not known, only the batch
            continue
        with pytest.raises(error, match=message) as caught:
            loss(x, y, mask=mask)
        assert "\n" not in str(caught.value), name


def test_masks_where_they_mean_nothing_are_refused(ext, images) -> None:
    x, y = images
    mask = make_mask("binary")
    with pytest.raises(InvalidValueError, match=r"distance='fro' is one norm over the whole batch"):
        fl.PerceptualLoss(ext, LAYERS, distance="fro")(x, y, mask=mask)
    with pytest.raises(InvalidValueError, match=r"target \(2, 3, 40, 40\) is not the input's size.*set_target"):
        fl.StyleLoss(ext, LAYERS)(x, torch.rand(2, 3, 40, 40), mask=mask)
    tokens = torch.rand(2, 16, 8)
    with pytest.raises(
        InvalidValueError, match=r"layer '0' gives features of shape \(2, 8, 16\).*without an \(h, w\) grid"
    ):
        fl.FeatureMatchingLoss(layout="NLC")([tokens], [tokens], mask=mask)
    with pytest.raises(InvalidValueError, match=r"spatial=True returns the distance map itself"):
        LPIPS("squeeze", weights=None, spatial=True)(x, y, mask=mask)
    with pytest.raises(InvalidValueError, match=r"mask_normalization must be 'mask' .* or 'image'"):
        fl.PerceptualLoss(ext, LAYERS, mask_normalization="area")  # type: ignore[arg-type]
