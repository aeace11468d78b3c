"""What the metric functions share about their backbone: an extractor given or built, and two sets through one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import InvalidValueError
from .frechet import frechet_distance
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from .._stream import SourceSpec
    from ..extractor import FeatureExtractor

__all__ = ["distance_of_sets", "given_or_built"]


def given_or_built(
    extractor: FeatureExtractor | None,
    build: Callable[[], FeatureExtractor],
    weights: object,
    device: object,
    precision: str | None = "float32",
    **also: bool,
) -> FeatureExtractor:
    """``extractor``, or ``build()`` without one. An extractor fixes ``weights``, ``device``, ``precision`` (``None``:
    a function without one) and the arguments in ``also`` (each: whether the caller set it): given with any of them
    set, it is refused, naming them all."""
    if extractor is None:
        return build()
    fixes = {"weights": weights != "DEFAULT", **also, "device": device is not None}
    if precision is not None:
        fixes["precision"] = precision != "float32"
    if any(fixes.values()):
        names = list(fixes)
        listed, alternatives = f"{', '.join(names[:-1])} and {names[-1]}", "/".join(f"{name}=" for name in names)
        raise InvalidValueError(f"extractor= already fixes the {listed}: pass either extractor= or {alternatives}")
    return extractor


def distance_of_sets(
    real: SourceSpec | FeatureStatistics,
    fake: SourceSpec | FeatureStatistics,
    build: Callable[[], FeatureExtractor],
    statistics: Callable[[SourceSpec, FeatureExtractor], FeatureStatistics],
) -> float:
    """The Fréchet distance of two sets, each images or statistics computed earlier: one extractor for both passes,
    built only when a set is images (two sets of one random init compare)."""
    extractor = None if isinstance(real, FeatureStatistics) and isinstance(fake, FeatureStatistics) else build()

    def of(side: SourceSpec | FeatureStatistics) -> FeatureStatistics:
        return side if isinstance(side, FeatureStatistics) else statistics(side, extractor)  # type: ignore[arg-type]

    return frechet_distance(of(real), of(fake))
