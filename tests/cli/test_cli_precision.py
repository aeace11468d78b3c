"""``--precision`` on every command that builds a backbone: forwarded to the library, refused in one line where the
device cannot run it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from featurehooks import FeatureExtractor, dump_features
from featurehooks.cli import main

from helpers import bf16_anywhere

SIZES = ["--resize", "36", "--crop", "32", "--workers", "0", "--batch-size", "3", "-q"]
MODEL = ["--backbone", "resnet18", "--layers", "layer1", "--weights", "none"]


@pytest.mark.parametrize("command", ["extract", "show", "stats", "fd", "lpips", "dists", "fid"])
def test_every_model_command_takes_precision(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--precision {float32,bf16,fp16}" in capsys.readouterr().out


@bf16_anywhere
def test_extract_in_bf16_equals_the_library(images: Path, tmp_path: Path) -> None:
    assert main(["extract", str(images), "--out", str(tmp_path / "cli"), *MODEL, *SIZES, "--precision", "bf16"]) == 0
    torch.manual_seed(0)
    ext = FeatureExtractor("resnet18", ["layer1"], weights=None, precision="bf16")
    dump_features(
        ext, images, tmp_path / "lib", batch_size=3, num_workers=0, resize_size=36, crop_size=32, progress=False
    )
    for name in ("layer1.npy", "manifest.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name
    assert json.loads((tmp_path / "cli" / "manifest.json").read_text())["precision"] == "bf16"
    assert np.load(tmp_path / "cli" / "layer1.npy").dtype == np.float32  # stored as --dtype says (float32)


@pytest.mark.slow
@bf16_anywhere
def test_stats_and_lpips_in_bf16_are_close_to_float32(
    images: Path, png_folder: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for precision in ("float32", "bf16"):
        out = str(tmp_path / f"{precision}.npz")
        assert (
            main(["stats", str(images), "--out", out, *MODEL, "--pool", "avg", *SIZES, "--precision", precision]) == 0
        )
    low, full = (np.load(tmp_path / f"{p}.npz")["mu"] for p in ("bf16", "float32"))
    assert np.abs(low - full).max() < 0.02 * np.abs(full).max()
    capsys.readouterr()
    others = png_folder(5, seed=1)
    means = []
    for precision in ("float32", "bf16"):
        argv = [
            "lpips",
            str(images),
            str(others),
            "--weights",
            "none",
            "--workers",
            "0",
            "-q",
            "--precision",
            precision,
        ]
        assert main(argv) == 0
        means.append(float(capsys.readouterr().out.split(": ")[1].split(" ")[0]))
    assert means[1] == pytest.approx(means[0], rel=0.02) and means[0] > 0


def test_fp16_on_a_cpu_without_it_exits_2_before_any_work(images: Path, tmp_path: Path, capsys) -> None:
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("this CPU has native float16 kernels: fp16 runs")
    argv = [
        "extract",
        str(images),
        "--out",
        str(tmp_path / "o"),
        *MODEL,
        *SIZES,
        "--device",
        "cpu",
        "--precision",
        "fp16",
    ]
    assert main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("featurehooks: error: --precision fp16 cannot run on cpu") and "\n" not in line
    assert not (tmp_path / "o").exists()
