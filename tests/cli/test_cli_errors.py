"""The CLI on bad input: one stderr line and the documented exit status, never a traceback; bugs keep theirs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from featurehooks import cli
from featurehooks.cli import main
from featurehooks.errors import RunFailedError

MODEL = ["--backbone", "resnet18", "--resize", "36", "--crop", "32"]
EXTRACT = [*MODEL, "--layers", "layer1", "--weights", "none", "--workers", "0", "-q"]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single ``featurehooks: error: ...`` line on stderr."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: "), err
    assert "Traceback" not in err
    return lines[0]


def expect(code: int, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI in-process, check its exit status and its one error line, and return that line."""
    assert main(argv) == code
    line = one_error_line(capsys)
    assert message in line, line
    return line


def extract(images: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", str(images), "--out", str(out), *EXTRACT, *extra]


# -- bad input: exit 2 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["layers", "vgg11", "--input-size", "16"], "try another input_size"),
        (["layers", "vgg11", "--input-size", "1"], "1x1 image"),
        (["layers", "resnt18"], "did you mean 'resnet18'"),
        (["layers", "vgg16", "--weights", "IMAGENET9K"], "unknown weights 'IMAGENET9K'"),
    ],
)
def test_layers_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    expect(2, argv, message, capsys)


def test_layers_unknown_timm_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("timm")
    expect(2, ["layers", "timm/resnet18x"], "unknown timm model", capsys)
    expect(2, ["layers", "timm/resnet18.badtag"], "no pretrained tag 'badtag'; did you mean 'resnet18.", capsys)


