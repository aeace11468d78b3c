"""Exceptions raised for user input: each names what was wrong and what would be right."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FeatureHooksError(Exception):
    """Base class of every error featurehooks raises on purpose."""


class LayerNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A requested layer name is neither an alias nor a module path of the backbone."""


class BackboneNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A backbone name is not in the registry (torchvision) or not known to timm."""


class TraceError(FeatureHooksError, RuntimeError):
    """A model could not run the shape-only forward on the meta device that describes its layers."""


class WeightsUnavailableError(FeatureHooksError, LookupError):
    """Pretrained weights are neither cached nor downloadable, or a weights name is unknown."""


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Return the ``n`` candidates closest to ``name``, best first, for did-you-mean messages."""
    candidates = list(dict.fromkeys(candidates))
    found = difflib.get_close_matches(name, candidates, n=n, cutoff=0.0)
    return found


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Format the closest candidates as ``did you mean 'a', 'b' or 'c'?``."""
    found = closest(name, candidates)
    if not found:
        return ""
    quoted = [repr(c) for c in found]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"did you mean {listed}?"
