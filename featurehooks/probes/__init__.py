"""Probes on the one hook engine: activation and gradient statistics, non-finite sentinels, gradient modifiers.

Unlike ``FeatureExtractor``, probes attach to a model you train: it is never copied or frozen, and
every hook is removed when the block ends (also after an exception).
"""

from .modifiers import GradModifier, GradTarget, clip_grad, reverse_grad, scale_grad
from .nonfinite import INPUT, OUTPUT, NonFiniteDetector, detect_nonfinite
from .watch import STATS, Watch, WatchRow, watch

__all__ = [
    "INPUT",
    "OUTPUT",
    "STATS",
    "GradModifier",
    "GradTarget",
    "NonFiniteDetector",
    "Watch",
    "WatchRow",
    "clip_grad",
    "detect_nonfinite",
    "reverse_grad",
    "scale_grad",
    "watch",
]
