"""Fréchet distance (FID on any backbone) and kernel inception distance (KID) between feature sets.

Both take ``FeatureStatistics`` or ``(N, D)`` feature vectors (tensors or numpy arrays); the Fréchet
distance also takes ``(mean, covariance)`` pairs. Everything is computed in float64 with torch alone
(no scipy). With the features of Inception-v3's pool layer these are FID and KID; with any other
backbone, layer and pool they are the same distances in that feature space, and only comparable
with numbers computed in the same one.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from ..errors import InvalidTypeError, InvalidValueError
from .statistics import FeatureStatistics, as_matrix

__all__ = ["frechet_distance", "kernel_inception_distance", "named_distance"]

Moments = Union[FeatureStatistics, Tensor, np.ndarray, Sequence[Any]]
Features = Union[FeatureStatistics, Tensor, np.ndarray]
_ASYMMETRY = 1e-6  # relative asymmetry of a given covariance beyond which it is refused, not symmetrized


def _check_pair(a: Any, b: Any) -> None:
    if isinstance(a, FeatureStatistics) and isinstance(b, FeatureStatistics):
        a.check_matches(b)


# Negative eigenvalues down to this fraction of the largest are rounding in a covariance; below, it is none.
_NEGATIVE = 1e-6


def _warn_if_singular(count: int, dim: int, side: str) -> None:
    """Warn when ``count`` vectors in ``dim`` dimensions give a singular covariance (``count <= dim``)."""
    if count <= dim:
        warnings.warn(
            f"{side} holds {count} feature vectors in {dim} dimensions: fewer than dimensions + 1, so its covariance "
            f"is singular (rank {count - 1} at most) and the Fréchet distance is dominated by the estimate's bias; "
            f"use at least {dim + 1} vectors (FID is usually reported on 10,000 or more) and compare only "
            "distances computed from equal numbers of vectors",
            UserWarning,
            stacklevel=5,  # frechet_distance -> named_distance -> _moments -> here: the warning names the caller
        )


def _moments(value: Moments, side: str) -> tuple[Tensor, Tensor]:
    """``(mean (D,), covariance (D, D))`` in float64 on the CPU, from any accepted input."""
    if isinstance(value, FeatureStatistics):
        if value.count < 2 or value.dim is None:
            raise InvalidValueError(f"{side} holds {value.count} feature vector(s); a covariance needs 2 or more")
        _warn_if_singular(value.count, value.dim, side)
        return value.mean, value.covariance
    if isinstance(value, (Tensor, np.ndarray)):
        features = as_matrix(value, side)
        if features.shape[0] < 2:
            raise InvalidValueError(f"{side} holds {features.shape[0]} feature vectors; a covariance needs 2 or more")
        _warn_if_singular(features.shape[0], features.shape[1], side)
        return features.mean(dim=0), torch.cov(features.T).reshape(features.shape[1], features.shape[1])
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        mean = as_matrix(_as_array(value[0], side)[None], f"the mean of {side}")[0]
        covariance = as_matrix(_as_array(value[1], side), f"the covariance of {side}")
        dim = mean.shape[0]
        if covariance.shape != (dim, dim):
            raise InvalidValueError(
                f"{side}: a mean of {dim} features needs a ({dim}, {dim}) covariance, got {tuple(covariance.shape)}"
            )
        asymmetry = float((covariance - covariance.T).abs().max()) if dim else 0.0
        if asymmetry > _ASYMMETRY * max(float(covariance.abs().max()), np.finfo(np.float64).tiny):
            raise InvalidValueError(f"{side}: the covariance is not symmetric (largest difference {asymmetry:.3g})")
        return mean, (covariance + covariance.T) / 2
    raise InvalidTypeError(
        f"{side} must be FeatureStatistics, (N, D) features (Tensor or numpy array) or a (mean, covariance) pair, "
        f"not {type(value).__name__}"
    )


def _as_array(value: Any, side: str) -> Tensor | np.ndarray:
    if isinstance(value, (Tensor, np.ndarray)):
        return value
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidTypeError(f"{side}: a (mean, covariance) pair must hold arrays ({exc})") from None


def _root_factor(covariance: Tensor) -> Tensor:
    """``R`` of shape ``(D, r)`` with ``covariance = R Rᵀ``: eigenvectors scaled by the square roots of
    the eigenvalues above the eigensolver's noise floor (``D * eps * largest``), ``r`` the numerical rank.

    Raises:
        InvalidValueError: an eigenvalue is negative beyond rounding: no covariance (a hand-edited file?).
    """
    values, vectors = torch.linalg.eigh(covariance)
    if not values.numel():
        return vectors
    scale = max(float(values.abs().max()), float(np.finfo(np.float64).tiny))
    if float(values[0]) < -_NEGATIVE * scale:
        raise InvalidValueError(
            f"a covariance has the eigenvalue {float(values[0]):.3g} (largest magnitude {scale:.3g}): it is not "
            "positive semi-definite, so it is no covariance of any features"
        )
    floor = max(float(values[-1]), 0.0) * covariance.shape[0] * torch.finfo(torch.float64).eps
    kept = values > floor
    return vectors[:, kept] * values[kept].sqrt()


def frechet_distance(a: Moments, b: Moments) -> float:
    """Fréchet distance between the Gaussians fitted to two feature sets: FID on any backbone.

    ``d² = ||μ_a - μ_b||² + tr(Σ_a) + tr(Σ_b) - 2 tr((Σ_a Σ_b)^½)``, in float64 without scipy.
    The last trace is the sum of the square roots of the eigenvalues of ``Σ_a^½ Σ_b Σ_a^½``, computed
    as the sum of the singular values (nuclear norm) of ``R_aᵀ R_b``, where ``Σ = R Rᵀ`` comes from a
    symmetric eigendecomposition. Eigenvalues below the eigensolver's noise floor (``D · eps`` times
    the largest) are zeros of the matrix, and dropping them keeps the result accurate where the square
    roots of rounding noise would not be.

    Singular covariances (no more vectors than dimensions: rank ``N - 1 < D``) are handled exactly: the
    distance is still well-defined, and the factors simply have fewer columns; but such a small set
    says little about its distribution, so features or statistics of ``N <= D`` vectors give a
    ``UserWarning`` naming the minimum, ``D + 1`` (a ``(mean, covariance)`` pair carries no ``N``). scipy's ``sqrtm``
    (used by pytorch-fid) is ill-conditioned there and pytorch-fid then adds ``1e-6`` to both
    diagonals, which changes the value, so the two disagree in that case; with ``N > D`` they agree to
    rounding. An estimate from ``N`` vectors is biased upward, less so as ``N`` grows, so compare only
    distances computed from equal numbers of vectors.

    Args:
        a: ``FeatureStatistics``, ``(N, D)`` features, or a ``(mean, covariance)`` pair.
        b: the same, for the other set.

    Shape:
        features: ``(N, D)`` with ``N >= 2``; mean: ``(D,)``; covariance: ``(D, D)``; output: a float.

    Returns:
        The squared Fréchet distance (the number reported as FID), clamped at 0 against rounding.

    Raises:
        InvalidValueError: different ``D``, fewer than 2 vectors, NaN/infinite values, an asymmetric
            covariance, or statistics of different backbones, layers, pools or weights.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import frechet_distance
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(100, 8), torch.randn(100, 8) + 1
        >>> round(frechet_distance(x, x), 6)
        0.0
        >>> frechet_distance(x, y) > 5
        True

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017). GANs Trained by a Two Time-Scale
        Update Rule Converge to a Local Nash Equilibrium. NeurIPS.
        Dowson, Landau (1982). The Fréchet distance between multivariate normal distributions.
        Journal of Multivariate Analysis.
    """
    return named_distance(a, b, ("a", "b"))


def named_distance(a: Moments, b: Moments, names: tuple[str, str]) -> float:
    """``frechet_distance`` whose messages call the two sets ``names`` (``evaluate``'s ``"real"`` and ``"fake"``)."""
    _check_pair(a, b)
    mean_a, cov_a = _moments(a, names[0])
    mean_b, cov_b = _moments(b, names[1])
    if mean_a.shape != mean_b.shape:
        first, second = names
        raise InvalidValueError(f"{first} has {mean_a.shape[0]} features per vector and {second} {mean_b.shape[0]}")
    diff = mean_a - mean_b
    cross = torch.linalg.svdvals(_root_factor(cov_a).T @ _root_factor(cov_b)).sum()
    distance = diff.dot(diff) + cov_a.trace() + cov_b.trace() - 2 * cross
    return max(float(distance), 0.0)


def _features(value: Features, side: str) -> Tensor:
    if isinstance(value, FeatureStatistics):
        return value.features.to(torch.float64)
    if isinstance(value, (Tensor, np.ndarray)):
        return as_matrix(value, side)
    raise InvalidTypeError(
        f"{side} must be (N, D) features (Tensor or numpy array) or FeatureStatistics that kept features, "
        f"not {type(value).__name__}"
    )


def _positive_int(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise InvalidValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def _unbiased_mmd2(x: Tensor, y: Tensor, degree: int, gamma: float, coef0: float) -> float:
    """Unbiased MMD² of two samples under ``k(x, y) = (gamma x·y + coef0) ** degree`` (diagonals left out)."""
    m, n = x.shape[0], y.shape[0]
    k_xx = (x @ x.T * gamma + coef0) ** degree
    k_yy = (y @ y.T * gamma + coef0) ** degree
    k_xy = (x @ y.T * gamma + coef0) ** degree
    within_x = (k_xx.sum() - k_xx.diagonal().sum()) / (m * (m - 1))
    within_y = (k_yy.sum() - k_yy.diagonal().sum()) / (n * (n - 1))
    return float(within_x + within_y - 2 * k_xy.sum() / (m * n))


def kernel_inception_distance(
    a: Features,
    b: Features,
    *,
    subsets: int = 100,
    subset_size: int = 1000,
    degree: int = 3,
    gamma: float | None = None,
    coef0: float = 1.0,
    seed: int = 0,
) -> tuple[float, float]:
    """Kernel inception distance: the unbiased MMD² under a polynomial kernel, averaged over random subsets.

    Each of ``subsets`` rounds draws ``subset_size`` vectors from each set (without replacement) and
    computes the unbiased estimate of the squared maximum mean discrepancy with
    ``k(x, y) = (gamma x·y + coef0) ** degree``, ``gamma = 1 / D`` by default: the standard KID. Its
    expectation does not depend on the subset size; smaller subsets only make it noisier. A set with
    fewer than ``subset_size`` vectors is refused, naming the minimum (as torchmetrics does): pass a
    smaller ``subset_size`` for small sets. When both sets have exactly ``subset_size`` vectors every
    subset is the whole set, so one round is computed (std 0). The
    estimate is unbiased, so it can be slightly negative for sets from one distribution.

    Computed in float64 on the CPU. ``FeatureStatistics`` take part with the sample they kept
    (``keep=N``); KID needs vectors, not moments.

    Args:
        a: ``(N_a, D)`` features, or ``FeatureStatistics`` built with ``keep > 0``.
        b: the same, for the other set.
        subsets: how many random subsets to average over.
        subset_size: vectors per subset and set (1000 as in Bińkowski et al.); each set needs at least as many.
        degree: the polynomial kernel's degree.
        gamma: the kernel's scale of ``x·y``; ``None`` for ``1 / D``.
        coef0: the kernel's constant.
        seed: seed of the subset draws.

    Shape:
        features: ``(N, D)`` with ``N >= 2``; output: ``(mean, std)`` of the per-subset estimates
        (``std`` over subsets, ddof 0).

    Raises:
        InvalidValueError: different ``D``, fewer than 2 vectors or fewer than ``subset_size``, NaN/infinite
            values, statistics that kept no vectors or come from other features, or bad options.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import kernel_inception_distance
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(200, 16), torch.randn(200, 16) + 0.5
        >>> mean, std = kernel_inception_distance(x, y, subsets=10, subset_size=100)
        >>> mean > 0
        True

    References:
        Bińkowski, Sutherland, Arbel, Gretton (2018). Demystifying MMD GANs. ICLR.
        Gretton, Borgwardt, Rasch, Schölkopf, Smola (2012). A Kernel Two-Sample Test. JMLR.
    """
    subsets = _positive_int(subsets, "subsets", 1)
    subset_size = _positive_int(subset_size, "subset_size", 2)
    degree = _positive_int(degree, "degree", 1)
    seed = _positive_int(seed, "seed", 0)
    if gamma is not None and not (isinstance(gamma, (int, float)) and np.isfinite(gamma) and gamma > 0):
        raise InvalidValueError(f"gamma must be a positive number or None (1 / D), got {gamma!r}")
    if isinstance(coef0, bool) or not isinstance(coef0, (int, float)) or not np.isfinite(coef0):
        raise InvalidValueError(f"coef0 must be a finite number, got {coef0!r}")
    _check_pair(a, b)
    x, y = _features(a, "a"), _features(b, "b")
    if x.shape[1] != y.shape[1]:
        raise InvalidValueError(f"a has {x.shape[1]} features per vector and b {y.shape[1]}")
    if min(x.shape[0], y.shape[0]) < 2:
        raise InvalidValueError(f"KID needs at least 2 feature vectors in each set, got {x.shape[0]} and {y.shape[0]}")
    side, count = min((("a", x.shape[0]), ("b", y.shape[0])), key=lambda item: item[1])
    if count < subset_size:
        raise InvalidValueError(
            f"{side} holds {count} feature vectors, fewer than subset_size={subset_size}: KID draws subsets of "
            f"subset_size vectors from each set, so each needs at least {subset_size}; pass "
            f"subset_size={count} or less (at least 2) for sets this small"
        )
    size = subset_size
    scale = float(gamma) if gamma is not None else 1.0 / x.shape[1]
    if size == x.shape[0] == y.shape[0]:
        return _unbiased_mmd2(x, y, degree, scale, float(coef0)), 0.0
    generator = torch.Generator().manual_seed(seed)
    estimates = torch.tensor(
        [
            _unbiased_mmd2(
                x[torch.randperm(x.shape[0], generator=generator)[:size]],
                y[torch.randperm(y.shape[0], generator=generator)[:size]],
                degree,
                scale,
                float(coef0),
            )
            for _ in range(subsets)
        ],
        dtype=torch.float64,
    )
    return float(estimates.mean()), float(estimates.std(correction=0))
