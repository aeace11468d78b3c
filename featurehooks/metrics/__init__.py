"""Perceptual metrics on the features of any backbone: Fréchet distance and KID from streaming statistics."""

from .frechet import frechet_distance, kernel_inception_distance
from .statistics import (
    FeatureOrigin,
    FeatureStatistics,
    feature_statistics,
    feature_statistics_by_layer,
    statistics_from_dump,
)

__all__ = [
    "FeatureOrigin",
    "FeatureStatistics",
    "feature_statistics",
    "feature_statistics_by_layer",
    "frechet_distance",
    "kernel_inception_distance",
    "statistics_from_dump",
]
