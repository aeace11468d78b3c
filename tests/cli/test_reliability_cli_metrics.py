"""Reliability of the metric commands: statistics files of another setup (fd, KID), batches bounded by pixels,
outputs that cannot be written, and special files in the folders of `featurehooks lpips`."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
import featurehooks.metrics as metrics
from featurehooks.cli import main
from featurehooks.metrics import pair_files, score_pairs

import helpers

MODEL = ["--backbone", "resnet18", "--layers", "layer1", "--weights", "none", "--resize", "36", "--crop", "32"]
RUN = ["--workers", "0", "-q"]
posix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    """A seeded random RGB image of ``size`` (height, width)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)


def _folder(root: Path, name: str, seed: int, count: int = 4, size: tuple[int, int] = (40, 44)) -> Path:
    for i in range(count):
        _image(root / name / f"{i}.png", size, seed + i)
    return root / name


def _one_line(err: str) -> str:
    """The error line of a refused command: one line, in CLI flags, never Python's keyword syntax."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "weights=" not in err and "pool=" not in err, err
    return err


def _recorded(monkeypatch: pytest.MonkeyPatch, name: str) -> list[object]:
    """Record the calls of ``featurehooks.metrics.<name>`` (the CLI imports it at call time), still running it."""
    calls: list[object] = []
    real = getattr(metrics, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, name, recording)
    return calls


# -- fd and KID: a statistics file computed with another backbone, weights or pool ----------------------------


@pytest.fixture(scope="module")
def npz_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Statistics of two folders with ``--pool avg`` (not given) and with ``--pool max``; random weights."""
    root = tmp_path_factory.mktemp("setups")
    a, b = _folder(root, "a", 0, count=6), _folder(root, "b", 50, count=6)
    files = {"a": root / "a.npz", "b": root / "b.npz", "a_max": root / "a_max.npz", "b_max": root / "b_max.npz"}
    for folder, out, pool in (
        (a, "a", []),
        (b, "b", []),
        (a, "a_max", ["--pool", "max"]),
        (b, "b_max", ["--pool", "max"]),
    ):
        assert main(["stats", str(folder), "--out", str(files[out]), *MODEL, *pool, *RUN, "--keep", "6"]) == 0
    return {**files, "dir_a": a, "dir_b": b}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "says", "asked"),
    [
        (["--pool", "max"], "--pool avg", "--pool max"),
        (["--weights", "DEFAULT"], "--weights none", "--weights DEFAULT (ResNet18_Weights.IMAGENET1K_V1)"),
        (["--backbone", "resnet50"], "--backbone resnet18", "--backbone resnet50"),
        (["--pool", "max", "--kid", "--kid-subset-size", "3"], "--pool avg", "--pool max"),
    ],
    ids=["pool", "weights", "backbone", "kid"],
)
def test_fd_refuses_two_files_of_another_setup_than_asked(
    npz_files: dict[str, Path], options: list[str], says: str, asked: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fd", str(npz_files["a"]), str(npz_files["b"]), *MODEL, *RUN, *options]) == 2  # the last one counts
    err = _one_line(capsys.readouterr().err)
    assert f"{npz_files['a']} holds statistics computed with {says}, but the command asks for {asked}" in err
    assert f"pass {says}" in err


def test_fd_compares_only_the_options_given(npz_files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Files computed with --pool max and --weights none: nothing is computed, so the defaults say nothing."""
    a, b = str(npz_files["a_max"]), str(npz_files["b_max"])
    assert main(["fd", a, b, "--backbone", "resnet18", "--layers", "layer1", *RUN]) == 0
    unspecified = capsys.readouterr().out
    assert unspecified.startswith("layer1: FD ")
    assert main(["fd", a, b, *MODEL, "--pool", "max", *RUN]) == 0
    assert capsys.readouterr().out == unspecified


def test_a_file_and_a_folder_are_checked_before_any_compute(
    npz_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    computed = _recorded(monkeypatch, "feature_statistics_by_layer")
    folder = str(npz_files["dir_b"])
    assert main(["fd", str(npz_files["a"]), folder, *MODEL, "--pool", "max", *RUN]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"but {folder} would be computed with --pool max: " in err and "pass --pool avg" in err
    # not given, but the folder would be computed with the default: refused now, not after the compute
    assert main(["fd", folder, str(npz_files["a_max"]), *MODEL, *RUN]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "computed with --pool max, but" in err and "--pool avg (the default)" in err
    without_weights = [arg for arg in MODEL if arg not in ("--weights", "none")]
    assert main(["fd", str(npz_files["a"]), folder, *without_weights, *RUN]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--weights none, but" in err and "--weights DEFAULT (the default, ResNet18_Weights.IMAGENET1K_V1)" in err
    assert computed == []
    assert main(["fd", str(npz_files["a_max"]), folder, *MODEL, "--pool", "max", *RUN]) == 0
    assert len(computed) == 1


# -- lpips: batches bounded by pixels ------------------------------------------------------------------------


def _pairs(root: Path, sizes: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """Pairs of seeded random images of the given sizes, in that order."""
    pairs = []
    for i, size in enumerate(sizes):
        _image(root / "a" / f"{i:02d}.png", size, i)
        _image(root / "b" / f"{i:02d}.png", size, 100 + i)
        pairs.append((str(root / "a" / f"{i:02d}.png"), str(root / "b" / f"{i:02d}.png")))
    return pairs


def _recording_metric(shapes: list[tuple[int, ...]]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def metric(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(a.shape))
        return (a - b).abs().mean(dim=(1, 2, 3))

    return metric


def test_batches_are_bounded_by_pixels_down_to_one_pair(tmp_path: Path) -> None:
    sizes = [(32, 32)] * 5 + [(64, 64)] + [(16, 16)] * 3 + [(32, 32)] * 2
    pairs = _pairs(tmp_path, sizes)
    budget = 3 * 32 * 32
    shapes: list[tuple[int, ...]] = []
    scores = score_pairs(_recording_metric(shapes), pairs, batch_size=16, batch_pixels=budget, num_workers=0)
    pixels = [n * h * w for n, _, h, w in shapes]
    assert max(pixels) == 64 * 64 and (1, 3, 64, 64) in shapes  # a pair over the budget goes alone
    assert all(p <= budget for p, shape in zip(pixels, shapes) if shape[0] > 1)
    assert sum(shape[0] for shape in shapes) == len(pairs)
    alone = [score_pairs(_recording_metric([]), [pair], num_workers=0)[0] for pair in pairs]
    assert scores == alone  # each score in its place
    shapes.clear()
    score_pairs(_recording_metric(shapes), pairs[:5], batch_size=16, num_workers=0)
    assert shapes == [(5, 3, 32, 32)]  # small images: batch_size still bounds, as before


@pytest.mark.slow
def test_scores_do_not_depend_on_the_batching(tmp_path: Path) -> None:
    pairs = _pairs(tmp_path, [(40, 48)] * 4 + [(48, 40)] * 3 + [(40, 48)] * 2)
    torch.manual_seed(0)
    metric = fh.LPIPS("alex", reduction="none", weights=None)
    reference = score_pairs(metric, pairs, num_workers=0)
    singles = [score_pairs(metric, [pair], num_workers=0)[0] for pair in pairs]
    assert score_pairs(metric, pairs, num_workers=0, batch_pixels=1) == singles  # each score in its place
    assert singles == pytest.approx(reference, rel=1e-6, abs=1e-7)  # other batches: float rounding only
    blocks = {"batch_size": 4, "batch_pixels": 2 * 40 * 48}  # blocks of 4 pairs, cut again by pixels
    scores = score_pairs(metric, pairs, num_workers=0, **blocks)
    assert scores == pytest.approx(reference, rel=1e-6, abs=1e-7)
    assert score_pairs(metric, pairs, num_workers=2, **blocks) == scores  # batches end where sizes say, not workers


@pytest.mark.slow
def test_lpips_command_states_and_takes_the_pixel_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["lpips", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--batch-pixels N" in help_text and "height x width summed over its pairs" in help_text
    assert "a larger pair goes alone" in help_text
    a, b = _folder(tmp_path, "a", 0, count=3), _folder(tmp_path, "b", 10, count=3)
    rows = []
    for bound in ("1", "1048576"):
        out = tmp_path / f"scores_{bound}.csv"
        argv = ["lpips", str(a), str(b), "--weights", "none", "--batch-pixels", bound, "--out", str(out), *RUN]
        assert main(argv) == 0
        rows.append([float(row.split(",")[1]) for row in out.read_text().splitlines()[1:]])
    assert len(rows[0]) == 3 and rows[0] == pytest.approx(rows[1], rel=1e-6, abs=1e-7)


# -- outputs that cannot be written: refused before any compute ----------------------------------------------


def test_unwritable_outputs_are_refused_before_any_compute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = _folder(tmp_path, "a", 0, count=2), _folder(tmp_path, "b", 10, count=2)
    scored, computed = _recorded(monkeypatch, "LPIPS"), _recorded(monkeypatch, "feature_statistics")
    lpips = ["lpips", str(a), str(b), "--weights", "none", *RUN]
    stats = ["stats", str(a), *MODEL, *RUN]
    folder = tmp_path / "existing"
    folder.mkdir()
    for command in (lpips, stats):
        assert main([*command, "--out", str(folder)]) == 2
        assert f"cannot write {folder}: it is a folder" in _one_line(capsys.readouterr().err)
    if hasattr(os, "mkfifo"):
        pipe = tmp_path / "pipe.csv"
        os.mkfifo(pipe)
        with helpers.deadline(30):
            assert main([*lpips, "--out", str(pipe)]) == 2
        assert "it is not a regular file" in _one_line(capsys.readouterr().err)
        assert stat.S_ISFIFO(os.lstat(pipe).st_mode)  # not replaced by a file
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: path != str(folder) and real_access(path, mode, **kw))
    assert main([*lpips, "--out", str(folder / "scores.csv")]) == 2
    assert f"the folder {folder} is not writable" in _one_line(capsys.readouterr().err)
    assert scored == [] and computed == []


# -- special files in the input folders of lpips --------------------------------------------------------------


@posix_only
def test_a_fifo_in_an_input_folder_is_reported_not_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _folder(tmp_path, "a", 0, count=3), _folder(tmp_path, "b", 10, count=3)
    os.mkfifo(a / "pipe.png")  # its counterpart in b is an image
    _image(b / "pipe.png", (40, 44), 99)
    (b / "sub").mkdir()
    os.mkfifo(b / "sub" / "lonely.png")  # in b only
    with helpers.deadline(60):
        with pytest.warns(UserWarning) as caught:
            pairs, only_a, only_b = pair_files(a, b)
        assert main(["lpips", str(a), str(b), "--weights", "none", *RUN]) == 0
    message = str(caught[0].message)
    assert message.startswith("2 input(s) could not be read and are left out of the pairs (")
    assert f"{a / 'pipe.png'}: OSError: not a regular file: fifo" in message  # a dump's reason for such a row
    assert f"{b / 'sub' / 'lonely.png'}: OSError: not a regular file: fifo" in message
    assert [pair.name for pair in pairs] == ["0.png", "1.png", "2.png"] and only_a == only_b == []
    captured = capsys.readouterr()
    assert f"featurehooks: warning: {message}\n" in captured.err and "only in" not in captured.err
    assert "over 3 pairs" in captured.out
