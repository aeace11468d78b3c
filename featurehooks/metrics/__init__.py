"""Perceptual metrics: calibrated LPIPS, and Fréchet distance and KID from streaming statistics of any backbone."""

from .frechet import frechet_distance, kernel_inception_distance
from .lpips import LPIPS, find_heads, load_heads
from .pairs import BATCH_PIXELS, ImagePair, pair_files, score_pairs
from .statistics import (
    FeatureOrigin,
    FeatureStatistics,
    feature_statistics,
    feature_statistics_by_layer,
    statistics_from_dump,
)

__all__ = [
    "BATCH_PIXELS",
    "LPIPS",
    "FeatureOrigin",
    "FeatureStatistics",
    "ImagePair",
    "feature_statistics",
    "feature_statistics_by_layer",
    "find_heads",
    "frechet_distance",
    "kernel_inception_distance",
    "load_heads",
    "pair_files",
    "score_pairs",
    "statistics_from_dump",
]
