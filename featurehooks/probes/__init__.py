"""Probes on the one hook engine: activation and gradient statistics, non-finite sentinels, gradient modifiers.

Unlike ``FeatureExtractor``, probes attach to a model you train: it is never copied or frozen, and
every hook is removed when the block ends (also after an exception).

Examples:
    >>> import torch
    >>> from featurehooks import probes
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> with probes.watch(net) as w, probes.detect_nonfinite(net), probes.clip_grad(net[0], 0.1):
    ...     net(torch.randn(16, 4)).pow(2).mean().backward()
    >>> [(row.name, row.kind) for row in w.summary()]
    [('0', 'output'), ('0', 'grad'), ('2', 'output'), ('2', 'grad')]
"""

from .modifiers import GradModifier, GradTarget, clip_grad, reverse_grad, scale_grad
from .nonfinite import INPUT, OUTPUT, NonFiniteDetector, detect_nonfinite
from .watch import STATS, Watch, WatchOptions, WatchRow, watch

__all__ = [
    "INPUT",
    "OUTPUT",
    "STATS",
    "GradModifier",
    "GradTarget",
    "NonFiniteDetector",
    "Watch",
    "WatchOptions",
    "WatchRow",
    "clip_grad",
    "detect_nonfinite",
    "reverse_grad",
    "scale_grad",
    "watch",
]
