"""The ``dists`` command: per-pair scores equal to the Python API's, the summary line, and its one-line errors."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
from featurehooks.cli import main
from featurehooks.metrics import dists as fh_dists

pytest.importorskip("DISTS_pytorch")  # the learned alpha/beta (a dev extra)

RUN = ["--workers", "0", "-q"]


def _image(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1)[None].float() / 255


def test_dists_command_scores_each_pair_as_the_python_api(
    vgg16_cached: Path, pairs_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pairs_dirs
    out = tmp_path / "scores.csv"
    assert main(["dists", str(a), str(b), "--out", str(out), "--batch-size", "3", *RUN]) == 0
    captured = capsys.readouterr()
    assert "1 file(s) only in" in captured.err and "only_here.png" in captured.err and "sub/extra.png" in captured.err
    rows = out.read_text().splitlines()
    assert rows[0] == "name,score" and len(rows) == 5
    metric = fh.DISTS(reduction="none")
    expected = {f"{i}.png": float(metric(_image(a / f"{i}.png"), _image(b / f"{i}.png"))) for i in range(4)}
    scores = {row.split(",")[0]: float(row.split(",")[1]) for row in rows[1:]}
    assert scores == pytest.approx(expected, abs=1e-6)
    values = list(scores.values())
    summary = f"DISTS (calibrated): {statistics.fmean(values):.6g} ± {statistics.stdev(values):.3g} over 4 pairs"
    assert summary in captured.out


def test_dists_of_a_folder_with_itself_prints_zero(
    vgg16_cached: Path, pairs_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dists A A`` printed -4e-08: identical images score exactly 0."""
    a, _ = pairs_dirs
    out = tmp_path / "same.csv"
    assert main(["dists", str(a), str(a), "--out", str(out), *RUN]) == 0
    assert "DISTS (calibrated): 0 ± 0 over " in capsys.readouterr().out
    assert {row.split(",")[1] for row in out.read_text().splitlines()[1:]} == {"0.0"}


@pytest.mark.slow
def test_dists_command_takes_the_pair_options(
    pairs_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cropped.csv"
    a, b = pairs_dirs
    argv = ["dists", str(a), str(b), "--weights", "none", "--uncalibrated", "--crop", "32", "--out", str(out)]
    assert main([*argv, "--batch-pixels", "1024", *RUN]) == 0  # one pair per batch
    assert "DISTS (uncalibrated): " in capsys.readouterr().out
    torch.manual_seed(0)  # --seed 0
    metric = fh.DISTS(reduction="none", weights=None, calibrated=False)
    first = float(out.read_text().splitlines()[1].split(",")[1])
    crop = (slice(None), slice(None), slice(4, 36), slice(6, 38))  # the center 32 x 32 of 40 x 44
    assert first == pytest.approx(float(metric(_image(a / "0.png")[crop], _image(b / "0.png")[crop])), abs=1e-6)


def test_dists_command_errors_are_one_line_with_flags(
    vgg16_cached: Path,
    pairs_dirs: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = pairs_dirs
    empty = tmp_path / "empty"
    empty.mkdir()
    Image.new("RGB", (20, 20)).save(empty / "other.png")
    assert main(["dists", str(a), str(empty), *RUN]) == 2
    assert "no image in" in capsys.readouterr().err
    assert main(["dists", str(a), str(b), "--out", str(tmp_path / "nowhere" / "s.csv"), *RUN]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["dists", str(a), str(b), "--uncalibrated", "--alpha-beta", "w.pt", *RUN]) == 2
    assert "--alpha-beta was given with --uncalibrated" in capsys.readouterr().err
    small = tmp_path / "small"
    small.mkdir()
    Image.new("RGB", (16, 20)).save(small / "0.png")
    assert main(["dists", str(small), str(small), *RUN]) == 2
    err = capsys.readouterr().err
    assert "at least 17x17" in err and err.count("\n") == 1 and "Traceback" not in err
    monkeypatch.setattr(fh_dists, "package_dir", lambda name: None)  # DISTS_pytorch not installed
    assert main(["dists", str(a), str(b), *RUN]) == 2
    err = capsys.readouterr().err
    assert "pip install DISTS_pytorch" in err and "--alpha-beta path/to/weights.pt" in err and "--uncalibrated" in err


def test_dists_help_names_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["dists", "--help"])
    text = capsys.readouterr().out
    for option in ("DIR_A", "--out", "--ignore-suffix", "--resize", "--crop", "--batch-pixels", "--alpha-beta"):
        assert option in text
