"""What the tests of the ``featurehooks`` command share: one folder of five seeded PNGs (0.png ... 4.png), and two
folders of image pairs for the paired metrics (lpips, dists)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="module")
def images(png_folder: Callable[..., Path]) -> Path:
    return png_folder(5)


@pytest.fixture(scope="module")
def pairs_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two folders of four pairs of two sizes (0-3.png), one file only in A, and one only in B (in a subfolder)."""
    root = tmp_path_factory.mktemp("pairs_dirs")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir()
        for i, size in enumerate([(40, 44), (40, 44), (36, 52), (36, 52)]):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    (root / "a" / "only_here.png").write_bytes((root / "a" / "0.png").read_bytes())
    (root / "b" / "sub").mkdir()
    (root / "b" / "sub" / "extra.png").write_bytes((root / "b" / "0.png").read_bytes())
    return root / "a", root / "b"
