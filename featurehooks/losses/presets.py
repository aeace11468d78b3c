"""Published loss configurations, one function each, built on one shared extractor where they combine losses.

Layer choices and per-layer weights follow the papers; loss scales follow featurehooks' conventions
(means over C, H, W and over C x C), so term weights are featurehooks' own where noted.
"""

from __future__ import annotations

from torch import Tensor

from ..backbones import WeightsSpec
from ..extractor import FeatureExtractor
from ..functional import Reduction
from .group import LossGroup
from .perceptual import PerceptualLoss
from .style import StyleLoss

__all__ = [
    "DINO_VITS16",
    "DINO_VITS16_LAYERS",
    "GATYS2016_CONTENT_LAYERS",
    "GATYS2016_STYLE_LAYERS",
    "JOHNSON2016_CONTENT_LAYERS",
    "JOHNSON2016_STYLE_LAYERS",
    "PIX2PIXHD_LAYERS",
    "PIX2PIXHD_WEIGHTS",
    "dino_vits16",
    "gatys2016",
    "johnson2016",
    "pix2pixhd",
]

JOHNSON2016_CONTENT_LAYERS = ("relu2_2",)
JOHNSON2016_STYLE_LAYERS = ("relu1_2", "relu2_2", "relu3_3", "relu4_3")
GATYS2016_CONTENT_LAYERS = ("relu4_2",)
GATYS2016_STYLE_LAYERS = ("relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1")
PIX2PIXHD_LAYERS = ("relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1")
PIX2PIXHD_WEIGHTS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1.0)
DINO_VITS16 = "timm/vit_small_patch16_224.dino"
DINO_VITS16_LAYERS = ("blocks.2", "blocks.5", "blocks.8", "blocks.11")


def johnson2016(
    style_image: Tensor | None = None,
    *,
    content_weight: float = 1.0,
    style_weight: float = 5.0,
    weights: WeightsSpec = "DEFAULT",
    input_range: tuple[float, float] = (0.0, 1.0),
    reduction: Reduction = "mean",
) -> LossGroup:
    """Johnson et al.'s loss for fast style transfer: VGG16 content on relu2_2, style on relu1_2-relu4_3.

    One VGG16 forward (to relu4_3) serves both terms. Gram matrices are normalized by C*H*W and
    compared by mean squared error, as in the authors' code; ``content_weight=1, style_weight=5``
    are their defaults. Call the group as ``loss(output, content_batch)``; the style image's
    Grams are computed once (pass ``style_image`` or call ``group.losses["style"].set_target``).

    Example:
        >>> import torch
        >>> loss_fn = johnson2016(torch.rand(1, 3, 64, 64), weights=None)
        >>> loss_fn(torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)).shape
        torch.Size([])

    References:
        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV. https://arxiv.org/abs/1603.08155
    """
    layers = list(dict.fromkeys(JOHNSON2016_STYLE_LAYERS + JOHNSON2016_CONTENT_LAYERS))
    extractor = FeatureExtractor("vgg16", layers, weights=weights, mode="grad", input_range=input_range)
    content = PerceptualLoss(extractor, JOHNSON2016_CONTENT_LAYERS, reduction=reduction)
    style = StyleLoss(extractor, JOHNSON2016_STYLE_LAYERS, reduction=reduction, target=style_image)
    return LossGroup({"content": content, "style": style}, weights={"content": content_weight, "style": style_weight})


def gatys2016(
    content_image: Tensor | None = None,
    style_image: Tensor | None = None,
    *,
    content_weight: float = 1.0,
    style_weight: float = 1e6,
    weights: WeightsSpec = "DEFAULT",
    input_range: tuple[float, float] = (0.0, 1.0),
) -> LossGroup:
    """Gatys et al.'s style-transfer loss: VGG19 content on relu4_2, style on relu1_1 ... relu5_1.

    Both targets are fixed images whose features and Grams are computed once; the group is then
    called with the image being optimized alone. Grams are normalized by C*H*W, so the default
    ``style_weight=1e6`` matches the PyTorch tutorial's balance rather than the paper's alpha/beta.

    Example:
        >>> import torch
        >>> loss_fn = gatys2016(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64), weights=None)
        >>> loss_fn(torch.rand(1, 3, 64, 64)).shape
        torch.Size([])

    References:
        Gatys, Ecker, Bethge (2016). Image Style Transfer Using Convolutional Neural Networks. CVPR.
    """
    layers = list(dict.fromkeys(GATYS2016_STYLE_LAYERS + GATYS2016_CONTENT_LAYERS))
    extractor = FeatureExtractor("vgg19", layers, weights=weights, mode="grad", input_range=input_range)
    content = PerceptualLoss(extractor, GATYS2016_CONTENT_LAYERS)
    style = StyleLoss(extractor, GATYS2016_STYLE_LAYERS, target=style_image)
    if content_image is not None:
        content.set_target(content_image)
    return LossGroup({"content": content, "style": style}, weights={"content": content_weight, "style": style_weight})


def pix2pixhd(
    *,
    weights: WeightsSpec = "DEFAULT",
    input_range: tuple[float, float] = (0.0, 1.0),
    reduction: Reduction = "mean",
) -> PerceptualLoss:
    """pix2pixHD's VGG loss: VGG19 relu1_1 ... relu5_1, L1 distance, layer weights 1/32, 1/16, 1/8, 1/4, 1.

    pix2pixHD's generator outputs lie in [-1, 1]: pass ``input_range=(-1, 1)`` for such images.

    References:
        Wang, Liu, Zhu, Tao, Kautz, Catanzaro (2018). High-Resolution Image Synthesis and Semantic
        Manipulation with Conditional GANs. CVPR. https://arxiv.org/abs/1711.11585
    """
    return PerceptualLoss(
        "vgg19",
        PIX2PIXHD_LAYERS,
        layer_weights=PIX2PIXHD_WEIGHTS,
        distance="l1",
        weights=weights,
        input_range=input_range,
        reduction=reduction,
    )


def dino_vits16(
    layers: tuple[str, ...] = DINO_VITS16_LAYERS,
    *,
    weights: WeightsSpec = "DEFAULT",
    input_range: tuple[float, float] = (0.0, 1.0),
    reduction: Reduction = "mean",
    resize: int | tuple[int, int] | None = 224,
) -> PerceptualLoss:
    """A perceptual loss on self-supervised DINO ViT-S/16 features (timm ``vit_small_patch16_224.dino``).

    The patch tokens of every third block (``blocks.2`` ... ``blocks.11``) are laid out as maps
    (``output_format="nchw"``, the class token left out), unit-normalized over channels and compared
    by squared distance summed over channels: per layer, the mean over patches of ``2 - 2 cos``, summed
    over layers. The model takes 224x224 images, so inputs are resized to 224 unless ``resize=None``.
    ``weights="DEFAULT"`` reads timm's pretrained tag from the Hugging Face cache (or downloads it);
    a local ``.safetensors``/``.pth`` file works too.

    References:
        Caron, Touvron, Misra, Jégou, Mairal, Bojanowski, Joulin (2021). Emerging Properties in
        Self-Supervised Vision Transformers. ICCV. https://arxiv.org/abs/2104.14294
    """
    extractor = FeatureExtractor(
        DINO_VITS16, list(layers), weights=weights, mode="grad", input_range=input_range, output_format="nchw"
    )
    return PerceptualLoss(
        extractor,
        list(layers),
        layer_weights=[extractor.output_layouts[name].channels or 1 for name in layers],
        normalize_features=True,
        reduction=reduction,
        resize=resize,
    )
