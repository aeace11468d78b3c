"""A Fréchet distance and the number of images it was estimated from: FD∞ and a bootstrap interval.

An FD estimated from ``N`` vectors is biased upward by a term nearly proportional to ``1 / N`` (Chong & Forsyth
2020), so FIDs of 5,000 and 50,000 images of one model differ by much more than models do. ``fd_infinity`` fits
``FD_N = FD∞ + slope / N`` to the distances of random subsets and reports the value at ``1 / N = 0``;
``fd_bootstrap`` gives the spread of the distance over resamples of the images.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidValueError
from .frechet import Features, Moments, frechet_distance
from .statistics import FeatureStatistics, as_matrix

__all__ = ["FDInfinity", "fd_bootstrap", "fd_infinity"]


@dataclass(frozen=True)
class FDInfinity:
    """The extrapolated Fréchet distance and its fit: ``distances[i]`` was measured on ``sizes[i]`` vectors, and
    ``value + slope / N`` is the least-squares line through them.

    Examples:
        >>> from featurehooks.metrics import FDInfinity
        >>> fit = FDInfinity(value=4.0, slope=5000.0, sizes=(5000, 50000), distances=(5.0, 4.1))
        >>> fit.value + fit.slope / 50000
        4.1
    """

    value: float
    slope: float
    sizes: tuple[int, ...]
    distances: tuple[float, ...]


def _all_vectors(features: Features, reference: Moments) -> torch.Tensor:
    """``(N, D)`` float64 of every vector of ``features``; statistics must have kept them all."""
    if isinstance(features, FeatureStatistics):
        if isinstance(reference, FeatureStatistics):
            reference.check_matches(features)
        kept = features.features  # raises for keep=0
        if kept.shape[0] < features.count:
            raise InvalidValueError(
                f"the statistics kept {kept.shape[0]} of their {features.count} vectors; resampling needs every "
                f"one: compute them with keep >= {features.count}"
            )
        return kept.to(torch.float64)
    return as_matrix(features, "features")


def _distances(reference: Moments, subsets: Iterable[torch.Tensor]) -> list[float]:
    """The Fréchet distance of each subset to ``reference``; a warning the subsets share is given once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distances = [frechet_distance(reference, subset) for subset in subsets]
    for message in dict.fromkeys(str(warning.message) for warning in caught):
        warnings.warn(message, UserWarning, stacklevel=3)
    return distances


def fd_infinity(
    reference: Moments, features: Features, *, points: int = 15, smallest: int = 5000, seed: int = 0
) -> FDInfinity:
    """FD∞ (Chong & Forsyth 2020): the Fréchet distance from ``reference`` extrapolated to infinitely many vectors.

    As the authors' code computes it: ``points`` subset sizes evenly spaced from ``smallest`` to ``N`` (rounded
    down to integers), a random subset of each size (a fresh permutation each, seeded), its Fréchet distance to
    ``reference``, and the least-squares line in ``1 / N``; FD∞ is its intercept. The reference is used whole.

    Args:
        reference: the fixed side (``FeatureStatistics``, ``(N, D)`` features or a ``(mean, covariance)`` pair),
            usually the real images.
        features: every vector of the other side, ``(N, D)``, or ``FeatureStatistics`` with ``keep >= count``.
        points: how many subset sizes (15 in the paper).
        smallest: the smallest subset (5000 in the paper, for 50,000 images); below ``N``.
        seed: seed of the subsets.

    Raises:
        InvalidValueError: ``smallest`` not below ``N``, fewer than 2 points, statistics that did not keep
            every vector, or features that do not match.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import fd_infinity
        >>> _ = torch.manual_seed(0)
        >>> fit = fd_infinity(torch.randn(4000, 8), torch.randn(2000, 8) + 0.1, points=5, smallest=200)
        >>> fit.sizes, fit.value < fit.distances[0]
        ((200, 650, 1100, 1550, 2000), True)

    References:
        Chong, Forsyth (2020). Effectively Unbiased FID and Inception Score and Where to Find Them. CVPR.
    """
    vectors = _all_vectors(features, reference)
    count = vectors.shape[0]
    if isinstance(points, bool) or not isinstance(points, int) or points < 2:
        raise InvalidValueError(f"points must be an int >= 2, got {points!r}")
    if isinstance(smallest, bool) or not isinstance(smallest, int) or not 2 <= smallest < count:
        raise InvalidValueError(
            f"smallest must be an int from 2 to below the {count} vectors, got {smallest!r}; FD∞ extrapolates "
            "from subsets smaller than the whole set (the paper: 5000 to 50,000)"
        )
    sizes = np.linspace(smallest, count, points).astype(np.int64)
    generator = torch.Generator().manual_seed(seed)
    distances = _distances(
        reference, (vectors[torch.randperm(count, generator=generator)[:size]] for size in sizes.tolist())
    )
    slope, value = np.polyfit(1.0 / sizes, np.asarray(distances), 1)
    return FDInfinity(float(value), float(slope), tuple(sizes.tolist()), tuple(distances))


def fd_bootstrap(
    reference: Moments, features: Features, *, rounds: int = 100, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap interval of the Fréchet distance from ``reference`` to ``features``: ``rounds``
    resamples of the vectors of ``features`` with replacement (``N`` of them, seeded), the ``level`` central
    interval of their distances. It shows the spread due to which images were drawn, at this ``N``; it does
    not remove the ``1 / N`` bias (``fd_infinity`` does).

    Args:
        reference: the fixed side, as for ``frechet_distance``.
        features: every vector of the resampled side, ``(N, D)``, or ``FeatureStatistics`` with ``keep >= count``.
        rounds: how many resamples.
        level: the interval's coverage, in (0, 1).
        seed: seed of the resamples.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import fd_bootstrap, frechet_distance
        >>> _ = torch.manual_seed(0)
        >>> real, fake = torch.randn(500, 4), torch.randn(500, 4) + 0.5
        >>> low, high = fd_bootstrap(real, fake, rounds=50)
        >>> low < high
        True
    """
    vectors = _all_vectors(features, reference)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise InvalidValueError(f"rounds must be an int >= 2, got {rounds!r}")
    if not 0 < level < 1:
        raise InvalidValueError(f"level must be in (0, 1), got {level!r}")
    count = vectors.shape[0]
    generator = torch.Generator().manual_seed(seed)
    distances = _distances(
        reference, (vectors[torch.randint(count, (count,), generator=generator)] for _ in range(rounds))
    )
    low, high = np.quantile(distances, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)
