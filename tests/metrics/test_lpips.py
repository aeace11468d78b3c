"""Calibrated LPIPS equals the lpips package on the same trunk weights and heads; heads, freezing, errors, pairs."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from featurehooks.errors import InputNotFoundError, InvalidTypeError, InvalidValueError, WeightsUnavailableError
from featurehooks.metrics import ImagePair, pair_files, score_pairs
from featurehooks.metrics import lpips as fh_lpips
from featurehooks.metrics.lpips import LPIPS, find_heads, load_heads

from helpers import bf16_value_and_grad

lpips = pytest.importorskip("lpips")

NETS = ("alex", "vgg", "squeeze")
# the VGG16 trunk, the slowest of the three, only in make test (not in make test-fast)
NETS_FAST_ALEX_SQUEEZE = [pytest.param(net, marks=pytest.mark.slow) if net == "vgg" else net for net in NETS]
ATOL = 1e-5


@pytest.fixture(scope="module")
def pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Two batches in [0, 1]; not square, so the spatial maps show that height and width keep their places."""
    generator = torch.Generator().manual_seed(3)
    return torch.rand(2, 3, 64, 48, generator=generator), torch.rand(2, 3, 64, 48, generator=generator)


def reference(net: str, **kwargs: object) -> nn.Module:
    with contextlib.redirect_stdout(io.StringIO()):  # lpips prints on construction
        return lpips.LPIPS(net=net, verbose=False, **kwargs)


def input_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(leaf).sum(), leaf)
    return grad


# ------------------------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize("net", NETS_FAST_ALEX_SQUEEZE)
def test_equals_lpips_per_sample_spatial_and_in_gradients(lpips_trunks: None, pair, net: str) -> None:
    x, y = pair
    x1, y1 = 2 * x - 1, 2 * y - 1  # lpips' own range
    expected = reference(net, version="0.1")(x1, y1).flatten()
    ours = LPIPS(net, reduction="none")
    ours_signed = LPIPS(net, reduction="none", input_range=(-1, 1))
    assert expected.min() > 0
    torch.testing.assert_close(ours(x, y), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_signed(x1, y1), expected, atol=ATOL, rtol=0)
    # gradients to the input: lpips' are per unit of [-1, 1], twice those per unit of [0, 1]
    ref = reference(net, version="0.1")
    expected_grad = 2 * input_grad(lambda a: ref(a, y1), x1)
    torch.testing.assert_close(input_grad(lambda a: ours(a, y), x), expected_grad, rtol=1e-4, atol=1e-6)
    # the spatial maps, at the input size
    spatial = LPIPS(net, reduction="none", spatial=True)(x, y)
    expected_map = reference(net, version="0.1", spatial=True)(x1, y1)
    assert spatial.shape == expected_map.shape == (2, 1, 64, 48)
    torch.testing.assert_close(spatial, expected_map, atol=ATOL, rtol=0)


@pytest.mark.parametrize("net", NETS_FAST_ALEX_SQUEEZE)
def test_uncalibrated_equals_lpips_baseline(lpips_trunks: None, pair, net: str) -> None:
    x, y = pair
    expected = reference(net, lpips=False)(2 * x - 1, 2 * y - 1).flatten()
    metric = LPIPS(net, calibrated=False, reduction="none")
    torch.testing.assert_close(metric(x, y), expected, atol=ATOL, rtol=1e-6)
    assert all(bool((metric.head(name) == 1).all()) for name in metric.layers)


def test_version_0_0_equals_lpips(lpips_trunks: None, pair) -> None:
    x, y = pair
    expected = reference("alex", version="0.0")(2 * x - 1, 2 * y - 1).flatten()
    torch.testing.assert_close(LPIPS("alex", "0.0", reduction="none")(x, y), expected, atol=ATOL, rtol=0)


