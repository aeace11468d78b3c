"""The front door as a new user meets it: the demo's cost and what it prints, the sample-image script's ``--help``,
an output that is a file, a dump that fails once started (one line and ``--resume``), unreadable inputs of the
statistics commands as one line each."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import featurehooks.dump.run
from featurehooks.cli import main
from featurehooks.errors import RunFailedError

from helpers import REPO, load_script

EXTRACT = ["--backbone", "resnet18", "--resize", "36", "--crop", "32", "--layers", "layer1", "--weights", "none"]
QUIET = ["--workers", "0", "-q"]
# the style transfer of `make demo`: at most this many steps x pixels (a 90-second demo on 2 idle cores); the
# example's own defaults (200 steps at 192 px) are 7.5 times as much
DEMO_STEP_PIXELS = 60 * 128 * 128


def error_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()


# -- make demo ----------------------------------------------------------------------------------------------------


def _demo_style_transfer_argv() -> list[str]:
    """The arguments the Makefile's demo target passes to examples/style_transfer.py."""
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^demo:.*?\n((?:\t.*\n)+)", makefile, re.M)
    assert target is not None, "no demo target in the Makefile"
    line = next(line for line in target[1].splitlines() if "examples/style_transfer.py" in line)
    words = shlex.split(line.strip())
    return words[words.index("examples/style_transfer.py") + 1 :]


def test_the_demo_style_transfer_is_cheap_and_the_examples_defaults_are_not() -> None:
    example = load_script("examples/style_transfer.py")
    demo = example.parse_args(_demo_style_transfer_argv())
    assert demo.steps * demo.size**2 <= DEMO_STEP_PIXELS, (demo.steps, demo.size)
    assert demo.steps >= 30 and demo.size >= 96  # still long and large enough to show the mechanics
    default = example.parse_args([])
    assert (default.steps, default.size) == (200, 192)  # real use is unchanged


def test_the_demo_mode_of_the_style_transfer_example() -> None:
    example = load_script("examples/style_transfer.py")
    demo = example.parse_args(["--demo"])
    assert demo.steps * demo.size**2 <= DEMO_STEP_PIXELS
    assert example.parse_args(["--demo", "--steps", "7"]).steps == 7  # an explicit value wins


@pytest.mark.slow  # VGG16 on the eight sample images
def test_the_demo_says_which_weights_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # it writes demo-output/ here
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_cache"))  # no VGG16 weights, whatever other tests cached
    load_script("examples/demo.py").main()
    out = capsys.readouterr().out
    assert "weights None" not in out
    assert "RANDOM weights (seed 0)" in out  # seeded random ones


def test_make_sample_images_help_changes_nothing() -> None:
    images = sorted((REPO / "examples" / "images").glob("*.png")) + [REPO / "examples" / "style" / "waves.png"]
    before = {path: path.stat().st_mtime_ns for path in images}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "make_sample_images.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
    assert {path: path.stat().st_mtime_ns for path in images} == before


# -- extract ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("below", ["", "sub"])
def test_extract_to_a_file_says_it_is_a_file(
    images: Path, tmp_path: Path, below: str, capsys: pytest.CaptureFixture[str]
) -> None:
    existing = tmp_path / "feats"
    existing.write_text("")
    out = existing / below if below else existing
    assert main(["extract", str(images), "--out", str(out), *EXTRACT, *QUIET]) == 2
    (line,) = error_lines(capsys)
    assert "Errno" not in line and f"{existing} is a file" in line and "--out" in line, line


class _Stop:
    """An ``extract_batches`` that fails as ``exc`` once the dump has started (its manifest and arrays written)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [
        RunFailedError("decoding worker 1 died (killed by signal 9) while reading images"),
        OSError(28, "No space left on device"),
    ],
)
def test_a_dump_that_fails_once_started_says_to_resume(
    images: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: BaseException,
) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(featurehooks.dump.run, "extract_batches", _Stop(exc))
    assert main(["extract", str(images), "--out", str(out), *EXTRACT, *QUIET]) == 1
    (line,) = error_lines(capsys)
    assert line.startswith("featurehooks: error: ") and str(exc.args[-1]) in line, line
    assert line.count("--resume") == 1 and str(out) in line, line
    monkeypatch.undo()
    assert main(["extract", str(images), "--out", str(out), *EXTRACT, *QUIET, "--resume"]) == 0  # as it says


def test_a_bug_once_the_dump_started_keeps_its_traceback_with_the_resume_hint(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(featurehooks.dump.run, "extract_batches", _Stop(ZeroDivisionError("bug")))
    with pytest.raises(ZeroDivisionError):
        main(["extract", str(images), "--out", str(tmp_path / "out"), *EXTRACT, *QUIET])
    (line,) = error_lines(capsys)
    assert line.startswith("featurehooks: the dump in ") and line.endswith("rerun with --resume to finish it"), line


def test_a_dump_refused_before_it_starts_gets_no_resume_hint(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["extract", str(images), "--out", str(out), *EXTRACT, *QUIET]) == 0
    capsys.readouterr()
    assert main(["extract", str(images), "--out", str(out), *EXTRACT, *QUIET, "--resume", "--dtype", "float16"]) == 2
    (line,) = error_lines(capsys)
    assert "rerun with --resume" not in line, line


# -- stats and fd -------------------------------------------------------------------------------------------------


@pytest.fixture
def with_unreadable(tmp_path: Path, images: Path) -> Path:
    """The five test images and two files that are no images."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    for path in images.glob("*.png"):
        (folder / path.name).write_bytes(path.read_bytes())
    (folder / "garbage.png").write_text("not an image")
    (folder / "cut.png").write_bytes((images / "0.png").read_bytes()[:100])
    return folder


@pytest.mark.parametrize("command", ["stats", "fd"])
def test_unreadable_inputs_of_the_statistics_commands_are_one_line(
    with_unreadable: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--backbone", "resnet18", "--weights", "none", "--layers", "avgpool", "--resize", "36", "--crop", "32"]
    if command == "stats":
        argv = ["stats", str(with_unreadable), "--out", str(tmp_path / "s.npz"), *model, *QUIET]
    else:
        argv = ["fd", str(with_unreadable), str(with_unreadable), *model, *QUIET]
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        assert main(argv) == 0
    assert not escaped, [str(w.message) for w in escaped]  # printed, not left to Python's warnings
    lines = [line for line in error_lines(capsys) if "could not be read" in line]
    assert lines and all(line.startswith("featurehooks: warning: ") for line in lines), lines
    assert all("garbage.png" in line and "cut.png" in line for line in lines), lines
    assert len(lines) == (1 if command == "stats" else 2)  # one per set
