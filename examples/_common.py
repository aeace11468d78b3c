"""What the examples share: pretrained weights when they can be had, else seeded random ones (offline runs), the
caption line that tells which of the two drew a picture, and one-line errors for bad arguments."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch

import featurehooks as fh

T = TypeVar("T")


def run(main: Callable[[], object]) -> None:
    """Run an example's ``main``; as the ``featurehooks`` command does, a featurehooks error about the input (a
    precision this machine cannot run, an unknown model or layer) ends it with one line and exit status 2, a run
    that failed (a file that cannot be read or written) with one line and status 1; anything else is a bug and
    keeps its traceback."""
    try:
        main()
    except (fh.RunFailedError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except fh.FeatureHooksError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def pretrained_or_seeded(build: Callable[..., T], model: str, seed: int = 0) -> T:
    """``build()`` with its default pretrained weights, or, where ``model``'s weights are not available offline,
    ``build(weights=None)`` after seeding torch with ``seed``, so that an example runs anywhere (it says so in one
    line)."""
    try:
        return build()
    except fh.WeightsUnavailableError as exc:
        print(
            f"note: pretrained {model} weights are not available offline ({type(exc).__name__}); "
            f"using seeded random weights (seed {seed})",
            file=sys.stderr,
        )
        torch.manual_seed(seed)
        return build(weights=None)


def weights_caption(model: str, weights: str | None, seed: int = 0) -> str:
    """The line of a picture's caption that names the weights that drew it (``extractor.weights``), or, for random
    weights (None), says so: such a picture shows the mechanics, not what the trained ``model`` sees.

    >>> weights_caption("VGG16", "VGG16_Weights.IMAGENET1K_V1")
    'weights VGG16_Weights.IMAGENET1K_V1'
    >>> weights_caption("VGG16", None)
    'RANDOM weights (seed 0): shows the mechanics, not what a trained VGG16 sees'
    """
    if weights:
        return f"weights {weights}"
    return f"RANDOM weights (seed {seed}): shows the mechanics, not what a trained {model} sees"
