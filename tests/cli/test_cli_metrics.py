"""The metric commands: ``fd`` and ``stats`` against the library's own functions, and their one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
from featurehooks.cli import main
from featurehooks.cli._common import is_statistics_file
from featurehooks.metrics import (
    FeatureStatistics,
    fd_bootstrap,
    fd_infinity,
    feature_statistics,
    frechet_distance,
    kernel_inception_distance,
    precision_recall,
)

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
    assert main(["fd", str(a), str(b), *MODEL, *RUN, "--kid", "--kid-subset-size", "6"]) == 0
    out = capsys.readouterr().out
    expected_a, expected_b = _library_stats(a, keep=10_000), _library_stats(b, keep=10_000)
    fd = frechet_distance(expected_a, expected_b)
    kid, _ = kernel_inception_distance(expected_a, expected_b, subset_size=6)
    assert out.startswith("layer4: FD ") and "(A: 6 images, B: 6 images)" in out
    printed_fd = float(out.split("FD ")[1].split(",")[0])
    printed_kid = float(out.split("KID ")[1].split(" ")[0])
    assert printed_fd == pytest.approx(fd, rel=1e-5) and printed_fd > 0
    assert printed_kid == pytest.approx(kid, rel=1e-5)


def test_fd_bootstrap_and_infinity_print_the_libraries_numbers(
    sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sets
    options = ["--bootstrap", "4", "--infinity", "--infinity-smallest", "3"]
    assert main(["fd", str(a), str(b), *MODEL, *RUN, *options]) == 0
    out, err = capsys.readouterr()
    assert err.count("b holds 6 feature vectors") == 1  # once, not once per resample
    expected_a, expected_b = _library_stats(a), _library_stats(b, keep=6)
    low, high = fd_bootstrap(expected_a, expected_b, rounds=4)
    infinity = fd_infinity(expected_a, expected_b, smallest=3).value
    interval = out.split("[")[1].split("]")[0].split(", ")
    assert [float(v) for v in interval] == pytest.approx([low, high], rel=1e-5)
    assert "(95% bootstrap, 4 rounds)" in out
    assert float(out.split("FD∞ ")[1].split(" ")[0]) == pytest.approx(infinity, rel=1e-5)


def test_fd_infinity_of_a_set_no_larger_than_its_smallest_subset_names_the_option(
    sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sets
    assert main(["fd", str(a), str(b), *MODEL, *RUN, "--infinity"]) != 0
    assert "pass --infinity-smallest 2 (a tenth of B)" in capsys.readouterr().err


@pytest.mark.slow
def test_fd_prdc_prints_the_libraries_precision_recall(
    sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sets
    assert main(["fd", str(a), str(b), *MODEL, *RUN, "--prdc", "--prdc-k", "2"]) == 0
    captured = capsys.readouterr()
    with pytest.warns(UserWarning, match="fewer than 1,000"):
        expected = precision_recall(_library_stats(a, keep=10_000), _library_stats(b, keep=10_000), k=2)
    values = ", ".join(f"{name} {value:.4f}" for name, value in expected._asdict().items())
    assert f"{values} (k=2) (A: 6 images, B: 6 images)" in captured.out
    assert "layer4: " in captured.err and "1,000" in captured.err  # six vectors: the small-set warning, one line
    assert main(["fd", str(a), str(b), *MODEL, *RUN, "--prdc", "--prdc-k", "6"]) == 2
    assert "use a smaller --prdc-k" in capsys.readouterr().err


@pytest.mark.slow
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


# -- lpips ---------------------------------------------------------------------------------------------


def test_lpips_command_scores_pairs_like_the_library(
    pairs_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pairs_dirs
    out = tmp_path / "scores.csv"
    argv = ["lpips", str(a), str(b), "--weights", "none", "--out", str(out), "--workers", "0", "-q"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "1 file(s) only in" in captured.err and "only_here.png" in captured.err and "sub/extra.png" in captured.err
    rows = out.read_text().splitlines()
    assert rows[0] == "name,score" and len(rows) == 5
    names = [row.split(",")[0] for row in rows[1:]]
    scores = [float(row.split(",")[1]) for row in rows[1:]]
    torch.manual_seed(0)
    metric = fh.LPIPS("alex", reduction="none", weights=None)
    pairs, _, _ = fh.metrics.pair_files(a, b)
    expected = fh.metrics.score_pairs(metric, pairs, num_workers=0)
    assert names == [pair.name for pair in pairs]
    assert scores == pytest.approx(expected, rel=1e-6)
    assert f"LPIPS (alex, v0.1, calibrated): {np.mean(expected):.6g} ± {np.std(expected, ddof=1):.3g} over 4 pairs" in (
        captured.out
    )


def test_lpips_command_refuses_folders_without_pairs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _folder(tmp_path, "a", 0), tmp_path / "b"
    b.mkdir()
    Image.new("RGB", (8, 8)).save(b / "other.png")
    assert main(["lpips", str(a), str(b), "--weights", "none", "-q"]) == 2
    assert "no image in" in capsys.readouterr().err
    assert main(["lpips", str(a), str(tmp_path / "missing"), "--weights", "none", "-q"]) == 2


def test_outputs_into_missing_folders_are_refused_before_any_compute(
    sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = sets
    missing = tmp_path / "nowhere"
    assert main(["stats", str(a), "--out", str(missing / "a.npz"), *MODEL, *RUN]) == 2
    assert main(["lpips", str(a), str(b), "--weights", "none", "--out", str(missing / "s.csv"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("does not exist") == 2 and ".tmp" not in err


def test_fd_stats_and_fid_take_statistics_files_in_any_case(tmp_path: Path) -> None:
    """``fd``/``stats``/``kid`` took ``A.NPZ`` for an image path (``fid`` too, before)."""
    for name in ("a.npz", "A.NPZ", "b.Npz"):
        (tmp_path / name).write_bytes(b"")
        assert is_statistics_file(str(tmp_path / name))
    (tmp_path / "c.png").write_bytes(b"")
    assert not is_statistics_file(str(tmp_path / "c.png")) and not is_statistics_file(str(tmp_path / "gone.npz"))
