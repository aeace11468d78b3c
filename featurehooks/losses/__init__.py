"""Losses on features of frozen backbones: perceptual, style, feature matching, total variation, presets.

Thin modules over ``featurehooks.functional``. Feature losses hold a ``FeatureExtractor``
(frozen, eval, outside ``state_dict()``); several losses can share one and one forward
(``LossGroup``, ``from_features``).

Examples:
    >>> import torch
    >>> from featurehooks import losses
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())  # or a name: "vgg16"
    >>> group = losses.LossGroup(
    ...     {"content": losses.PerceptualLoss(net, ["1"]), "tv": losses.TotalVariationLoss()}, weights={"tv": 0.1}
    ... )
    >>> output = torch.rand(2, 3, 32, 32, requires_grad=True)
    >>> group(output, torch.rand(2, 3, 32, 32)).backward()
    >>> output.grad.shape
    torch.Size([2, 3, 32, 32])
"""

from ._base import FeatureLoss
from .group import LossGroup
from .matching import FeatureMatchingLoss
from .perceptual import PerceptualLoss
from .presets import basicsr, dino_vits16, gatys2016, johnson2016, neural_style_tutorial, pix2pixhd
from .style import StyleLoss
from .variation import TotalVariationLoss

__all__ = [
    "FeatureLoss",
    "FeatureMatchingLoss",
    "LossGroup",
    "PerceptualLoss",
    "StyleLoss",
    "TotalVariationLoss",
    "basicsr",
    "dino_vits16",
    "gatys2016",
    "johnson2016",
    "neural_style_tutorial",
    "pix2pixhd",
]
