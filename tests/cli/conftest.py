"""What the tests of the ``featurehooks`` command share: one folder of five seeded PNGs (0.png ... 4.png)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def images(png_folder: Callable[..., Path]) -> Path:
    return png_folder(5)
