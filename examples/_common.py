"""What the examples share: pretrained weights when they can be had, else seeded random ones (offline runs)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch

import featurehooks as fh

T = TypeVar("T")


def pretrained_or_seeded(build: Callable[..., T], model: str) -> T:
    """``build()`` with its default pretrained weights, or, where ``model``'s weights are not available offline,
    ``build(weights=None)`` after seeding torch, so that an example runs anywhere (it says so in one line)."""
    try:
        return build()
    except fh.WeightsUnavailableError as exc:
        print(
            f"note: pretrained {model} weights are not available offline ({type(exc).__name__}); "
            "using seeded random weights",
            file=sys.stderr,
        )
        torch.manual_seed(0)
        return build(weights=None)
