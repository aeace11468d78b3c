"""The metric commands: ``fd`` and ``stats`` against the library's own functions, and their one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
from featurehooks.cli import main
from featurehooks.metrics import FeatureStatistics, feature_statistics, frechet_distance, kernel_inception_distance

MODEL = ["--backbone", "resnet18", "--layers", "layer4", "--weights", "none", "--resize", "36", "--crop", "32"]
RUN = ["--workers", "0", "-q"]


def _folder(root: Path, name: str, shift: int) -> Path:
    folder = root / name
    folder.mkdir()
    rng = np.random.default_rng(shift)
    for i in range(6):
        pixels = np.clip(rng.integers(0, 200, (40, 44, 3)) + shift, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fd_sets")
    return _folder(root, "a", 0), _folder(root, "b", 50)


def _library_stats(folder: Path, keep: int = 0) -> FeatureStatistics:
    torch.manual_seed(0)  # the CLI's --seed 0 random init
    ext = fh.FeatureExtractor("resnet18", ["layer4"], weights=None)
    return feature_statistics(ext, folder, resize_size=36, crop_size=32, num_workers=0, keep=keep)


def test_fd_prints_the_libraries_distance_and_kid(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = sets
    assert main(["fd", str(a), str(b), *MODEL, *RUN, "--kid"]) == 0
    out = capsys.readouterr().out
    expected_a, expected_b = _library_stats(a, keep=10_000), _library_stats(b, keep=10_000)
    fd = frechet_distance(expected_a, expected_b)
    kid, _ = kernel_inception_distance(expected_a, expected_b)
    assert out.startswith("layer4: FD ") and "(A: 6 images, B: 6 images)" in out
    printed_fd = float(out.split("FD ")[1].split(",")[0])
    printed_kid = float(out.split("KID ")[1].split(" ")[0])
    assert printed_fd == pytest.approx(fd, rel=1e-5) and printed_fd > 0
    assert printed_kid == pytest.approx(kid, rel=1e-5)


def test_stats_file_stands_in_for_its_images(
    sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sets
    reference = tmp_path / "a.npz"
    assert main(["stats", str(a), "--out", str(reference), *MODEL, *RUN]) == 0
    saved = FeatureStatistics.load(reference)
    torch.testing.assert_close(saved.covariance, _library_stats(a).covariance)
    capsys.readouterr()
    assert main(["fd", str(reference), str(b), *MODEL, *RUN]) == 0
    from_file = capsys.readouterr().out
    assert main(["fd", str(a), str(b), *MODEL, *RUN]) == 0
    assert from_file == capsys.readouterr().out


def test_fd_errors_are_one_line(sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = sets
    reference = tmp_path / "a.npz"
    assert main(["stats", str(a), "--out", str(reference), *MODEL, *RUN]) == 0
    capsys.readouterr()
    other_layer = [*MODEL[:3], "layer3", *MODEL[4:]]
    assert main(["fd", str(reference), str(b), *other_layer, *RUN]) == 2
    assert "holds statistics of layer 'layer4'" in capsys.readouterr().err
    two_layers = ["stats", str(a), "--out", str(tmp_path / "two.npz"), *MODEL[:4], "layer3", *MODEL[4:], *RUN]
    assert main(two_layers) == 2
    assert "one layer" in capsys.readouterr().err
    assert main(["fd", str(a), str(b), *MODEL, "--pool", "none", *RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert main(["fd", str(tmp_path / "nowhere"), str(b), *MODEL, *RUN]) == 2
