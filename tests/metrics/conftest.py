"""What the metrics' tests share: the seeded torchvision trunks of LPIPS, where featurehooks and lpips read them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# LPIPS's nets and the torchvision model of each trunk
LPIPS_TRUNKS = {"alex": "alexnet", "vgg": "vgg16", "squeeze": "squeezenet1_1"}


@pytest.fixture(scope="module")
def lpips_trunks(seeded_weights: Callable[..., Path]) -> None:
    """Seeded checkpoints of the three LPIPS trunks in the torch cache, where torchvision, and so lpips
    (``pretrained=True``), read them."""
    for name in LPIPS_TRUNKS.values():
        seeded_weights(name)
