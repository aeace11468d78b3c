"""Perceptual metrics: calibrated LPIPS, and Fréchet distance and KID from streaming statistics of any backbone.

Examples:
    >>> import torch
    >>> from featurehooks import metrics
    >>> _ = torch.manual_seed(0)
    >>> real, fake = metrics.FeatureStatistics(keep=200), metrics.FeatureStatistics(keep=200)
    >>> _ = real.update(torch.randn(200, 16))  # the pooled features of a batch of images, say
    >>> _ = fake.update(torch.randn(200, 16) + 0.5)
    >>> metrics.frechet_distance(real, fake) > 1
    True
    >>> mean, std = metrics.kernel_inception_distance(real, fake, subsets=10, subset_size=100)
"""

from .collect import feature_statistics, feature_statistics_by_layer, statistics_from_dump
from .dists import DISTS
from .fid import FID_LAYERS, fid_extractor, fid_statistics, load_mu_sigma
from .frechet import frechet_distance, kernel_inception_distance
from .interop import PooledFeatures
from .lpips import LPIPS, find_heads, load_heads
from .pairs import BATCH_PIXELS, ImagePair, pair_files, score_pairs
from .prdc import PRDC, Manifold, precision_recall
from .sample_size import FDInfinity, fd_bootstrap, fd_infinity
from .statistics import FeatureOrigin, FeatureStatistics

__all__ = [
    "BATCH_PIXELS",
    "DISTS",
    "FDInfinity",
    "FID_LAYERS",
    "LPIPS",
    "PRDC",
    "FeatureOrigin",
    "FeatureStatistics",
    "ImagePair",
    "Manifold",
    "PooledFeatures",
    "fd_bootstrap",
    "fd_infinity",
    "feature_statistics",
    "feature_statistics_by_layer",
    "fid_extractor",
    "fid_statistics",
    "find_heads",
    "frechet_distance",
    "kernel_inception_distance",
    "load_heads",
    "load_mu_sigma",
    "pair_files",
    "precision_recall",
    "score_pairs",
    "statistics_from_dump",
]
