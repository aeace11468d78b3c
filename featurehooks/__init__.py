"""featurehooks: named intermediate features and perceptual losses from frozen pretrained backbones."""

from .backbones import Preprocessing, available_backbones, load_backbone
from .errors import BackboneNotFoundError, FeatureHooksError, LayerNotFoundError, WeightsUnavailableError
from .extractor import FeatureExtractor, capture
from .layers import FeatureInfo, list_layers

__version__ = "0.1.0"

__all__ = [
    "BackboneNotFoundError",
    "FeatureExtractor",
    "FeatureHooksError",
    "FeatureInfo",
    "LayerNotFoundError",
    "Preprocessing",
    "WeightsUnavailableError",
    "available_backbones",
    "capture",
    "list_layers",
    "load_backbone",
]