def test_missing_timm_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    real_import = builtins.__import__

    def no_timm(name: str, *args: object, **kwargs: object) -> object:
        if name == "timm" or name.startswith("timm."):
            raise ImportError("No module named 'timm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_timm)
    expect(2, ["layers", "timm/resnet18"], "featurehooks[timm]", capsys)


DEVICES = [
    ("meta", "no values"),
    ("mps", "--device mps cannot be used"),
    ("xla", "--device xla cannot be used"),
    ("xpu", "--device xpu cannot be used"),
    ("", "unknown device ''"),
    ("cuda:abc", "unknown device 'cuda:abc'"),
    ("gpu", "unknown device 'gpu'"),
]


@pytest.mark.parametrize(("device", "message"), DEVICES)
def test_unusable_devices(
    images: Path, tmp_path: Path, device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    expect(2, extract(images, tmp_path / "out", "--device", device), message, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect(2, extract(images, tmp_path / "out", "--device", "cuda"), "CUDA is not available", capsys)


def test_show_on_the_meta_device(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["show", str(images / "0.png"), "--out", str(tmp_path / "g.png"), *MODEL, "--layers", "layer1"]
    expect(2, [*argv, "--weights", "none", "--device", "meta"], "no values", capsys)


WEIGHTS: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty.pth": (lambda p: p.write_bytes(b""), "not a readable torch.save file"),
    "corrupt.safetensors": (lambda p: p.write_bytes(b"\x10" + bytes(7) + b"{nope}"), "not a readable safetensors"),
    "numbers.pth": (lambda p: torch.save({"a": 1}, p), "'a' holds a value of type int"),
    "list.pth": (lambda p: torch.save([torch.zeros(1)], p), "holds a list"),
    "folder.pth": (lambda p: p.mkdir(), "is a directory"),
    "pickled.pth": (lambda p: torch.save({"p": Path("/")}, p), "pickled Python objects (pathlib.PosixPath)"),
    "missing.pth": (lambda p: None, "weights file not found"),
}


@pytest.mark.parametrize("name", list(WEIGHTS))
def test_unusable_weights_files(images: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    write, message = WEIGHTS[name]
    path = tmp_path / name
    write(path)
    line = expect(2, [*extract(images, tmp_path / "out"), "--weights", str(path)], message, capsys)
    assert str(path) in line
    assert not (tmp_path / "out").exists()


def test_uncached_pretrained_weights(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["extract", str(images), "--out", str(tmp_path / "out"), "--backbone", "resnet34", "--layers", "layer1"]
    expect(2, argv, "resnet34-b627a593.pth", capsys)


def test_offline_timm_backbone(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("timm")
    argv = ["extract", str(images), "--out", str(tmp_path / "out"), "--backbone", "timm/convnext_tiny"]
    expect(2, [*argv, "--layers", "stages.1", "-q"], "HF_HUB_OFFLINE=1", capsys)


def test_inputs_that_name_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pattern = str(tmp_path / "none" / "*.png")
    expect(2, ["extract", pattern, "--out", str(tmp_path / "out"), *EXTRACT], "no files match", capsys)


def test_output_that_is_a_file(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.write_text("")
    expect(2, extract(images, out), str(out), capsys)


def test_show_bad_image_and_layer(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--out", str(tmp_path / "g.png"), *MODEL, "--weights", "none"]
    expect(2, ["show", str(images), *common, "--layers", "layer1"], "cannot read image", capsys)
    expect(2, ["show", str(images / "0.png"), *common, "--layers", "fc"], "not a feature map", capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["layers", "vgg11", "--input-size", "0"],
        ["show", "x.png", "--out", "g.png", "--backbone", "vgg16", "--layers", "relu1_2", "--tile-size", "4"],
        ["extract", "x", "--out", "o", "--backbone", "vgg16", "--layers", "relu1_2", "--workers", "-1"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "error: argument" in err.strip().splitlines()[-1]


# -- bad input found outside the CLI: a FeatureHooksError there too ------------------------------------------------


def test_the_same_layer_twice(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect(2, [*extract(images, tmp_path / "out"), "--layers", "layer1", "layer1"], "twice", capsys)


def _finished(images: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(extract(images, out)) == 0
    capsys.readouterr()
    return json.loads((out / "manifest.json").read_text())


def test_manifest_hand_set_to_complete(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    manifest = _finished(images, out, capsys)
    for key in ("num_rows", "num_valid", "skipped"):  # what a "running" manifest lacks
        del manifest[key]
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "complete"}))
    expect(2, [*extract(images, out), "--resume"], "manifest", capsys)


def test_unreadable_manifest(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    _finished(images, out, capsys)
    (out / "manifest.json").write_text("{not json")
    expect(2, [*extract(images, out), "--resume"], "manifest", capsys)


def test_resume_with_other_settings(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    _finished(images, out, capsys)
    expect(2, [*extract(images, out), "--resume", "--pool", "avg"], "differ", capsys)


# -- the run failed: exit 1; a bug: its traceback ----------------------------------------------------------------


def _failing_dump(exc: BaseException) -> Callable[..., None]:
    def dump(*args: object, **kwargs: object) -> None:
        raise exc

    return dump


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (RunFailedError("another rank failed while dumping"), "another rank failed"),
    ],
)
def test_a_failed_run_exits_1_with_one_line(
    images: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    exc: BaseException,
    message: str,
) -> None:
    import featurehooks.dump

    monkeypatch.setattr(featurehooks.dump, "dump_features", _failing_dump(exc))
    expect(1, extract(images, tmp_path / "out"), message, capsys)


@pytest.mark.parametrize("exc", [KeyError("skipped"), ValueError("bug"), TypeError("bug"), IndexError("bug")])
def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(cli, "list_layers", broken)
    with pytest.raises(type(exc)):
        main(["layers", "vgg16"])


@pytest.mark.slow
def test_a_bug_in_a_real_process_prints_a_traceback_and_exits_1(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = "import featurehooks.cli as c; c.list_layers = lambda *a, **k: {}['bug']; raise SystemExit(c.main())"
    done = subprocess.run(
        [sys.executable, "-c", script, "layers", "vgg16"], capture_output=True, text=True, env={**os.environ}
    )
    assert done.returncode == 1 and "Traceback" in done.stderr and "KeyError" in done.stderr


def test_resume_of_a_complete_dump_says_so(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    _finished(images, out, capsys)
    assert main([*extract(images, out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("already complete:") and "wrote" not in printed
