"""Published loss configurations, one function each: with the defaults, each gives the value and the input
gradients of the code it is named after (tested in ``tests/losses/test_porting.py`` against the published formulas).

Presets that combine terms build one extractor over the union of their layers, so one backbone
forward of the input serves every term. Every preset forwards ``**extractor_options`` (``weights``,
``input_range``, ``mean``/``std``, ``normalize``, ``memory_format``, ...) to its ``FeatureExtractor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..errors import InvalidValueError
from ..extractor import FeatureExtractor
from ..functional import GramNormalization, Reduction
from ._base import InputSize, grad_extractor, takes_old_resize
from .group import LossGroup
from .perceptual import PerceptualLoss
from .style import StyleLoss

__all__ = [  # each preset, then the constants it is built from
    "basicsr",
    "dino_vits16",
    "DINO_VITS16",
    "DINO_VITS16_LAYERS",
    "gatys2016",
    "GATYS2016_CONTENT_LAYERS",
    "GATYS2016_STYLE_LAYERS",
    "johnson2016",
    "JOHNSON2016_CONTENT_LAYERS",
    "JOHNSON2016_STYLE_LAYERS",
    "neural_style_tutorial",
    "NEURAL_STYLE_TUTORIAL_CONTENT_LAYERS",
    "NEURAL_STYLE_TUTORIAL_STYLE_LAYERS",
    "pix2pixhd",
    "PIX2PIXHD_LAYERS",
    "PIX2PIXHD_WEIGHTS",
]

JOHNSON2016_CONTENT_LAYERS = ("relu2_2",)
JOHNSON2016_STYLE_LAYERS = ("relu1_2", "relu2_2", "relu3_3", "relu4_3")
GATYS2016_CONTENT_LAYERS = ("relu4_2",)
GATYS2016_STYLE_LAYERS = ("relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1")
# the tutorial's conv_4 and conv_1 ... conv_5: losses inserted after the convolutions, before the ReLUs
NEURAL_STYLE_TUTORIAL_CONTENT_LAYERS = ("conv2_2",)
NEURAL_STYLE_TUTORIAL_STYLE_LAYERS = ("conv1_1", "conv1_2", "conv2_1", "conv2_2", "conv3_1")
PIX2PIXHD_LAYERS = ("relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1")
PIX2PIXHD_WEIGHTS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1.0)
DINO_VITS16 = "timm/vit_small_patch16_224.dino"
DINO_VITS16_LAYERS = ("blocks.2", "blocks.5", "blocks.8", "blocks.11")

_BASICSR_CRITERIA = {"l1": "l1", "l2": "mse", "fro": "fro"}


def _shared_extractor(
    backbone: str, layer_groups: tuple[tuple[str, ...], ...], options: Mapping[str, Any]
) -> FeatureExtractor:
    """One extractor (``mode="grad"``) over the union of the layers of every term, in first-seen order."""
    layers = list(dict.fromkeys(name for group in layer_groups for name in group))
    return grad_extractor(backbone, layers, options)


@dataclass(frozen=True)
class _ContentStyle:
    """A content (MSE of features) + style (MSE of Grams) loss as a paper's code computes it: its backbone, the
    layers of each term, how the Grams are normalized, and whether each style layer weighs ``1 / C**2``."""

    backbone: str
    content_layers: tuple[str, ...]
    style_layers: tuple[str, ...]
    gram_normalization: GramNormalization = "chw"
    style_by_channels: bool = False

    def group(
        self,
        options: Mapping[str, Any],
        weights: tuple[float, float],
        images: tuple[Tensor | None, Tensor | None],
        reduction: Reduction = "mean",
    ) -> LossGroup:
        """The two terms on one extractor over their layers; ``weights`` and fixed ``images`` are (content, style)."""
        extractor = _shared_extractor(self.backbone, (self.style_layers, self.content_layers), options)
        style_layer_weights = None
        if self.style_by_channels:
            channels = [extractor.output_layouts[name].channels or 1 for name in self.style_layers]
            style_layer_weights = [1.0 / c**2 for c in channels]
        (content_weight, style_weight), (content_image, style_image) = weights, images
        content = PerceptualLoss(extractor, self.content_layers, reduction=reduction)
        style = StyleLoss(
            extractor,
            self.style_layers,
            layer_weights=style_layer_weights,
            gram_normalization=self.gram_normalization,
            reduction=reduction,
            target=style_image,
        )
        if content_image is not None:
            content.set_target(content_image)
        return LossGroup(
            {"content": content, "style": style}, weights={"content": content_weight, "style": style_weight}
        )


_JOHNSON2016 = _ContentStyle("vgg16", JOHNSON2016_CONTENT_LAYERS, JOHNSON2016_STYLE_LAYERS)
_GATYS2016 = _ContentStyle("vgg19", GATYS2016_CONTENT_LAYERS, GATYS2016_STYLE_LAYERS, "hw", style_by_channels=True)
_NEURAL_STYLE_TUTORIAL = _ContentStyle(
    "vgg19", NEURAL_STYLE_TUTORIAL_CONTENT_LAYERS, NEURAL_STYLE_TUTORIAL_STYLE_LAYERS
)


def johnson2016(
    style_image: Tensor | None = None,
    *,
    content_weight: float = 1e5,
    style_weight: float = 1e10,
    reduction: Reduction = "mean",
    **extractor_options: Any,
) -> LossGroup:
    """Johnson et al.'s fast style transfer loss, as pytorch/examples trains it: VGG16, content relu2_2, style
    relu1_2 ... relu4_3.

    Reproduces ``fast_neural_style/neural_style/neural_style.py`` of github.com/pytorch/examples
    (``vgg.py``'s ``Vgg16`` slices, ``utils.gram_matrix`` and ``utils.normalize_batch``): content
    ``1e5 * MSE(relu2_2)``, style ``1e10 * sum over layers of MSE(Gram / (C*H*W))``, ImageNet
    normalization. pytorch/examples feeds images in [0, 255] and divides by 255 before the mean/std;
    the value is the same for images in [0, 1] with the default ``input_range``, or pass
    ``input_range=(0, 255)`` for images on that scale. One VGG16 forward (to relu4_3) serves both
    terms. Call the group as ``loss(output, content_batch)``; the style image's Grams are computed
    once (pass ``style_image``, broadcast over the batch as pytorch/examples repeats it, or call
    ``group.losses["style"].set_target``). Johnson's Lua code weighed the terms 1 and 5 on Caffe VGG16
    features; pass ``content_weight=1.0, style_weight=5.0`` for that ratio.

    Args:
        style_image: the style image, ``(1, 3, H, W)``; its Grams are computed once.
        content_weight: pytorch/examples' ``--content-weight`` (1e5).
        style_weight: pytorch/examples' ``--style-weight`` (1e10).
        reduction: ``"mean"`` (pytorch/examples' ``MSELoss``), ``"sum"`` or ``"none"``.
        **extractor_options: ``FeatureExtractor`` keyword arguments (``weights``, ``input_range``, ...).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import johnson2016
        >>> loss_fn = johnson2016(torch.rand(1, 3, 64, 64), weights=None)
        >>> loss_fn(torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)).shape
        torch.Size([])

    References:
        Johnson, Alahi, Fei-Fei (2016). Perceptual Losses for Real-Time Style Transfer and
        Super-Resolution. ECCV. https://arxiv.org/abs/1603.08155
    """
    return _JOHNSON2016.group(extractor_options, (content_weight, style_weight), (None, style_image), reduction)


def gatys2016(
    content_image: Tensor | None = None,
    style_image: Tensor | None = None,
    *,
    content_weight: float = 1.0,
    style_weight: float = 1e3,
    **extractor_options: Any,
) -> LossGroup:
    """Gatys et al.'s style transfer loss, as the first author's PyTorch code computes it: VGG19, content
    relu4_2, style relu1_1 ... relu5_1.

    Reproduces ``NeuralStyleTransfer.ipynb`` of github.com/leongatys/PytorchNeuralStyleTransfer:
    content ``1 * MSE(relu4_2)``, style ``sum over layers of 1e3 / C**2 * MSE(Gram / (H*W))`` with
    C = 64, 128, 256, 512, 512 (``style_weight`` is the 1e3, spread over the layers as
    ``layer_weights = 1 / C**2``). Both targets are fixed images whose features and Grams are
    computed once; call the group with the image being optimized alone.

    The notebook runs Caffe VGG19 weights (``vgg_conv.pth``) on BGR images in [0, 255] minus the
    ImageNet mean; here the default is torchvision's VGG19 with its own normalization, whose
    features have another scale, so the balance between the terms is the notebook's formula on
    other features. For the notebook's own numbers, pass its weights converted to torchvision's
    layout (``features.<i>.weight``, first convolution's input channels reversed to RGB) as
    ``weights="vgg_conv_rgb.pth"`` with ``mean=(0.48501961, 0.45795686, 0.40760392)`` and
    ``std=(1 / 255,) * 3`` (tested on seeded weights).

    Args:
        content_image: the content image, ``(1, 3, H, W)``; its features are computed once.
        style_image: the style image, ``(1, 3, H', W')``; its Grams are computed once.
        content_weight: the notebook's ``content_weights`` (1).
        style_weight: the numerator of the notebook's ``style_weights = 1e3 / C**2``.
        **extractor_options: ``FeatureExtractor`` keyword arguments (``weights``, ``mean``, ``std``, ...).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import gatys2016
        >>> loss_fn = gatys2016(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64), weights=None)
        >>> loss_fn(torch.rand(1, 3, 64, 64)).shape
        torch.Size([])

    References:
        Gatys, Ecker, Bethge (2016). Image Style Transfer Using Convolutional Neural Networks. CVPR.
    """
    return _GATYS2016.group(extractor_options, (content_weight, style_weight), (content_image, style_image))


def neural_style_tutorial(
    content_image: Tensor | None = None,
    style_image: Tensor | None = None,
    *,
    content_weight: float = 1.0,
    style_weight: float = 1e6,
    **extractor_options: Any,
) -> LossGroup:
    """The PyTorch neural style tutorial's loss: VGG19, content conv2_2, style conv1_1 ... conv3_1 (before
    their ReLUs).

    Reproduces ``advanced_source/neural_style_tutorial.py`` of github.com/pytorch/tutorials: its
    ``conv_4`` content and ``conv_1`` ... ``conv_5`` style layers are the convolution outputs conv2_2
    and conv1_1, conv1_2, conv2_1, conv2_2, conv3_1 (the tutorial makes the ReLUs out of place and
    inserts its losses right after the convolutions); content ``1 * MSE``, style
    ``1e6 * sum over layers of MSE(Gram / (C*H*W))``, ImageNet normalization, images in [0, 1]. The
    tutorial optimizes one image (its Gram mixes the batch into the channels, so values agree for
    batch 1). Both targets are fixed images computed once; call the group with the image being
    optimized alone.

    Args:
        content_image: the content image, ``(1, 3, H, W)``; its features are computed once.
        style_image: the style image, ``(1, 3, H', W')``; its Grams are computed once.
        content_weight: the tutorial's ``content_weight`` (1).
        style_weight: the tutorial's ``style_weight`` (1e6).
        **extractor_options: ``FeatureExtractor`` keyword arguments (``weights``, ``input_range``, ...).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import neural_style_tutorial
        >>> loss_fn = neural_style_tutorial(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64), weights=None)
        >>> image = torch.rand(1, 3, 64, 64, requires_grad=True)  # the image being optimized
        >>> {name: term.shape for name, term in loss_fn.terms(image).items()}  # the weighted terms, for logging
        {'content': torch.Size([]), 'style': torch.Size([])}

    References:
        Gatys, Ecker, Bethge (2016). Image Style Transfer Using Convolutional Neural Networks. CVPR.

        Jacq, Herring. Neural Transfer Using PyTorch (PyTorch tutorials).
        https://pytorch.org/tutorials/advanced/neural_style_tutorial.html
    """
    return _NEURAL_STYLE_TUTORIAL.group(extractor_options, (content_weight, style_weight), (content_image, style_image))


def basicsr(
    layer_weights: Mapping[str, float],
    *,
    vgg_type: str = "vgg19",
    use_input_norm: bool = True,
    range_norm: bool = False,
    perceptual_weight: float = 1.0,
    style_weight: float = 0.0,
    criterion: str = "l1",
    **extractor_options: Any,
) -> LossGroup:
    """BasicSR's ``PerceptualLoss`` from its config keys (ESRGAN, Real-ESRGAN, GFPGAN, HiFaceGAN, ...).

    Reproduces ``basicsr/losses/basic_loss.py`` (``PerceptualLoss``) and ``basicsr/archs/vgg_arch.py``
    (``VGGFeatureExtractor``) of github.com/XPixelGroup/BasicSR: the arguments are the keys of a
    ``perceptual_opt`` block, so ``basicsr(**{k: v for k, v in opt.items() if k != "type"})`` ports a
    config as it is. The group's terms are ``"perceptual"`` (``perceptual_weight * sum over layers of
    w * criterion(features)``) and ``"style"`` (the same on Grams / (C*H*W)), each present when its
    weight is positive; ``group.terms(output, gt)`` gives them apart as BasicSR's tuple does, and
    the group's value is their sum. One forward of each image serves both.

    Config keys map to featurehooks as follows: ``criterion`` ``l1``/``l2``/``fro`` is ``distance``
    ``"l1"``/``"mse"``/``"fro"``; ``range_norm: true`` (images in [-1, 1]) is ``input_range=(-1, 1)``;
    ``use_input_norm: false`` is ``normalize=False`` (or, with ``range_norm``, ``mean=0, std=1``
    after mapping [-1, 1] to [0, 1]); ``conv*`` names are the convolution outputs before their ReLU,
    as in BasicSR.

    Args:
        layer_weights: layer name -> weight (``{"conv5_4": 1.0}`` for ESRGAN); names the layers too.
        vgg_type: the backbone (``"vgg19"``, ``"vgg16"``, ...).
        use_input_norm: ImageNet mean/std normalization of [0, 1] images (BasicSR's default, True).
        range_norm: images come in [-1, 1] and are mapped to [0, 1] first.
        perceptual_weight: the weight of the feature term (0 leaves it out).
        style_weight: the weight of the Gram term (0, the default, leaves it out).
        criterion: ``"l1"`` (default), ``"l2"`` or ``"fro"``.
        **extractor_options: further ``FeatureExtractor`` keyword arguments (``weights``,
            ``memory_format``, ``input_range`` for images on another scale, ...).

    Raises:
        InvalidValueError: an unknown criterion, both weights 0, or an extractor option that the
            config's ``use_input_norm``/``range_norm`` already set.

    Examples:
        >>> import torch
        >>> from featurehooks.losses import basicsr
        >>> esrgan = basicsr({"conv5_4": 1.0}, weights=None)  # options/train/ESRGAN/train_ESRGAN_x4.yml
        >>> esrgan(torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)).shape
        torch.Size([])

    References:
        Wang et al. (2018). ESRGAN: Enhanced Super-Resolution Generative Adversarial Networks. ECCVW.
        https://arxiv.org/abs/1809.00219

        Wang, Yu, Dong, Lin, Loy, Qiao, Tang (2021). BasicSR: Open Source Image and Video Restoration
        Toolbox. https://github.com/XPixelGroup/BasicSR
    """
    if criterion not in _BASICSR_CRITERIA:
        raise InvalidValueError(
            f"criterion must be one of {sorted(_BASICSR_CRITERIA)}, as in BasicSR, not {criterion!r}"
        )
    if not perceptual_weight > 0 and not style_weight > 0:
        raise InvalidValueError("perceptual_weight and style_weight are both 0: there is no loss to compute")
    derived: dict[str, Any] = {}
    if range_norm:
        derived["input_range"] = (-1.0, 1.0)
    if not use_input_norm:
        derived.update({"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)} if range_norm else {"normalize": False})
    clash = sorted(set(derived) & set(extractor_options))
    if clash:
        raise InvalidValueError(
            f"use_input_norm={use_input_norm} and range_norm={range_norm} already set {clash}; "
            "leave them out or build the losses by hand"
        )
    names = tuple(layer_weights)
    extractor = _shared_extractor(vgg_type, (names,), {**derived, **extractor_options})
    distance = _BASICSR_CRITERIA[criterion]
    term_weights = {"perceptual": perceptual_weight, "style": style_weight}
    losses: dict[str, PerceptualLoss | StyleLoss] = {}
    if perceptual_weight > 0:
        losses["perceptual"] = PerceptualLoss(extractor, names, layer_weights=layer_weights, distance=distance)
    if style_weight > 0:
        losses["style"] = StyleLoss(extractor, names, layer_weights=layer_weights, distance=distance)
    return LossGroup(losses, weights={name: term_weights[name] for name in losses})


def pix2pixhd(*, reduction: Reduction = "mean", **extractor_options: Any) -> PerceptualLoss:
    """pix2pixHD's ``VGGLoss``: VGG19 relu1_1 ... relu5_1, L1, layer weights 1/32, 1/16, 1/8, 1/4, 1, on
    images as they are.

    Reproduces ``VGGLoss`` and ``Vgg19`` in ``models/networks.py`` of github.com/NVIDIA/pix2pixHD,
    which feeds its [-1, 1] images to VGG19 without ImageNet normalization: hence the defaults
    ``normalize=False`` and ``input_range=(-1, 1)`` (the range only serves the out-of-range check).
    pix2pixHD multiplies the loss by ``lambda_feat`` (10) in ``models/pix2pixHD_model.py``; do the
    same (``10 * loss``). Pass ``normalize=True`` to normalize the images from ``input_range`` as
    the weights expect instead.

    Args:
        reduction: ``"mean"`` (pix2pixHD's ``L1Loss``), ``"sum"`` or ``"none"``.
        **extractor_options: ``FeatureExtractor`` keyword arguments (``weights``, ``normalize``, ...).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import pix2pixhd
        >>> loss_fn = pix2pixhd(weights=None)
        >>> fake, real = torch.rand(2, 3, 64, 64) * 2 - 1, torch.rand(2, 3, 64, 64) * 2 - 1
        >>> (10 * loss_fn(fake, real)).shape
        torch.Size([])

    References:
        Wang, Liu, Zhu, Tao, Kautz, Catanzaro (2018). High-Resolution Image Synthesis and Semantic
        Manipulation with Conditional GANs. CVPR. https://arxiv.org/abs/1711.11585
    """
    options = {"normalize": False, "input_range": (-1.0, 1.0), **extractor_options}
    return PerceptualLoss(
        "vgg19", PIX2PIXHD_LAYERS, layer_weights=PIX2PIXHD_WEIGHTS, distance="l1", reduction=reduction, **options
    )


@takes_old_resize
def dino_vits16(
    layers: tuple[str, ...] = DINO_VITS16_LAYERS,
    *,
    reduction: Reduction = "mean",
    input_size: InputSize = 224,
    **extractor_options: Any,
) -> PerceptualLoss:
    """A perceptual loss on self-supervised DINO ViT-S/16 features (timm ``vit_small_patch16_224.dino``).

    The patch tokens of every third block (``blocks.2`` ... ``blocks.11``) are laid out as maps
    (``output_format="nchw"``, the class token left out), unit-normalized over channels and compared
    by squared distance summed over channels: per layer, the mean over patches of ``2 - 2 cos``, summed
    over layers. The model takes 224x224 images, so inputs are resized to 224 unless ``input_size=None``.
    ``weights="DEFAULT"`` reads timm's pretrained tag from the Hugging Face cache (or downloads it);
    a local ``.safetensors``/``.pth`` file works too.

    Args:
        layers: the blocks whose patch tokens are compared.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        input_size: the exact size images are resized to first (``None``: as they are; formerly ``resize``,
            which still works with a FutureWarning).
        **extractor_options: ``FeatureExtractor`` keyword arguments (``weights``, ``input_range``, ...).

    Examples:
        >>> import torch
        >>> from featurehooks.losses import dino_vits16
        >>> loss_fn = dino_vits16(weights=None)  # random weights; the default reads timm's pretrained tag
        >>> loss_fn.layers
        ['blocks.2', 'blocks.5', 'blocks.8', 'blocks.11']
        >>> loss_fn(torch.rand(1, 3, 64, 64), torch.rand(1, 3, 64, 64)).shape  # resized to 224 first
        torch.Size([])

    References:
        Caron, Touvron, Misra, Jégou, Mairal, Bojanowski, Joulin (2021). Emerging Properties in
        Self-Supervised Vision Transformers. ICCV. https://arxiv.org/abs/2104.14294
    """
    options = {"output_format": "nchw", **extractor_options}
    extractor = grad_extractor(DINO_VITS16, list(layers), options)
    return PerceptualLoss(
        extractor,
        list(layers),
        layer_weights=[extractor.output_layouts[name].channels or 1 for name in layers],
        normalize_features=True,
        reduction=reduction,
        input_size=input_size,
    )
