"""The featurehooks command: extract round trips, layers table, show, help, and one-line error exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks import FeatureExtractor, dump_features
from featurehooks.cli import main
from featurehooks.viz import add_caption

SIZES = ["--resize", "36", "--crop", "32", "--workers", "0", "--batch-size", "3", "-q"]


def extract(images: Path, out: Path, *extra: str) -> int:
    return main(["extract", str(images), "--out", str(out), "--backbone", "resnet18", *SIZES, *extra])


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: "), stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_extract_round_trip_equals_the_library(
    images: Path, tmp_path: Path, resnet18_cached: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert extract(images, tmp_path / "cli", "--layers", "layer1", "layer2", "--pool", "avg", "--dtype", "float16") == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote 5 rows to {tmp_path / 'cli'}: layer1 (5, 64), layer2 (5, 128) float16")
    ext = FeatureExtractor("resnet18", ["layer1", "layer2"], weights="DEFAULT")
    dump_features(
        ext, images, tmp_path / "lib", batch_size=3, num_workers=0, pool="avg", dtype="float16",
        resize_size=36, crop_size=32, progress=False,
    )  # fmt: skip
    for name in ("layer1.npy", "layer2.npy", "index.csv", "manifest.json"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes(), name


def test_extract_with_random_weights_is_seeded(images: Path, tmp_path: Path) -> None:
    for out in ("a", "b"):
        assert extract(images, tmp_path / out, "--layers", "layer1", "--weights", "none", "--pool", "max") == 0
    assert (tmp_path / "a" / "layer1.npy").read_bytes() == (tmp_path / "b" / "layer1.npy").read_bytes()
    torch.manual_seed(0)
    ext = FeatureExtractor("resnet18", ["layer1"], weights=None)
    mine = dump_features(
        ext,
        images,
        tmp_path / "c",
        batch_size=3,
        num_workers=0,
        pool="max",
        resize_size=36,
        crop_size=32,
        progress=False,
    )
    np.testing.assert_array_equal(mine.load("layer1"), np.load(tmp_path / "a" / "layer1.npy"))


def test_existing_output_needs_resume_or_overwrite(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("--layers", "layer1", "--weights", "none", "--pool", "avg")
    assert extract(images, tmp_path / "out", *args) == 0
    capsys.readouterr()
    assert extract(images, tmp_path / "out", *args) == 2
    assert "--overwrite" in one_error_line(capsys.readouterr().err)
    assert extract(images, tmp_path / "out", *args, "--resume") == 0  # complete: nothing left to do
    assert extract(images, tmp_path / "out", *args, "--overwrite") == 0
    with pytest.raises(SystemExit) as exit_info:
        extract(images, tmp_path / "out", *args, "--resume", "--overwrite")
    assert exit_info.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "layer9", "--weights", "none"], "did you mean 'layer4'"),
        (["--layers", "layer1", "--weights", "IMAGENET9K"], "unknown weights"),
        (["--layers", "layer1", "--weights", "missing.pth"], "weights file not found"),
    ],
)
def test_bad_model_options_exit_2_with_one_line(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert extract(images, tmp_path / "out", *argv) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_missing_source_and_unknown_backbone_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["extract", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--backbone", "resnet18",
                 "--layers", "layer1", "--weights", "none", "-q"])  # fmt: skip
    assert code == 2 and "no such file or folder" in one_error_line(capsys.readouterr().err)
    assert main(["layers", "resnt18"]) == 2
    assert "did you mean 'resnet18'" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv",
    [
        ["extract", "x", "--backbone", "vgg16", "--layers", "relu3_3"],  # no --out
        ["extract", "x", "--out", "o", "--backbone", "vgg16", "--layers", "relu3_3", "--batch-size", "0"],
        ["extract", "x", "--out", "o", "--backbone", "vgg16", "--layers", "relu3_3", "--pool", "mean"],
        ["extract", "x", "--out", "o", "--backbone", "vgg16", "--layers", "relu3_3", "--crop", "-3"],
        ["layers", "resnet18", "--input-size", "-5"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["extract"], ["layers"], ["show"], ["lpips"], ["fd"], ["stats"]])
def test_help_describes_every_command(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    expected = {
        (): ["extract", "layers", "show", "lpips", "fd", "stats", "exit status"],
        ("extract",): [
            "--layers",
            "--pool",
            "--dtype",
            "--resume",
            "--overwrite",
            "torchrun",
            "index.csv",
            "--output-format",
        ],
        ("layers",): ["backbone", "--input-size"],
        ("show",): ["IMAGE", "--channels", "--out"],
        ("lpips",): ["DIR_A", "--net", "--version", "--heads", "--out", "--ignore-suffix", "relative path"],
        ("fd",): ["--backbone", "--layers", "--pool", "--kid", "statistics", "TensorFlow Inception"],
        ("stats",): ["SRC", "--out", "--keep", "--pool"],
    }[tuple(command)]
    for word in expected:
        assert word in text


def test_layers_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", "vgg16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "alias", "path", "type", "layout", "channels", "stride", "calls"]
    assert ["relu3_3", "relu3_3", "features.15", "ReLU", "NCHW", "256", "4", "1"] in [line.split() for line in lines]


def test_layers_table_shows_calls_layouts_and_the_weights_architecture(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", "resnet18"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["layer1.0.relu_1", "-", "layer1.0.relu", "ReLU", "NCHW", "64", "4", "2"] in rows
    assert main(["layers", "vit_b_16", "--weights", "IMAGENET1K_SWAG_E2E_V1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    block = next(row for row in rows if row[0] == "encoder.layers.encoder_layer_0")
    assert block[4:7] == ["NLC+1", "768", "16"]  # 1 class token + 24x24 patches of the 384 SWAG input
    assert main(["layers", "swin_t"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["features.1", "-", "features.1", "Sequential", "NHWC", "96", "4", "1"] in rows


def test_interrupt_exits_130_with_a_hint(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import featurehooks.dump

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(featurehooks.dump, "dump_features", interrupted)
    assert extract(images, tmp_path / "out", "--layers", "layer1", "--weights", "none") == 130
    assert "--resume" in capsys.readouterr().err


def run_cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "featurehooks", *args], capture_output=True, text=True, **kwargs)


@pytest.mark.slow  # the entry point (`python -m featurehooks`) in a process of its own
def test_real_process_error_exit_has_no_traceback(tmp_path: Path) -> None:
    done = run_cli("extract", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--backbone", "vgg16",
                   "--layers", "relu3_3", "--weights", "none")  # fmt: skip
    assert done.returncode == 2
    one_error_line(done.stderr)


@pytest.mark.slow
def test_closed_pipe_exits_quietly() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `featurehooks layers vgg16 | head -0`
    try:
        done = subprocess.run(
            [sys.executable, "-m", "featurehooks", "layers", "vgg16"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)
    assert done.returncode == 141
    assert done.stderr == ""


@pytest.mark.slow
def test_show_writes_a_png_grid(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grid.png"
    code = main(["show", str(images / "0.png"), "--backbone", "vgg16", "--weights", "none", "--layers", "relu1_2",
                 "relu2_2", "--out", str(out), "--channels", "4", "--tile-size", "32",
                 "--resize", "32", "--crop", "32"])  # fmt: skip
    assert code == 0 and "wrote" in capsys.readouterr().out
    width, height = 5 * 32 + 4 * 2, 2 * (14 + 32) + 2  # image + 4 maps; 2 layers
    with Image.open(out) as grid:
        assert grid.format == "PNG" and grid.mode == "RGB"
        picture = np.asarray(grid)
    caption = "RANDOM weights (seed 0): shows the mechanics, not what trained weights see"
    band = add_caption(np.zeros((height, width, 3), np.uint8), caption)[:-height]
    np.testing.assert_array_equal(picture[: len(band)], band)  # random weights: the picture says so on top


def test_show_draws_a_row_of_an_archive_as_the_same_image_file(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Image.open(images / "0.png") as png:
        np.savez(tmp_path / "samples.npz", arr_0=np.asarray(png.convert("RGB"))[None])
    pictures = []
    for image in (images / "0.png", f"{tmp_path / 'samples.npz'}/arr_0/0"):
        out = tmp_path / "grid.png"
        code = main(["show", str(image), "--backbone", "resnet18", "--weights", "none", "--layers", "conv1",
                     "--out", str(out), "--channels", "2", "--tile-size", "16"])  # fmt: skip
        assert code == 0, capsys.readouterr().err
        pictures.append(out.read_bytes())
    assert pictures[0] == pictures[1]


def test_show_with_pretrained_weights_draws_no_caption(
    images: Path, tmp_path: Path, resnet18_cached: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid.png"
    argv = ["show", str(images / "0.png"), "--backbone", "resnet18", "--layers", "layer1", "--out", str(out)]
    assert main([*argv, "--channels", "2", "--tile-size", "16", "--resize", "32", "--crop", "32"]) == 0
    with Image.open(out) as grid:
        assert grid.size == (3 * 16 + 2 * 2, 14 + 16)  # image + 2 maps, one layer: no band


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "layers", "message"),
    [
        ("missing", ["relu1_2"], "no such image"),
        ("corrupt", ["relu1_2"], "cannot read image"),
        ("ok", ["classifier.6"], "not a feature map"),
    ],
)
def test_show_errors_exit_2(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, layers: list[str], message: str
) -> None:
    path = {"missing": tmp_path / "none.png", "corrupt": tmp_path / "bad.png", "ok": images / "1.png"}[setup]
    if setup == "corrupt":
        path.write_bytes(b"nope")
    code = main(["show", str(path), "--backbone", "vgg16", "--weights", "none", "--layers", *layers,
                 "--out", str(tmp_path / "g.png"), "--resize", "32", "--crop", "32"])  # fmt: skip
    assert code == 2
    assert message in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "layer1.0.relu_3"], "named layer1.0.relu, layer1.0.relu_1"),  # checked against the trace
        (["--layers", "layer1", "--device", "tpu9"], "unknown device"),
        (["--layers", "layer1", "--device", "cuda:99"], "cuda:99"),
    ],
)
def test_model_errors_found_at_build_exit_2_with_one_line(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert extract(images, tmp_path / "out", "--weights", "none", *argv) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_each_torchrun_rank_takes_its_own_gpu(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    from featurehooks.cli import _common as _cli_common

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _cli_common.device_from(name) == torch.device("cuda", 1) and chosen == [1]
    assert _cli_common.device_from("cuda:0") == torch.device("cuda", 0)  # an explicit index is kept
