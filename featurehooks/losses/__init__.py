"""Losses on features of frozen backbones: perceptual, style, feature matching, total variation, presets.

Thin modules over ``featurehooks.functional``. Feature losses hold a ``FeatureExtractor``
(frozen, eval, outside ``state_dict()``); several losses can share one and one forward
(``LossGroup``, ``from_features``).
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
