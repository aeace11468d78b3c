"""The loss examples run end to end in a tiny mode (the full defaults take minutes)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow  # the examples run end to end

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_style_transfer_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stylized.png"
    load_example("style_transfer").main(["--size", "32", "--steps", "2", "--out", str(out), "--side-by-side"])
    image = np.asarray(Image.open(out))
    assert image.shape == (32, 96, 3) and image.std() > 0  # content | style | result
    assert str(out) in capsys.readouterr().out


def test_training_example_reduces_the_perceptual_loss(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("train_with_perceptual_loss")
    first, last = example.main(["--steps", "24", "--batch", "2", "--log-every", "12"])
    assert last < first
    assert "perceptual loss fell" in capsys.readouterr().out
