"""The loss examples run end to end in a tiny mode (the full defaults take minutes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import load_script

pytestmark = pytest.mark.slow  # the examples run end to end


def test_style_transfer_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "stylized.png"
    load_script("examples/style_transfer.py").main(
        ["--size", "32", "--steps", "2", "--out", str(out), "--side-by-side"]
    )
    image = np.asarray(Image.open(out))
    band = image.shape[0] - 32  # the caption (which weights drew it), wrapped to the picture's width, above
    assert band > 0 and image.shape[1:] == (96, 3) and image[band:].std() > 0  # content | style | result
    assert (image[:band] < 128).all(axis=-1).any()  # the caption's text
    assert str(out) in capsys.readouterr().out


def test_training_example_reduces_the_perceptual_loss(capsys: pytest.CaptureFixture[str]) -> None:
    example = load_script("examples/train_with_perceptual_loss.py")
    first, last = example.main(["--steps", "24", "--batch", "2", "--log-every", "12"])
    assert last < first
    assert "perceptual loss fell" in capsys.readouterr().out
