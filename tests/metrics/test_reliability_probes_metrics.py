"""Issue 19, items 1, 13 and 14: watch on exploding activations, FD/KID on small sets, examples and CLI messages."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from featurehooks.cli import main
from featurehooks.cli._common import cli_message
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import FeatureStatistics, frechet_distance, kernel_inception_distance
from featurehooks.probes.watch import watch

from helpers import load_script

# --------------------------------------------------------------------------------------------------
# item 1: watch accumulates so that every finite float32 input gives finite, correct statistics


def _reference(values: torch.Tensor) -> dict[str, float]:
    x = values.to(torch.float64).flatten()
    return {
        "mean": float(x.mean()),
        "std": float(x.std(correction=0)),
        "min": float(x.min()),
        "max": float(x.max()),
        "absmax": float(x.abs().max()),
    }


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.rand(4, 300, generator=g) + 0.5
    signs = torch.where(torch.rand(4, 300, generator=g) < 0.5, -1.0, 1.0)
    return [
        base * 1e19,
        base * 1e30,
        base * 1.5e38,  # up to 3e38: near float32's largest
        signs * base * 1e19,
        signs * base * 1e30,
        signs * base * 1.5e38,
        torch.tensor([[3e38, -3e38, 3e38, -3e38]]),
    ]


@pytest.mark.parametrize("values", _cases(), ids=["1e19", "1e30", "3e38", "±1e19", "±1e30", "±3e38", "±max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_watch_statistics_of_huge_finite_activations_are_finite_and_correct(values, dtype) -> None:
    values = values.to(dtype)
    assert torch.isfinite(values).all()
    net = nn.Sequential(nn.Identity())
    with watch(net, ["0"], grads=False) as w:
        net(values)
        net(values)  # two calls: the across-call accumulation too
    (row,) = w.summary()
    expected = _reference(values)
    assert row.nonfinite == 0
    assert row.count == 2 * values.numel()
    for stat, value in expected.items():
        got = getattr(row, stat)
        assert math.isfinite(got), (stat, got)
        assert got == pytest.approx(value, rel=1e-9, abs=1e-9 * expected["absmax"]), stat
    assert row.min <= row.max


def test_watch_huge_gradients_are_finite_and_correct() -> None:
    x = (torch.linspace(-1, 1, 64) * 1e30).requires_grad_()
    net = nn.Sequential(nn.Identity())
    with watch(net, ["0"]) as w:
        out = net(x)
        out.backward(torch.linspace(1, 3, 64) * 1e35)
    grad = next(row for row in w.summary() if row.kind == "grad")
    expected = _reference(torch.linspace(1, 3, 64) * 1e35)
    for stat, value in expected.items():
        assert getattr(grad, stat) == pytest.approx(value, rel=1e-6), stat


# --------------------------------------------------------------------------------------------------
# item 13: FD warns on sets smaller than their dimension, KID refuses sets smaller than its subsets


@pytest.mark.slow
def test_fd_of_fewer_vectors_than_dimensions_warns_naming_the_minimum() -> None:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=generator), torch.randn(8, 64, generator=generator)
    with pytest.warns(UserWarning, match=r"a holds 8 feature vectors in 64 dimensions.*at least 65"):
        assert frechet_distance(a, b) > 0
    stats = FeatureStatistics().update(a.numpy())
    with pytest.warns(UserWarning, match="covariance is singular"):
        frechet_distance(stats, torch.randn(100, 64, generator=generator))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # enough vectors: no warning
        frechet_distance(torch.randn(40, 16, generator=generator), torch.randn(17, 16, generator=generator))


def test_kid_refuses_sets_smaller_than_the_subset_size_naming_the_minimum() -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(50, 8, generator=generator), torch.randn(30, 8, generator=generator)
    with pytest.raises(
        InvalidValueError, match=r"b holds 30 feature vectors, fewer than subset_size=1000.*subset_size=30"
    ):
        kernel_inception_distance(x, y)
    with pytest.raises(InvalidValueError, match=r"a holds 50 .* subset_size=60"):
        kernel_inception_distance(x, torch.randn(80, 8, generator=generator), subset_size=60)
    mean, std = kernel_inception_distance(x, y, subsets=5, subset_size=30)
    assert math.isfinite(mean) and std > 0  # real subsets of x, not a silently shrunk one


def _stats_file(path: Path, count: int, keep: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    FeatureStatistics(keep=keep).update(rng.normal(size=(count, 8))).save(path)
    return path


def test_cli_kid_refuses_small_sets_naming_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _stats_file(tmp_path / "a.npz", 20, 100, 0), _stats_file(tmp_path / "b.npz", 20, 100, 1)
    argv = ["fd", str(a), str(b), "--backbone", "resnet18", "--layers", "layer4", "--kid"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--kid-subset-size 1000" in err and "--kid-subset-size 20 or less" in err and "subset_size=" not in err
    assert main([*argv, "--kid-subset-size", "20"]) == 0
    assert "KID" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# item 14: CLI messages name flags, not Python arguments


def test_cli_translates_a_library_hint_into_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A statistics file that kept no vectors: the library says ``keep=N``, the CLI ``featurehooks stats --keep N``."""
    a, b = _stats_file(tmp_path / "a.npz", 20, 0, 0), _stats_file(tmp_path / "b.npz", 20, 0, 1)
    assert main(["fd", str(a), str(b), "--backbone", "resnet18", "--layers", "layer4", "--kid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featurehooks: error: ") and len(err.splitlines()) == 1
    assert "featurehooks stats --keep N" in err and "(--keep 0)" in err
    assert "keep=" not in err


@pytest.mark.parametrize(
    ("library", "cli"),
    [
        (
            "pass weights=None for random init or weights='path/to/vgg16.pth' for a local file",
            "pass --weights none for random init or --weights path/to/vgg16.pth for a local file",
        ),
        (
            "pass weights='path/to/file.safetensors', or weights=None for random init",
            "pass --weights path/to/file.safetensors, or --weights none for random init",
        ),
        ("dump it with pool=None or pool='cls'", "dump it with --pool none or --pool cls"),
        ("overwrite=True (--overwrite) starts over", "--overwrite starts over"),
        (
            "finish it with dump_features(..., resume=True) first",
            "finish it with `featurehooks extract ... --resume` first",
        ),
        (
            "no layers requested; pick some from featurehooks.list_layers(model)",
            "no layers requested; pick some from `featurehooks layers`",
        ),
    ],
)
def test_cli_message_names_flags(library: str, cli: str) -> None:
    assert cli_message(library) == cli


def test_cli_uncached_weights_suggest_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: torchvision weights that are not cached (no network here) name ``--weights none``."""
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((40, 44, 3), dtype=np.uint8)).save(folder / "0.png")
    argv = ["extract", str(folder), "--out", str(tmp_path / "out"), "--backbone", "resnet34", "--layers", "layer1"]
    code = main([*argv, "-q"])
    err = capsys.readouterr().err
    if code == 0:
        pytest.skip("resnet34's weights are cached here")
    assert code == 2 and "--weights none" in err and "weights=None" not in err, err


# --------------------------------------------------------------------------------------------------
# item 14: the examples write to demo-output/ (ignored by git) by default, never into the repository


def _example(name: str) -> ModuleType:
    return load_script(f"examples/{name}.py")


@pytest.mark.parametrize("name", ["watch_training", "grad_cam", "style_transfer"])
def test_examples_write_to_demo_output_by_default(name: str) -> None:
    args = _example(name).parse_args([])
    assert args.out.parts[0] == "demo-output", args.out
    assert _example(name).parse_args(["--out", "x/y.png"]).out == Path("x/y.png")


def test_cli_fd_warns_in_one_line_on_small_sets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _stats_file(tmp_path / "a.npz", 5, 0, 0), _stats_file(tmp_path / "b.npz", 40, 0, 1)
    assert main(["fd", str(a), str(b), "--backbone", "resnet18", "--layers", "layer4"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("featurehooks: warning: layer4: a holds 5 feature vectors in 8")
    assert "use at least 9 vectors" in err[0]
