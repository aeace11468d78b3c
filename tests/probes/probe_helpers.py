"""What the probes' test files share: the watch statistics of a tensor computed directly in float64."""

from __future__ import annotations

import math

from torch import Tensor


def direct(t: Tensor) -> dict[str, float]:
    """The watch statistics of one tensor, computed directly in float64 (NaN where no value is finite)."""
    x = t.detach().double().flatten()
    finite = x[x.isfinite()]
    nonfinite = x.numel() - finite.numel()
    if not finite.numel():
        moments = dict.fromkeys(("mean", "std", "min", "max", "absmax"), math.nan)
        return {"count": x.numel(), "nonfinite": nonfinite, **moments}
    return {
        "count": x.numel(),
        "mean": finite.mean().item(),
        "std": finite.std(correction=0).item(),
        "min": finite.min().item(),
        "max": finite.max().item(),
        "absmax": finite.abs().max().item(),
        "zeros": (x == 0).double().mean().item(),
        "nonfinite": nonfinite,
    }
