"""featurehooks: named intermediate features and perceptual losses from frozen pretrained backbones."""

from . import _openmp  # noqa: F401  # first: sets the commands' OpenMP waits before anything imports torch

# isort: split
from . import functional, losses, metrics, probes
from ._capture import CapturedFeatures, capture
from ._intermediates import intermediates
from ._stream import GeneratedImages, StreamOptions
from ._version import __version__ as __version__
from .attention import AttentionMaps, attention_rollout, capture_attention
from .backbones import Preprocessing, available_backbones, load_backbone
from .dump import DumpResult, Manifest, dump_features, read_manifest
from .errors import (
    BackboneNotFoundError,
    CorruptDumpError,
    DumpLockedError,
    FeatureHooksError,
    InputNotFoundError,
    InvalidTypeError,
    InvalidValueError,
    LayerNotFoundError,
    LayerNotRunError,
    MissingDependencyError,
    NonFiniteError,
    NoSpaceError,
    OutputExistsError,
    RunFailedError,
    TraceError,
    WeightsUnavailableError,
)
from .extractor import FeatureExtractor
from .images import prepare_image, read_image
from .layers import FeatureInfo, list_layers
from .losses import FeatureMatchingLoss, LossGroup, PerceptualLoss, StyleLoss, TotalVariationLoss
from .metrics import DISTS, LPIPS, FeatureStatistics, feature_statistics, frechet_distance, kernel_inception_distance
from .probes import clip_grad, detect_nonfinite, reverse_grad, scale_grad, watch
from .viz import feature_grid, save_feature_grid

__all__ = [
    "AttentionMaps",
    "BackboneNotFoundError",
    "CapturedFeatures",
    "CorruptDumpError",
    "DISTS",
    "DumpLockedError",
    "DumpResult",
    "FeatureExtractor",
    "FeatureHooksError",
    "FeatureInfo",
    "InputNotFoundError",
    "InvalidTypeError",
    "InvalidValueError",
    "FeatureMatchingLoss",
    "FeatureStatistics",
    "GeneratedImages",
    "LPIPS",
    "LayerNotFoundError",
    "LayerNotRunError",
    "LossGroup",
    "Manifest",
    "MissingDependencyError",
    "NoSpaceError",
    "NonFiniteError",
    "OutputExistsError",
    "PerceptualLoss",
    "RunFailedError",
    "Preprocessing",
    "StreamOptions",
    "StyleLoss",
    "TotalVariationLoss",
    "TraceError",
    "WeightsUnavailableError",
    "attention_rollout",
    "available_backbones",
    "capture",
    "capture_attention",
    "clip_grad",
    "detect_nonfinite",
    "dump_features",
    "feature_grid",
    "feature_statistics",
    "frechet_distance",
    "functional",
    "intermediates",
    "kernel_inception_distance",
    "list_layers",
    "load_backbone",
    "losses",
    "metrics",
    "prepare_image",
    "probes",
    "read_image",
    "read_manifest",
    "reverse_grad",
    "save_feature_grid",
    "scale_grad",
    "watch",
]
