"""Porting recipes (docs/porting.md): featurehooks with its defaults against the formula of the code it ports.

Each reference below is written out from the client's published code (BasicSR, KAIR, pix2pixHD,
pytorch/examples, the PyTorch tutorial, Gatys's notebook) on plain torchvision VGG ``features``
with the client's own normalization, slicing, Gram and criterion, on the same seeded weights that
featurehooks reads. Values must agree to 1e-6 relative and input gradients to 1e-5 of their scale.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

import featurehooks as fh
from featurehooks.losses import presets

pytestmark = pytest.mark.slow  # a client's loss written out on seeded VGG16/VGG19, per recipe

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
VGG19_BLOCKS = (2, 2, 4, 4, 4)

REAL_ESRGAN = {"conv1_2": 0.1, "conv2_2": 0.1, "conv3_4": 1.0, "conv4_4": 1.0, "conv5_4": 1.0}
HIFACEGAN = {"relu1_1": 1 / 32, "relu2_1": 1 / 16, "relu3_1": 1 / 8, "relu4_1": 1 / 4, "relu5_1": 1.0}


# -- shared helpers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vgg19_file(seeded_weights: Callable[..., Path]) -> Path:
    return seeded_weights("vgg19")


@pytest.fixture(scope="module")
def vgg19(vgg19_file: Path) -> nn.Sequential:
    """torchvision's VGG19 ``features`` on the seeded IMAGENET1K_V1 file (as the clients load it)."""
    return torchvision.models.vgg19(weights="IMAGENET1K_V1").features.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def vgg16(vgg16_cached: Path) -> nn.Sequential:
    return torchvision.models.vgg16(weights="IMAGENET1K_V1").features.eval().requires_grad_(False)


