"""featurehooks: named intermediate features and perceptual losses from frozen pretrained backbones."""

from . import functional, losses
from ._hooks import RepeatedCallError
from .backbones import Preprocessing, available_backbones, load_backbone
from .dump import DumpResult, dump_features, read_manifest
from .errors import BackboneNotFoundError, FeatureHooksError, LayerNotFoundError, WeightsUnavailableError
from .extractor import FeatureExtractor, capture
from .layers import FeatureInfo, list_layers
from .losses import FeatureMatchingLoss, LossGroup, PerceptualLoss, StyleLoss, TotalVariationLoss
from .viz import feature_grid, save_feature_grid

__version__ = "0.1.0"

__all__ = [
    "BackboneNotFoundError",
    "DumpResult",
    "FeatureExtractor",
    "FeatureHooksError",
    "FeatureInfo",
    "FeatureMatchingLoss",
    "LayerNotFoundError",
    "LossGroup",
    "PerceptualLoss",
    "Preprocessing",
    "RepeatedCallError",
    "StyleLoss",
    "TotalVariationLoss",
    "WeightsUnavailableError",
    "available_backbones",
    "capture",
    "dump_features",
    "feature_grid",
    "functional",
    "list_layers",
    "load_backbone",
    "losses",
    "read_manifest",
    "save_feature_grid",
]
