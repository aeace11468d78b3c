"""Statistics on two ranks started as torchrun starts them (``helpers.two_ranks``): each of 2 CPU ranks streams
its share of the images, the shares are merged, and the one file written (``stats``) and the one line printed
(``fd``) equal a single process's to float64 rounding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featurehooks.cli import main
from featurehooks.metrics import FeatureStatistics

from helpers import two_ranks

pytestmark = pytest.mark.slow  # two Python processes a test

MODEL = ["--backbone", "resnet18", "--layers", "layer2", "--batch-size", "2", "--workers", "0"]
SIZES = ["--resize", "36", "--crop", "32", "--device", "cpu", "-q"]


def _images(folder: Path, count: int, seed: int) -> Path:
    """``count`` PNGs of odd sizes and one corrupt file: uneven shares, and a skipped row on the second rank."""
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (40, 33 + i, 3), dtype=np.uint8)).save(folder / f"img_{i:02d}.png")
    (folder / f"img_{count - 2:02d}b.png").write_bytes(b"\x89PNG broken")
    return folder


def test_stats_of_two_ranks_equal_one_process(tmp_path: Path, resnet18_cached: Path) -> None:
    images = _images(tmp_path / "imgs", 11, 0)
    run = two_ranks(["stats", str(images), "--out", str(tmp_path / "two.npz"), *MODEL, *SIZES, "--keep", "0"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote") == 1  # rank 0 writes and prints; rank 1 only computes its share
    assert run.stderr.count("could not be read") == 1 and "img_09b.png" in run.stderr  # one warning, both shares
    assert main(["stats", str(images), "--out", str(tmp_path / "one.npz"), *MODEL, *SIZES, "--keep", "0"]) == 0
    two, one = FeatureStatistics.load(tmp_path / "two.npz"), FeatureStatistics.load(tmp_path / "one.npz")
    assert two.count == one.count == 11 and two.origin == one.origin
    np.testing.assert_allclose(two.mean.numpy(), one.mean.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(two.covariance.numpy(), one.covariance.numpy(), rtol=0, atol=1e-12)


def test_fd_of_two_ranks_prints_the_one_process_line_once(
    tmp_path: Path, resnet18_cached: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _images(tmp_path / "a", 7, 1), _images(tmp_path / "b", 6, 2)
    run = two_ranks(["fd", str(a), str(b), *MODEL, *SIZES])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("layer2: FD ")
    assert main(["fd", str(a), str(b), *MODEL, *SIZES]) == 0
    expected = capsys.readouterr().out.strip()
    fd = float(lines[0].split("FD ")[1].split()[0])
    assert fd == pytest.approx(float(expected.split("FD ")[1].split()[0]), rel=1e-5)  # printed to 6 digits
    assert lines[0].split(" (")[1] == expected.split(" (")[1]  # the same counts: A: 7 images, B: 6 images


def test_fid_of_two_ranks_prints_the_one_process_number_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _images(tmp_path / "a", 5, 3), _images(tmp_path / "b", 4, 4)
    fid = ["fid", str(a), str(b), "--dims", "64", "--weights", "none", "--batch-size", "2", "--workers", "0"]
    run = two_ranks([*fid, "--device", "cpu", "-q"])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FID:  ")
    assert main([*fid, "--device", "cpu", "-q"]) == 0
    expected = float(capsys.readouterr().out.split("FID:  ")[1])
    # FID is a small difference of traces of order one: float64 rounding of the merged moments moves it ~1e-10
    assert float(lines[0].split("FID:  ")[1]) == pytest.approx(expected, rel=0, abs=1e-8)


def test_eval_of_two_ranks_prints_the_one_process_numbers_once(
    tmp_path: Path, fid_weights: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """KID and the Inception Score of ``eval`` (FID's merged statistics are the ``fid`` test's); KID's subsets and
    IS's split are whole sets, as the ranks join the kept vectors in another order than one process reads them."""
    a, b = _images(tmp_path / "a", 4, 5), _images(tmp_path / "b", 4, 6)
    metrics = ["--metrics", "kid,is", "--kid-subset-size", "4", "--is-splits", "1"]
    command = ["eval", str(a), str(b), *metrics, "--batch-size", "2", "--workers", "0"]  # seeded weights in the cache
    run = two_ranks([*command, "--device", "cpu", "-q", "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1
    assert main([*command, "--device", "cpu", "-q", "--json"]) == 0
    two, one = json.loads(lines[0]), json.loads(capsys.readouterr().out)
    assert two["images"] == one["images"] == {"real": 4, "fake": 4}  # the corrupt file left out on both
    assert two["kid"]["mean"] == pytest.approx(one["kid"]["mean"], rel=1e-5)  # a difference of kernel sums
    assert two["is"]["mean"] == pytest.approx(one["is"]["mean"], rel=1e-9)