def images(*shape: int, seed: int, low: float = 0.0, high: float = 1.0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return low + (high - low) * torch.rand(*shape, generator=generator)


def value_and_grad(loss: Callable[[Tensor], Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_(True)
    value = loss(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


def assert_parity(ours: Callable[[Tensor], Tensor], reference: Callable[[Tensor], Tensor], x: Tensor) -> None:
    """Values to 1e-6 relative, input gradients to 1e-5 of the reference gradient's largest entry."""
    value, grad = value_and_grad(ours, x)
    expected, expected_grad = value_and_grad(reference, x)
    assert value.shape == expected.shape == ()
    assert expected.abs() > 0 and expected_grad.abs().max() > 0
    assert torch.allclose(value, expected, rtol=1e-6, atol=0), (value.item(), expected.item())
    error = ((grad - expected_grad).abs().max() / expected_grad.abs().max()).item()
    assert error <= 1e-5, error


def vgg19_names() -> list[str]:
    """BasicSR's NAMES['vgg19']: conv/relu per convolution, a pool after each block."""
    names = []
    for block, convs in enumerate(VGG19_BLOCKS, start=1):
        for i in range(1, convs + 1):
            names += [f"conv{block}_{i}", f"relu{block}_{i}"]
        names.append(f"pool{block}")
    return names


# -- BasicSR (ESRGAN, Real-ESRGAN, GFPGAN, HiFaceGAN) ----------------------------------------------------


def basicsr_reference(
    features: nn.Sequential,
    layer_weights: dict[str, float],
    *,
    use_input_norm: bool = True,
    range_norm: bool = False,
    perceptual_weight: float = 1.0,
    style_weight: float = 0.0,
    criterion: str = "l1",
) -> Callable[[Tensor, Tensor], Tensor]:
    """basicsr/losses/basic_loss.py PerceptualLoss on basicsr/archs/vgg_arch.py VGGFeatureExtractor."""
    names = vgg19_names()
    last = max(names.index(name) for name in layer_weights)

    def extract(x: Tensor) -> dict[str, Tensor]:
        if range_norm:
            x = (x + 1) / 2
        if use_input_norm:
            x = (x - MEAN) / STD
        out = {}
        for name, layer in zip(names[: last + 1], features):
            x = layer(x)
            if name in layer_weights:
                out[name] = x.clone()
        return out

    def gram(x: Tensor) -> Tensor:
        n, c, h, w = x.size()
        flat = x.view(n, c, w * h)
        return flat.bmm(flat.transpose(1, 2)) / (c * h * w)

    def distance(a: Tensor, b: Tensor) -> Tensor:
        if criterion == "fro":
            return torch.norm(a - b, p="fro")
        return F.l1_loss(a, b) if criterion == "l1" else F.mse_loss(a, b)

    def loss(x: Tensor, gt: Tensor) -> Tensor:
        fx, fgt = extract(x), extract(gt.detach())
        total = torch.zeros(())
        if perceptual_weight > 0:
            total = total + perceptual_weight * sum(distance(fx[k], fgt[k]) * layer_weights[k] for k in fx)
        if style_weight > 0:
            total = total + style_weight * sum(distance(gram(fx[k]), gram(fgt[k])) * layer_weights[k] for k in fx)
        return total

    return loss


def test_esrgan(vgg19: nn.Sequential) -> None:
    """options/train/ESRGAN/train_ESRGAN_x4.yml: conv5_4 (before relu), weight 1, L1, ImageNet norm."""
    x, gt = images(2, 3, 32, 32, seed=1), images(2, 3, 32, 32, seed=2)
    reference = basicsr_reference(vgg19, {"conv5_4": 1.0})
    loss = fh.PerceptualLoss("vgg19", layer_weights={"conv5_4": 1.0}, distance="l1")
    assert_parity(lambda v: loss(v, gt), lambda v: reference(v, gt), x)


def test_real_esrgan(vgg19: nn.Sequential) -> None:
    """Real-ESRGAN options/train_realesrgan_x4plus.yml (and KAIR's SwinIR GAN): five conv taps, L1."""
    x, gt = images(2, 3, 32, 32, seed=3), images(2, 3, 32, 32, seed=4)
    reference = basicsr_reference(vgg19, REAL_ESRGAN)
    loss = fh.PerceptualLoss("vgg19", layer_weights=REAL_ESRGAN, distance="l1")
    assert_parity(lambda v: loss(v, gt), lambda v: reference(v, gt), x)


def _gfpgan_by_hand() -> fh.LossGroup:
    ext = fh.FeatureExtractor("vgg19", list(REAL_ESRGAN), mode="grad", input_range=(-1, 1))
    return fh.LossGroup(
        {
            "perceptual": fh.PerceptualLoss(ext, layer_weights=REAL_ESRGAN, distance="l1"),
            "style": fh.StyleLoss(ext, layer_weights=REAL_ESRGAN, distance="l1"),
        },
        weights={"style": 50.0},
    )


@pytest.mark.parametrize(
    "build",
    [lambda: presets.basicsr(REAL_ESRGAN, range_norm=True, style_weight=50), _gfpgan_by_hand],
    ids=["preset", "by_hand"],
)
def test_gfpgan_perceptual_and_style(vgg19: nn.Sequential, build: Callable[[], fh.LossGroup]) -> None:
    """GFPGAN options/train_gfpgan_v1.yml: images in [-1, 1] (range_norm), L1 on features and on Grams, style 50."""
    x, gt = images(2, 3, 32, 32, seed=5, low=-1), images(2, 3, 32, 32, seed=6, low=-1)
    reference = basicsr_reference(vgg19, REAL_ESRGAN, range_norm=True, style_weight=50.0)
    loss = build()
    assert_parity(lambda v: loss(v, gt), lambda v: reference(v, gt), x)
    style_only = basicsr_reference(vgg19, REAL_ESRGAN, range_norm=True, perceptual_weight=0.0, style_weight=50.0)
    torch.testing.assert_close(loss.terms(x, gt)["style"], style_only(x, gt), rtol=1e-6, atol=0)


def test_hifacegan(vgg19: nn.Sequential) -> None:
    """BasicSR options/train/HiFaceGAN/train_hifacegan.yml: relu taps, 1/32 ... 1, no input norm, weight 10."""
    x, gt = images(2, 3, 32, 32, seed=7), images(2, 3, 32, 32, seed=8)
    reference = basicsr_reference(vgg19, HIFACEGAN, use_input_norm=False, perceptual_weight=10.0)
    loss = fh.PerceptualLoss("vgg19", layer_weights=HIFACEGAN, distance="l1", normalize=False)
    assert_parity(lambda v: 10 * loss(v, gt), lambda v: reference(v, gt), x)
    preset = presets.basicsr(HIFACEGAN, use_input_norm=False, perceptual_weight=10.0)
    assert_parity(lambda v: preset(v, gt), lambda v: reference(v, gt), x)


@pytest.mark.parametrize(("use_input_norm", "range_norm"), [(False, True), (True, False)])
def test_basicsr_fro_criterion_and_input_modes(vgg19: nn.Sequential, use_input_norm: bool, range_norm: bool) -> None:
    """criterion: fro (one Frobenius norm of the batch's difference per layer) and the other input modes."""
    low = -1.0 if range_norm else 0.0
    x, gt = images(2, 3, 32, 32, seed=9, low=low), images(2, 3, 32, 32, seed=10, low=low)
    opts = {"use_input_norm": use_input_norm, "range_norm": range_norm, "criterion": "fro", "style_weight": 2.0}
    weights = {"conv2_2": 0.5, "relu3_1": 1.0}
    reference = basicsr_reference(vgg19, weights, **opts)  # type: ignore[arg-type]
    loss = presets.basicsr(weights, **opts)  # type: ignore[arg-type]
    assert_parity(lambda v: loss(v, gt), lambda v: reference(v, gt), x)


# -- KAIR / SwinIR ---------------------------------------------------------------------------------------


def kair_reference(
    features: nn.Sequential, feature_layer: int | list[int], weights: float | list[float]
) -> Callable[[Tensor, Tensor], Tensor]:
    """KAIR models/loss.py PerceptualLoss: vgg19.features cut after the given indices, L1, ImageNet norm."""
    if isinstance(feature_layer, list):
        bounds = [-1, *feature_layer]
        children = list(features.children())
        slices = [nn.Sequential(*children[bounds[i] + 1 : bounds[i + 1] + 1]) for i in range(len(feature_layer))]
    else:
        slices = [nn.Sequential(*list(features.children())[: feature_layer + 1])]

    def loss(x: Tensor, gt: Tensor) -> Tensor:
        def extract(v: Tensor) -> list[Tensor]:
            v = (v - MEAN) / STD
            out = []
            for part in slices:
                v = part(v)
                out.append(v.clone())
            return out

        fx, fgt = extract(x), extract(gt.detach())
        if not isinstance(weights, list):
            return F.l1_loss(fx[0], fgt[0])
        return sum(w * F.l1_loss(a, b) for w, a, b in zip(weights, fx, fgt))

    return loss


def test_kair_swinir_gan(vgg19: nn.Sequential) -> None:
    """KAIR options/swinir/train_swinir_sr_realworld_x4_gan.json: F_feature_layer [2,7,16,25,34], F_weights."""
    x, gt = images(2, 3, 32, 32, seed=11), images(2, 3, 32, 32, seed=12)
    reference = kair_reference(vgg19, [2, 7, 16, 25, 34], [0.1, 0.1, 1.0, 1.0, 1.0])
    loss = fh.PerceptualLoss("vgg19", layer_weights=REAL_ESRGAN, distance="l1")
    assert_parity(lambda v: loss(v, gt), lambda v: reference(v, gt), x)
    # train_msrresnet_gan.json: F_feature_layer 34 alone
    single = kair_reference(vgg19, 34, 1.0)
    conv5_4 = fh.PerceptualLoss("vgg19", "conv5_4", distance="l1")
    assert_parity(lambda v: conv5_4(v, gt), lambda v: single(v, gt), x)


# -- pix2pixHD -------------------------------------------------------------------------------------------


def test_pix2pixhd_vgg_loss(vgg19: nn.Sequential) -> None:
    """pix2pixHD models/networks.py VGGLoss on Vgg19 slices, [-1, 1] images unnormalized, times lambda_feat 10."""
    cuts = [0, 2, 7, 12, 21, 30]  # slice1 ... slice5 end after relu1_1, relu2_1, relu3_1, relu4_1, relu5_1
    children = list(vgg19.children())
    slices = [nn.Sequential(*children[a:b]) for a, b in zip(cuts, cuts[1:])]
    layer_weights = [1.0 / 32, 1.0 / 16, 1.0 / 8, 1.0 / 4, 1.0]

    def reference(fake: Tensor, real: Tensor) -> Tensor:
        def extract(v: Tensor) -> list[Tensor]:
            out = []
            for part in slices:
                v = part(v)
                out.append(v)
            return out

        fx, fy = extract(fake), extract(real)
        return 10.0 * sum(w * F.l1_loss(a, b.detach()) for w, a, b in zip(layer_weights, fx, fy))

    fake, real = images(2, 3, 32, 32, seed=13, low=-1), images(2, 3, 32, 32, seed=14, low=-1)
    loss = presets.pix2pixhd()
    assert_parity(lambda v: 10 * loss(v, real), lambda v: reference(v, real), fake)
    by_hand = fh.PerceptualLoss(
        "vgg19",
        presets.PIX2PIXHD_LAYERS,
        layer_weights=layer_weights,
        distance="l1",
        normalize=False,
        input_range=(-1, 1),
    )
    assert_parity(lambda v: 10 * by_hand(v, real), lambda v: reference(v, real), fake)


class NLayerDiscriminator(nn.Module):
    """pix2pixHD's NLayerDiscriminator with getIntermFeat: n_layers + 2 stages kept as model0, model1, ..."""

    def __init__(self, input_nc: int, ndf: int, n_layers: int) -> None:
        super().__init__()
        stages = [[nn.Conv2d(input_nc, ndf, 4, stride=2, padding=2), nn.LeakyReLU(0.2, True)]]
        nf = ndf
        for n in range(1, n_layers + 1):
            nf_prev, nf = nf, min(nf * 2, 512)
            stride = 2 if n < n_layers else 1
            stages.append(
                [nn.Conv2d(nf_prev, nf, 4, stride=stride, padding=2), nn.InstanceNorm2d(nf), nn.LeakyReLU(0.2, True)]
            )
        stages.append([nn.Conv2d(nf, 1, 4, stride=1, padding=2)])
        self.n_layers = n_layers
        for n, stage in enumerate(stages):
            setattr(self, f"model{n}", nn.Sequential(*stage))

    def forward(self, x: Tensor) -> list[Tensor]:
        out = [x]
        for n in range(self.n_layers + 2):
            out.append(getattr(self, f"model{n}")(out[-1]))
        return out[1:]


class MultiscaleDiscriminator(nn.Module):
    """pix2pixHD's MultiscaleDiscriminator (getIntermFeat=True): num_D discriminators on downsampled inputs."""

    def __init__(self, input_nc: int, ndf: int = 8, n_layers: int = 3, num_d: int = 2) -> None:
        super().__init__()
        self.num_d, self.n_layers = num_d, n_layers
        for i in range(num_d):
            net = NLayerDiscriminator(input_nc, ndf, n_layers)
            for j in range(n_layers + 2):
                setattr(self, f"scale{i}_layer{j}", getattr(net, f"model{j}"))
        self.downsample = nn.AvgPool2d(3, stride=2, padding=[1, 1], count_include_pad=False)

    def forward(self, x: Tensor) -> list[list[Tensor]]:
        result = []
        for i in range(self.num_d):
            stages = [getattr(self, f"scale{self.num_d - 1 - i}_layer{j}") for j in range(self.n_layers + 2)]
            out = [x]
            for stage in stages:
                out.append(stage(out[-1]))
            result.append(out[1:])
            if i != self.num_d - 1:
                x = self.downsample(x)
        return result


def test_pix2pixhd_gan_feature_matching() -> None:
    """pix2pixHD models/pix2pixHD_model.py: D_weights 1/num_D, feat_weights 4/(n_layers_D+1), L1, lambda_feat 10."""
    torch.manual_seed(0)
    n_layers, num_d, lambda_feat = 3, 2, 10.0
    netd = MultiscaleDiscriminator(6, ndf=8, n_layers=n_layers, num_d=num_d)
    label, real = images(2, 3, 32, 32, seed=15, low=-1), images(2, 3, 32, 32, seed=16, low=-1)
    fake = images(2, 3, 32, 32, seed=17, low=-1)

    def reference(fake: Tensor) -> Tensor:
        pred_real = netd(torch.cat((label, real), dim=1))
        pred_fake = netd(torch.cat((label, fake), dim=1))
        feat_weights, d_weights = 4.0 / (n_layers + 1), 1.0 / num_d
        loss = 0
        for i in range(num_d):
            for j in range(len(pred_fake[i]) - 1):
                loss += d_weights * feat_weights * F.l1_loss(pred_fake[i][j], pred_real[i][j].detach()) * lambda_feat
        return loss

    # the discriminator returns its features: drop each scale's final prediction
    fm = fh.FeatureMatchingLoss(layer_weights=[4.0 / (n_layers + 1)] * (n_layers + 1))

    def returned(fake: Tensor) -> Tensor:
        pred_real = netd(torch.cat((label, real), dim=1))
        pred_fake = netd(torch.cat((label, fake), dim=1))
        return lambda_feat * fm([p[:-1] for p in pred_fake], [p[:-1] for p in pred_real])

    assert_parity(returned, reference, fake)

    # a discriminator that returns only its predictions: capture the same stages by module path
    scales = [[f"scale{i}_layer{j}" for j in range(n_layers + 1)] for i in range(num_d)]

    def captured(fake: Tensor) -> Tensor:
        with fh.capture(netd, [name for scale in scales for name in scale]) as feats:
            netd(torch.cat((label, real), dim=1))
            real_feats = dict(feats)
            netd(torch.cat((label, fake), dim=1))
            fake_feats = dict(feats)
        per_d = lambda f: [{name: f[name] for name in scale} for scale in scales]  # noqa: E731
        return lambda_feat * fh.FeatureMatchingLoss()(per_d(fake_feats), per_d(real_feats))

    assert_parity(captured, reference, fake)


# -- pytorch/examples fast_neural_style (Johnson et al.) ------------------------------------------------


def test_fast_neural_style(vgg16: nn.Sequential) -> None:
    """fast_neural_style/neural_style: Vgg16 slices, normalize_batch of [0, 255] images, gram / (ch*h*w), MSE,
    content_weight 1e5, style_weight 1e10, the style image repeated over the batch."""
    cuts = [0, 4, 9, 16, 23]  # relu1_2, relu2_2, relu3_3, relu4_3
    children = list(vgg16.children())
    slices = [nn.Sequential(*children[a:b]) for a, b in zip(cuts, cuts[1:])]

    def vgg(batch: Tensor) -> list[Tensor]:
        h, out = batch, []
        for part in slices:
            h = part(h)
            out.append(h)
        return out

    def normalize_batch(batch: Tensor) -> Tensor:
        return (batch.div(255.0) - MEAN) / STD

    def gram_matrix(y: Tensor) -> Tensor:
        b, ch, h, w = y.size()
        features = y.view(b, ch, w * h)
        return features.bmm(features.transpose(1, 2)) / (ch * h * w)

    style = images(1, 3, 40, 40, seed=18) * 255
    x = images(2, 3, 32, 32, seed=19) * 255  # the content batch
    gram_style = [gram_matrix(f) for f in vgg(normalize_batch(style.repeat(2, 1, 1, 1)))]

    def reference(y: Tensor) -> Tensor:
        features_y, features_x = vgg(normalize_batch(y)), vgg(normalize_batch(x))
        content = 1e5 * F.mse_loss(features_y[1], features_x[1])
        style_loss = 1e10 * sum(F.mse_loss(gram_matrix(f), g[: y.shape[0]]) for f, g in zip(features_y, gram_style))
        return content + style_loss

    y = images(2, 3, 32, 32, seed=20) * 255  # the transformer's output
    on_255 = presets.johnson2016(style, input_range=(0, 255))
    assert_parity(lambda v: on_255(v, x), reference, y)
    on_unit = presets.johnson2016(style / 255)  # the same loss for images in [0, 1]
    assert_parity(lambda v: on_unit(v / 255, x / 255), reference, y)


# -- PyTorch neural style tutorial ----------------------------------------------------------------------


def test_neural_style_tutorial(vgg19: nn.Sequential) -> None:
    """pytorch/tutorials advanced_source/neural_style_tutorial.py: losses after conv_4 and conv_1 ... conv_5,
    out-of-place ReLUs, Gram / (a*b*c*d), MSE, style_weight 1e6, content_weight 1, one image."""

    def gram_matrix(v: Tensor) -> Tensor:
        a, b, c, d = v.size()
        features = v.view(a * b, c * d)
        return torch.mm(features, features.t()).div(a * b * c * d)

    def conv_outputs(img: Tensor) -> dict[str, Tensor]:
        x, i, out = (img - MEAN) / STD, 0, {}
        for layer in vgg19.children():
            if isinstance(layer, nn.Conv2d):
                i += 1
            elif isinstance(layer, nn.ReLU):
                layer = nn.ReLU(inplace=False)
            x = layer(x)
            if isinstance(layer, nn.Conv2d):
                out[f"conv_{i}"] = x
                if i == 5:
                    break
        return out

    content_img, style_img = images(1, 3, 32, 32, seed=21), images(1, 3, 32, 32, seed=22)
    content_target = conv_outputs(content_img)["conv_4"].detach()
    style_targets = {k: gram_matrix(v).detach() for k, v in conv_outputs(style_img).items()}

    def reference(img: Tensor) -> Tensor:
        out = conv_outputs(img)
        style_score = sum(F.mse_loss(gram_matrix(out[k]), style_targets[k]) for k in style_targets)
        return 1e6 * style_score + 1 * F.mse_loss(out["conv_4"], content_target)

    loss = presets.neural_style_tutorial(content_img, style_img)
    assert_parity(loss, reference, images(1, 3, 32, 32, seed=23))


# -- Gatys's own PyTorch code ---------------------------------------------------------------------------

GATYS_CONVS = [f"conv{b}_{i}" for b, n in enumerate(VGG19_BLOCKS, start=1) for i in range(1, n + 1)]


def gatys_reference(
    convs: dict[str, nn.Conv2d], prep: Callable[[Tensor], Tensor], content_img: Tensor, style_img: Tensor
) -> Callable[[Tensor], Tensor]:
    """leongatys/PytorchNeuralStyleTransfer NeuralStyleTransfer.ipynb: F.relu after each conv, GramMatrix / (h*w),
    GramMSELoss with style_weights 1e3 / n**2 on r11 ... r51, MSE on r42 with weight 1."""

    def vgg(x: Tensor, keys: list[str]) -> list[Tensor]:
        out = {}
        for name in GATYS_CONVS:
            block, index = name[4:].split("_")
            if index == "1" and block != "1":
                x = F.max_pool2d(x, kernel_size=2, stride=2)
            x = out[f"r{block}{index}"] = F.relu(convs[name](x))
        return [out[key] for key in keys]

    def gram(v: Tensor) -> Tensor:
        b, c, h, w = v.size()
        flat = v.view(b, c, h * w)
        return torch.bmm(flat, flat.transpose(1, 2)).div(h * w)

    style_layers, content_layers = ["r11", "r21", "r31", "r41", "r51"], ["r42"]
    weights = [1e3 / n**2 for n in [64, 128, 256, 512, 512]] + [1e0]
    targets = [gram(a).detach() for a in vgg(prep(style_img), style_layers)]
    targets += [a.detach() for a in vgg(prep(content_img), content_layers)]

    def loss(opt_img: Tensor) -> Tensor:
        out = vgg(prep(opt_img), style_layers + content_layers)
        losses = [w * F.mse_loss(gram(a), t) for w, a, t in zip(weights[:5], out[:5], targets[:5])]
        return sum(losses) + weights[5] * F.mse_loss(out[5], targets[5])

    return loss


def test_gatys_notebook_formula_on_torchvision_vgg19(vgg19: nn.Sequential) -> None:
    """The notebook's layers, Grams and weights on torchvision's VGG19 with its normalization (the default)."""
    convs = dict(zip(GATYS_CONVS, _convs(vgg19)))
    content_img, style_img = images(1, 3, 32, 32, seed=24), images(1, 3, 32, 32, seed=25)
    reference = gatys_reference(convs, lambda x: (x - MEAN) / STD, content_img, style_img)
    loss = presets.gatys2016(content_img, style_img)
    assert_parity(loss, reference, images(1, 3, 32, 32, seed=26))


def test_gatys_notebook_with_its_caffe_weights(tmp_path: Path, vgg19: nn.Sequential, vgg19_file: Path) -> None:
    """The notebook itself: Caffe weights (vgg_conv.pth layout), BGR images in [0, 255] minus the mean. The same
    weights converted to torchvision's layout (first convolution's input channels reversed) give its numbers."""
    torch.manual_seed(1)
    caffe = dict(zip(GATYS_CONVS, [nn.Conv2d(m.in_channels, m.out_channels, 3, padding=1) for m in _convs(vgg19)]))
    for conv in caffe.values():
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
        conv.requires_grad_(False)
    bgr_mean = torch.tensor([0.40760392, 0.45795686, 0.48501961]).view(1, 3, 1, 1)

    def prep(x: Tensor) -> Tensor:  # ToTensor, RGB -> BGR, Normalize(mean, std=1), mul 255
        return (x[:, [2, 1, 0]] - bgr_mean) * 255

    content_img, style_img = images(1, 3, 32, 32, seed=27), images(1, 3, 32, 32, seed=28)
    reference = gatys_reference(caffe, prep, content_img, style_img)

    # torchvision's layout; the classifier, never run, as stride-0 views (a small file, loaded strictly)
    state = torch.load(vgg19_file, weights_only=True)
    state = {k: v if k.startswith("features.") else torch.zeros(1).expand(v.shape) for k, v in state.items()}
    indices = [i for i, m in enumerate(vgg19) if isinstance(m, nn.Conv2d)]
    for index, name in zip(indices, GATYS_CONVS):
        weight = caffe[name].weight.detach().clone()
        state[f"features.{index}.weight"] = weight[:, [2, 1, 0]] if name == "conv1_1" else weight
        state[f"features.{index}.bias"] = caffe[name].bias.detach().clone()
    path = tmp_path / "vgg_conv_rgb.pth"
    torch.save(state, path)
    loss = presets.gatys2016(
        content_img, style_img, weights=str(path), mean=(0.48501961, 0.45795686, 0.40760392), std=(1 / 255,) * 3
    )
    assert_parity(loss, reference, images(1, 3, 32, 32, seed=29))


def _convs(features: nn.Sequential) -> list[nn.Conv2d]:
    return [m for m in features if isinstance(m, nn.Conv2d)]
