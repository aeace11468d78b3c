"""The loss examples run end to end in a tiny mode (the full defaults take minutes), and a short run of each under
``--precision bf16`` ends near its float32 run (docs/performance.md, "Training under bf16")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import load_script, needs_cpu_bf16

pytestmark = pytest.mark.slow  # the examples run end to end

BF16_MARGIN = 0.05  # relative difference of the final losses; these runs measured 1.0% (style) and 1.0% (training)


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


def bf16_against_float32(final_loss: Callable[[str], float]) -> float:
    """The relative difference of a run's final loss under ``precision="bf16"`` from the same run's in float32."""
    full, low = final_loss("float32"), final_loss("bf16")
    return abs(low - full) / full


@needs_cpu_bf16
def test_style_transfer_under_bf16_ends_near_float32(tmp_path: Path) -> None:
    example = load_script("examples/style_transfer.py")
    argv = ["--size", "32", "--steps", "20", "--out", str(tmp_path / "out.png")]
    difference = bf16_against_float32(lambda precision: example.main([*argv, "--precision", precision]))
    assert 0 < difference < BF16_MARGIN, difference  # 0: bf16 never reached the backbone


@needs_cpu_bf16
def test_training_under_bf16_ends_near_float32() -> None:
    example = load_script("examples/train_with_perceptual_loss.py")
    argv = ["--steps", "24", "--batch", "2", "--log-every", "24"]
    difference = bf16_against_float32(lambda precision: example.main([*argv, "--precision", precision])[1])
    assert 0 < difference < BF16_MARGIN, difference