def test_one_forward_and_two_forwards_agree_in_values_and_gradients(lpips_trunks: None, pair) -> None:
    """Metric (concatenated batch), loss (graph-free target), both with graphs, and a broadcast target."""
    x, y = pair
    metric = LPIPS("alex", reduction="none")
    with torch.no_grad():
        concatenated = metric(x, y)
    leaf_x, leaf_y = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    both = metric(leaf_x, leaf_y)
    torch.testing.assert_close(metric(leaf_x, y), concatenated, atol=1e-6, rtol=0)
    torch.testing.assert_close(both, concatenated, atol=1e-6, rtol=0)
    grad_x, grad_y = torch.autograd.grad(both.sum(), (leaf_x, leaf_y))
    torch.testing.assert_close(grad_x, input_grad(lambda a: metric(a, y), x), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(grad_y, input_grad(lambda b: metric(x, b), y), rtol=1e-4, atol=1e-7)
    broadcast = metric(x, y[:1])
    torch.testing.assert_close(broadcast, metric(x, y[:1].expand_as(x)), atol=1e-6, rtol=0)


def test_reductions(lpips_trunks: None, pair) -> None:
    x, y = pair
    per_sample = LPIPS("squeeze", reduction="none")(x, y)
    assert LPIPS("squeeze")(x, y).shape == ()
    torch.testing.assert_close(LPIPS("squeeze")(x, y), per_sample.mean())
    torch.testing.assert_close(LPIPS("squeeze", reduction="sum")(x, y), per_sample.sum())
    maps = LPIPS("squeeze", spatial=True, reduction="none")(x, y)
    mean_map = LPIPS("squeeze", spatial=True)(x, y)  # spatial: reduced over the batch only
    assert mean_map.shape == (1, 64, 48)
    torch.testing.assert_close(mean_map, maps.mean(dim=0))
    torch.testing.assert_close(LPIPS("squeeze", spatial=True, reduction="sum")(x, y), maps.sum(dim=0))
    layers = LPIPS("squeeze", reduction="none").layer_distances(x, y)
    assert list(layers) == ["relu1", "fire3", "fire5", "fire6", "fire7", "fire8", "fire9"]
    torch.testing.assert_close(sum(layers.values()), per_sample)


# --------------------------------------------------------------------------------------------------- heads


@pytest.mark.slow
def test_finds_lpips_heads_without_importing_lpips() -> None:
    assert find_heads("alex") == Path(lpips.__file__).parent / "weights" / "v0.1" / "alex.pth"
    assert find_heads("vgg16", "0.0") == Path(lpips.__file__).parent / "weights" / "v0.0" / "vgg.pth"
    script = (
        "import sys; from featurehooks.metrics.lpips import find_heads; "
        "assert find_heads('squeeze') is not None; assert 'lpips' not in sys.modules, 'imported lpips'"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_finds_torchmetrics_copy_by_its_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundled = tmp_path / "torchmetrics" / "functional" / "image" / "lpips_models" / "alex.pth"
    bundled.parent.mkdir(parents=True)
    shutil.copy(find_heads("alex"), bundled)
    folders = {"lpips": None, "torchmetrics": tmp_path / "torchmetrics"}
    monkeypatch.setattr(fh_lpips, "package_dir", folders.get)
    assert find_heads("alex") == bundled
    assert find_heads("alex", "0.0") is None  # torchmetrics bundles version 0.1 only


def test_heads_from_a_file(lpips_trunks: None, pair, tmp_path: Path) -> None:
    x, y = pair
    default = LPIPS("alex", reduction="none")
    state = torch.load(find_heads("alex"), map_location="cpu", weights_only=True)
    doubled = tmp_path / "doubled.pth"
    torch.save({key: 2 * value for key, value in state.items()}, doubled)
    metric = LPIPS("alex", reduction="none", heads=doubled)
    torch.testing.assert_close(metric(x, y), 2 * default(x, y))
    assert metric.heads_source == str(doubled)
    # the same heads under other key layouts (a ModuleList, no Dropout, a DataParallel prefix) and in memory
    renamed = {f"module.lins.{key[3]}.model.0.weight": value for key, value in state.items()}
    torch.testing.assert_close(LPIPS("alex", reduction="none", heads=renamed)(x, y), default(x, y))


def test_missing_heads_say_how_to_get_them(lpips_trunks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fh_lpips, "package_dir", lambda name: None)  # neither lpips nor torchmetrics installed
    assert find_heads("alex") is None
    with pytest.raises(WeightsUnavailableError, match=r"pip install lpips.*heads='path/to/alex.pth'"):
        LPIPS("alex")
    assert LPIPS("alex", calibrated=False).heads_source.startswith("uncalibrated")  # needs no heads


def test_unusable_head_files_are_clear_errors(lpips_trunks: None, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a torch file")
    with pytest.raises(WeightsUnavailableError, match="corrupt.pth"):
        LPIPS("alex", heads=corrupt)
    with pytest.raises(WeightsUnavailableError, match=r"vgg.pth: head 1 has shape \(1, 128, 1, 1\).*another net"):
        load_heads(find_heads("vgg"), "alex")
    other = tmp_path / "other.pth"
    torch.save({"conv.weight": torch.ones(3)}, other)
    with pytest.raises(WeightsUnavailableError, match=r"other.pth does not hold LPIPS heads.*lin0\.model\.1\.weight"):
        LPIPS("alex", heads=other)
    negative = {f"lin{k}.model.1.weight": -torch.ones(1, c, 1, 1) for k, c in enumerate((64, 192, 384, 256, 256))}
    with pytest.raises(WeightsUnavailableError, match="non-negative"):
        load_heads(negative, "alex")
    with pytest.raises(WeightsUnavailableError, match="weights file not found"):
        LPIPS("alex", heads=tmp_path / "missing.pth")


# ------------------------------------------------------------------------------------ frozen, AMP, edge values


def test_frozen_in_eval_and_out_of_the_state_dict(lpips_trunks: None) -> None:
    metric = LPIPS("alex")
    parent = nn.Sequential(nn.Conv2d(3, 3, 1), metric)
    parent.train()
    assert not metric.training and not metric.extractor.backbone.training
    assert all(not p.requires_grad for p in metric.parameters()) and not list(metric.parameters())
    assert all(not p.requires_grad for p in metric.extractor.backbone.parameters())
    assert metric.state_dict() == {}  # no backbone weights, no heads (they come from files)
    assert set(parent.state_dict()) == {"0.weight", "0.bias"}
    assert {name for name, _ in metric.named_buffers()} >= {f"head_relu{k}" for k in range(1, 6)}
    assert repr(metric).startswith(
        "LPIPS(\n  net='alex', version='0.1', calibrated=True, spatial=False, reduction='mean', input_range=(0.0, 1.0)"
    )


def test_bf16_autocast_is_finite_and_close(lpips_trunks: None, pair) -> None:
    x, y = pair
    metric = LPIPS("alex", reduction="none")
    value, _ = bf16_value_and_grad(metric, x, y)
    torch.testing.assert_close(value, metric(x, y).detach(), rtol=0.1, atol=0)


def test_identical_and_black_images_give_zero_with_finite_gradients(lpips_trunks: None, pair) -> None:
    x, _ = pair
    metric = LPIPS("vgg", reduction="none")
    black = torch.zeros_like(x)
    for image in (x, black):
        with torch.no_grad():
            assert metric(image, image).abs().max() <= 1e-7  # one concatenated forward
        leaf = image.clone().requires_grad_(True)
        value = metric(leaf, image)  # two forwards
        (grad,) = torch.autograd.grad(value.sum(), leaf)
        assert bool((value == 0).all()) and torch.isfinite(grad).all()
    grad = input_grad(lambda a: metric(a, x), black)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.slow
def test_compiles_to_one_graph(lpips_trunks: None, pair) -> None:
    x, y = pair
    metric = LPIPS("alex", reduction="none")
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(metric, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    with torch.no_grad():  # compiled first: the per-thread state is born inside a compiled frame, then recompiled
        out = compiled(x, y)
    expected = metric(x, y)
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(compiled(leaf, y).sum(), leaf)
    if time.perf_counter() - start > 90:
        pytest.skip("compiling took over 90 s on this machine")
    torch.testing.assert_close(out, expected.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, input_grad(lambda a: metric(a, y), x), rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_arguments_are_clear_errors(lpips_trunks: None, pair) -> None:
    x, y = pair
    with pytest.raises(InvalidValueError, match="did you mean 'alex'"):
        LPIPS("alexx")
    with pytest.raises(InvalidValueError, match="did you mean '0.1'"):
        LPIPS("alex", version="v0.1")
    with pytest.raises(InvalidTypeError, match="version must be a string"):
        LPIPS("alex", version=0.1)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="reduction"):
        LPIPS("alex", reduction="max")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="calibrated=False"):
        LPIPS("alex", calibrated=False, heads=find_heads("alex"))
    metric = LPIPS("alexnet", calibrated=False)  # torchvision's name works too
    assert metric.net == "alex"
    with pytest.raises(InvalidValueError, match=r"input \(2, 3, 64, 48\) and target \(2, 3, 48, 64\) do not match"):
        metric(x, y.transpose(2, 3))
    with pytest.raises(InvalidValueError, match="target's batch must be 1 or the input's"):
        metric(x, torch.cat([y, y]))
    with pytest.raises(InvalidValueError, match=r"input must be \(B, C, H, W\)"):
        metric(x[0], y[0])
    with pytest.raises(InvalidValueError, match="3 channels.*expand"):
        metric(x[:, :1], y[:, :1])
    with pytest.raises(InvalidTypeError, match="target must be a Tensor"):
        metric(x, y.numpy())  # type: ignore[arg-type]


def test_extractor_options_are_forwarded_and_checked(lpips_trunks: None, pair) -> None:
    x, y = pair
    metric = LPIPS("alex", reduction="none", memory_format="contiguous", precision="float32")
    extractor = metric.extractor
    assert (extractor.memory_format, extractor.precision) == ("contiguous", "float32")
    torch.testing.assert_close(metric(x, y), LPIPS("alex", reduction="none")(x, y), atol=ATOL, rtol=0)
    with pytest.raises(InvalidTypeError, match="LPIPS takes no option memory_formt=; .*'memory_format'"):
        LPIPS("alex", calibrated=False, memory_formt="contiguous")
    for option in ("mean", "normalize", "mode", "output_format"):  # the features the heads were fitted on
        with pytest.raises(InvalidTypeError, match=f"LPIPS sets {option}= itself"):
            LPIPS("alex", calibrated=False, **{option: None})


# ----------------------------------------------------------------------------------------------- folder pairs


def _write(path: Path, size: tuple[int, int], seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


def test_pair_files_by_relative_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for name in ("x/1.png", "x/2.png", "3.png", "only_a.png"):
        _write(a / name, (8, 8), 0)
    for name in ("x/1.png", "x/2.png", "3.png", "x/only_b.png"):
        _write(b / name, (8, 8), 1)
    (b / "notes.txt").write_text("not an image")
    pairs, only_a, only_b = pair_files(a, b)
    assert [p.name for p in pairs] == ["3.png", "x/1.png", "x/2.png"]
    assert pairs[1] == ImagePair("x/1.png", str(a / "x" / "1.png"), str(b / "x" / "1.png"))
    assert (only_a, only_b) == (["only_a.png"], ["x/only_b.png"])
    _write(tmp_path / "c" / "x" / "1.jpg", (8, 8), 2)
    assert pair_files(a, tmp_path / "c")[0] == []
    assert [p.name for p in pair_files(a, tmp_path / "c", ignore_suffix=True)[0]] == ["x/1.png"]
    with pytest.raises(InputNotFoundError, match="does not exist"):
        pair_files(a, tmp_path / "missing")


@pytest.mark.slow
def test_score_pairs_streams_and_matches_the_metric(lpips_trunks: None, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sizes = {"1.png": (40, 48), "2.png": (40, 48), "3.png": (48, 40)}  # two sizes within one batch
    for k, (name, size) in enumerate(sizes.items()):
        _write(a / name, size, k)
        _write(b / name, size, 10 + k)
    pairs, _, _ = pair_files(a, b)
    metric = LPIPS("alex", reduction="none")
    expected = []
    for pair_ in pairs:
        images = [torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1)[None].float() / 255 for p in pair_[1:]]
        expected.append(float(metric(*images)))
    for workers in (0, 1):
        scores = score_pairs(metric, pairs, batch_size=2, num_workers=workers)
        assert scores == pytest.approx(expected, abs=1e-6)
    cropped = score_pairs(metric, pairs, batch_size=3, num_workers=0, crop_size=32)
    assert len(cropped) == 3 and all(s > 0 for s in cropped)
    assert score_pairs(metric, [], batch_size=2) == []


def test_score_pairs_errors_name_the_file(lpips_trunks: None, tmp_path: Path) -> None:
    _write(tmp_path / "a.png", (40, 40), 0)
    _write(tmp_path / "b.png", (40, 48), 1)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    metric = LPIPS("alex", reduction="none")
    with pytest.raises(InvalidValueError, match=r"cannot read image .*broken\.png"):
        score_pairs(metric, [(tmp_path / "a.png", broken)], num_workers=0)
    with pytest.raises(InvalidValueError, match=r"differ in size.*a\.png is \(40, 40\).*b\.png is \(40, 48\)"):
        score_pairs(metric, [(tmp_path / "a.png", tmp_path / "b.png")], num_workers=0)
    with pytest.raises(InvalidValueError, match="one value per pair.*reduction='none'"):
        score_pairs(LPIPS("alex"), [(tmp_path / "a.png", tmp_path / "a.png")], num_workers=0)


@pytest.mark.parametrize(
    ("net", "smallest"), [("alex", 31), pytest.param("vgg", 16, marks=pytest.mark.slow), ("squeeze", 17)]
)
def test_too_small_images_are_refused_before_the_trunk_fails(net: str, smallest: int) -> None:
    torch.manual_seed(0)
    metric = LPIPS(net, weights=None, reduction="none")
    small = torch.rand(1, 3, smallest - 1, 40)
    with pytest.raises(InvalidValueError, match=f"at least {smallest}x{smallest}"):
        metric(small, small)
    fits = torch.rand(1, 3, smallest, smallest)
    assert metric(fits, fits).shape == (1,)
