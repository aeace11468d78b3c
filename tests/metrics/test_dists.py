"""DISTS equals DISTS_pytorch on the same VGG16 weights and alpha/beta; L2 pooling, freezing, AMP, files, errors."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from featurehooks.errors import InvalidTypeError, InvalidValueError, WeightsUnavailableError
from featurehooks.metrics import dists as fh_dists
from featurehooks.metrics.dists import DISTS, MIN_SIDE, L2Pool2d, find_alpha_beta, load_alpha_beta

from helpers import bf16_value_and_grad

DISTS_pytorch = pytest.importorskip("DISTS_pytorch")
from DISTS_pytorch import DISTS_pt  # noqa: E402  (after the skip: DISTS_pytorch is a dev extra)

ATOL = 1e-5
# (height, width): square, not square both ways, the smallest side DISTS takes, an odd size that L2 pooling rounds up
SIZES = [(64, 48), (48, 64), (MIN_SIDE, 40), (37, 37)]


@pytest.fixture(scope="module")
def reference(vgg16_cached: Path) -> nn.Module:
    """DISTS_pytorch's model: it builds torchvision's vgg16(pretrained=True), which reads the seeded cache file."""
    return DISTS_pt.DISTS()


@pytest.fixture(scope="module")
def metric(vgg16_cached: Path) -> DISTS:
    return DISTS(reduction="none")


def pair(size: tuple[int, int], batch: int = 2, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, *size, generator=generator), torch.rand(batch, 3, *size, generator=generator)


def grads(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple:
    """Gradients of ``fn(x, y).sum()`` to both images."""
    leaves = x.detach().clone().requires_grad_(True), y.detach().clone().requires_grad_(True)
    return torch.autograd.grad(fn(*leaves).sum(), leaves)


# ------------------------------------------------------------------------------------------------- oracle


@pytest.mark.slow
def test_uses_the_same_trunk_and_alpha_beta_as_the_reference(reference: nn.Module, metric: DISTS) -> None:
    theirs = {
        key.split(".", 1)[1].replace(".filter", ".window"): value
        for key, value in reference.state_dict().items()
        if key.startswith("stage")
    }
    ours = metric.extractor.backbone.state_dict()
    assert ours.keys() == theirs.keys()  # the convolutions by their index in vgg16().features, and the pooling windows
    for key, value in ours.items():
        assert torch.equal(value, theirs[key].reshape(value.shape)), key
    total = reference.alpha.sum() + reference.beta.sum()
    assert torch.equal(metric.alpha, (reference.alpha / total).flatten())
    assert torch.equal(metric.beta, (reference.beta / total).flatten())


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES)
def test_equals_dists_pytorch_per_sample_and_in_gradients(
    reference: nn.Module, metric: DISTS, size: tuple[int, int]
) -> None:
    x, y = pair(size)
    expected = reference(x, y).detach()  # per sample: the reference's default
    assert expected.shape == (2,) and bool((expected > 0).all())
    torch.testing.assert_close(metric(x, y), expected, atol=ATOL, rtol=0)
    ref_grads = grads(lambda a, b: reference(a, b, require_grad=True), x, y)
    our_grads = grads(metric, x, y)
    for ours, theirs in zip(our_grads, ref_grads):
        assert theirs.abs().max() > 0
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()))
    # the reference's default require_grad=False runs VGG without a graph, yet its image term keeps one: an input
    # gradient then comes back, from that term alone
    (partial,) = grads(reference, x, y)[:1]
    assert (partial - ref_grads[0]).abs().max() > 0.1 * ref_grads[0].abs().max()


@pytest.mark.slow
def test_input_range_changes_nothing_but_the_units(reference: nn.Module, vgg16_cached: Path) -> None:
    x, y = pair((40, 36))
    expected = reference(x, y).detach()
    signed = DISTS(reduction="none", input_range=(-1, 1))
    torch.testing.assert_close(signed(2 * x - 1, 2 * y - 1), expected, atol=ATOL, rtol=0)
    # gradients per unit of [-1, 1] are half those per unit of [0, 1]
    (expected_grad,) = grads(lambda a, b: reference(a, b, require_grad=True), x, y)[:1]
    (ours,) = grads(signed, 2 * x - 1, 2 * y - 1)[:1]
    torch.testing.assert_close(2 * ours, expected_grad, rtol=1e-4, atol=1e-5 * float(expected_grad.abs().max()))


@pytest.mark.slow
def test_reductions_and_the_references_batch_average(reference: nn.Module, metric: DISTS) -> None:
    x, y = pair((40, 36), batch=3)
    per_sample = metric(x, y)
    mean, total = DISTS(), DISTS(reduction="sum")
    assert mean(x, y).shape == () and per_sample.shape == (3,)
    torch.testing.assert_close(
        mean(x, y), reference(x, y, require_grad=True, batch_average=True).detach(), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(mean(x, y), per_sample.mean())
    torch.testing.assert_close(total(x, y), per_sample.sum())
    # the reference squeezes a batch of one to a scalar; reduction="none" keeps one value per image
    assert reference(x[:1], y[:1]).shape == () and metric(x[:1], y[:1]).shape == (1,)


def test_one_forward_and_two_forwards_agree_and_a_target_of_batch_one_broadcasts(metric: DISTS) -> None:
    x, y = pair((40, 36))
    with torch.no_grad():
        plain = metric(x, y)
    leaf_x, leaf_y = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    torch.testing.assert_close(metric(leaf_x, y), plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(metric(leaf_x, leaf_y), plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(metric(x, y[:1]), metric(x, y[:1].expand_as(x)), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------------------ pooling


@pytest.mark.parametrize("size", [(8, 8), (9, 7), (1, 5)])
def test_l2_pooling_equals_the_references(size: tuple[int, int]) -> None:
    x = torch.randn(2, 4, *size, generator=torch.Generator().manual_seed(0))
    expected = DISTS_pt.L2pooling(channels=4)(x)
    ours = L2Pool2d(4)(x)
    assert ours.shape == expected.shape == (2, 4, -(-size[0] // 2), -(-size[1] // 2))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


def test_l2_pooling_does_not_overflow_in_half_precision() -> None:
    x = torch.full((1, 2, 4, 4), 1000.0, dtype=torch.float16)  # squares 1e6 > float16's 65504
    out = L2Pool2d(2)(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), L2Pool2d(2)(x.float()), rtol=1e-3, atol=0)


# --------------------------------------------------------------------------------- frozen, AMP, edge values


def test_frozen_in_eval_and_out_of_the_state_dict(metric: DISTS) -> None:
    parent = nn.Sequential(nn.Conv2d(3, 3, 1), metric)
    parent.train()
    assert not metric.training and not metric.extractor.backbone.training
    assert not list(metric.parameters()) and not list(parent[1].parameters())
    assert all(not p.requires_grad for p in metric.extractor.backbone.parameters())
    assert metric.state_dict() == {}  # no trunk weights, no alpha/beta (they come from files)
    assert set(parent.state_dict()) == {"0.weight", "0.bias"}
    assert {name for name, _ in metric.named_buffers()} >= {"alpha", "beta"}
    torch.testing.assert_close(metric.alpha.sum() + metric.beta.sum(), torch.tensor(1.0))
    assert repr(metric).startswith(
        "DISTS(\n  calibrated=True, reduction='none', input_range=(0.0, 1.0), weights='VGG16_Weights.IMAGENET1K_V1'"
    )
    assert "backbone='L2PooledVGG16'" in repr(metric)
    pools = [m for m in metric.extractor.backbone.modules() if isinstance(m, L2Pool2d)]
    assert len(pools) == 4 and not any(isinstance(m, nn.MaxPool2d) for m in metric.extractor.backbone.modules())


def test_bf16_autocast_is_finite_and_close(metric: DISTS) -> None:
    x, y = pair((48, 40))
    value, grad = bf16_value_and_grad(metric, x, y)
    torch.testing.assert_close(value, metric(x, y).detach(), rtol=0.05, atol=0)
    (full,) = grads(metric, x, y)[:1]
    cosine = torch.nn.functional.cosine_similarity(grad.flatten(), full.flatten(), dim=0)
    assert cosine > 0.9


def test_identical_and_black_images_give_zero_with_finite_gradients(metric: DISTS) -> None:
    """Exactly 0, never a rounding below it (``1 - sum`` gave -4e-8 for identical images), and never negative."""
    x, y = pair((40, 36))
    for image in (x, torch.zeros_like(x)):
        with torch.no_grad():
            assert torch.equal(metric(image, image), torch.zeros(len(image)))
        leaf = image.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(metric(leaf, image).sum(), leaf)
        assert torch.isfinite(grad).all()
    (grad,) = grads(metric, torch.zeros_like(x), x)[:1]
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        near = (x + 1e-4 * torch.randn_like(x)).clamp(0, 1)
        assert bool((metric(near, x) >= 0).all()) and bool((metric(x, y) > 0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_one_concatenated_forward_equals_the_reference(
    reference: nn.Module, metric: DISTS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 convolutions round to 1e-3
    x, y = (image.cuda() for image in pair((64, 48)))
    cuda_reference, cuda_metric = reference.cuda(), metric.cuda()
    try:
        with torch.no_grad():
            torch.testing.assert_close(cuda_metric(x, y), cuda_reference(x, y), atol=ATOL, rtol=0)
            with torch.autocast("cuda", dtype=torch.float16):
                half = cuda_metric(x, y)
        assert half.dtype == torch.float32 and torch.isfinite(half).all()
        torch.testing.assert_close(half, cuda_metric(x, y), rtol=0.05, atol=0)
        ref_grads = grads(lambda a, b: cuda_reference(a, b, require_grad=True), x, y)
        for ours, theirs in zip(grads(cuda_metric, x, y), ref_grads):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * float(theirs.abs().max()))
    finally:
        reference.cpu()
        metric.cpu()


@pytest.mark.slow
def test_compiles_to_one_graph(metric: DISTS) -> None:
    x, y = pair((40, 36))
    torch._dynamo.reset()
    start = time.perf_counter()
    compiled = torch.compile(metric, fullgraph=True, backend="eager")  # fullgraph: a graph break is an error
    with torch.no_grad():
        out = compiled(x, y)
    (grad,) = grads(compiled, x, y)[:1]
    if time.perf_counter() - start > 90:
        pytest.skip("compiling took over 90 s on this machine")
    torch.testing.assert_close(out, metric(x, y).detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, grads(metric, x, y)[0], rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------- alpha/beta


@pytest.mark.slow
def test_finds_the_bundled_file_without_importing_dists_pytorch() -> None:
    assert find_alpha_beta() == Path(DISTS_pytorch.__file__).parent / "weights.pt"
    script = (
        "import sys; from featurehooks.metrics.dists import find_alpha_beta; "
        "assert find_alpha_beta() is not None; assert 'DISTS_pytorch' not in sys.modules, 'imported DISTS_pytorch'"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.slow
def test_alpha_beta_from_a_file_or_a_dict(reference: nn.Module, tmp_path: Path, vgg16_cached: Path) -> None:
    x, y = pair((40, 36))
    state = torch.load(find_alpha_beta(), map_location="cpu", weights_only=True)
    swapped = tmp_path / "swapped.pt"
    torch.save({"alpha": state["beta"], "beta": state["alpha"]}, swapped)
    metric = DISTS(reduction="none", alpha_beta=swapped)
    assert metric.alpha_beta_source == str(swapped)
    with torch.no_grad():
        alpha, beta = reference.alpha.clone(), reference.beta.clone()
        reference.alpha.copy_(beta)
        reference.beta.copy_(alpha)
        try:
            expected = reference(x, y).detach()
        finally:
            reference.alpha.copy_(alpha)
            reference.beta.copy_(beta)
    torch.testing.assert_close(metric(x, y), expected, atol=ATOL, rtol=0)
    # any layout, any scale: DISTS divides by their sum
    flat = load_alpha_beta({key: 3 * value.flatten() for key, value in state.items()})
    torch.testing.assert_close([3 * value for value in load_alpha_beta(find_alpha_beta())], list(flat))


def test_missing_alpha_beta_say_how_to_get_them(monkeypatch: pytest.MonkeyPatch, vgg16_cached: Path) -> None:
    monkeypatch.setattr(fh_dists, "package_dir", lambda name: None)  # DISTS_pytorch not installed
    assert find_alpha_beta() is None
    with pytest.raises(WeightsUnavailableError, match=r"pip install DISTS_pytorch.*alpha_beta='path/to/weights.pt'"):
        DISTS()
    metric = DISTS(calibrated=False, reduction="none")  # needs no file
    assert metric.alpha_beta_source.startswith("uncalibrated")
    torch.testing.assert_close(metric.alpha, torch.full((1475,), 1 / 2950))


def test_unusable_alpha_beta_files_are_clear_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a torch file")
    with pytest.raises(WeightsUnavailableError, match="corrupt.pt"):
        load_alpha_beta(corrupt)
    with pytest.raises(WeightsUnavailableError, match="weights file not found"):
        load_alpha_beta(tmp_path / "missing.pt")
    with pytest.raises(WeightsUnavailableError, match=r"does not hold DISTS weights.*'alpha' and 'beta'.*it has w"):
        load_alpha_beta({"w": torch.ones(3)})
    with pytest.raises(WeightsUnavailableError, match=r"alpha has shape \(1, 1000, 1, 1\)"):
        load_alpha_beta({"alpha": torch.ones(1, 1000, 1, 1), "beta": torch.ones(1, 1475, 1, 1)})
    with pytest.raises(WeightsUnavailableError, match="beta holds negative"):
        load_alpha_beta({"alpha": torch.ones(1475), "beta": -torch.ones(1475)})
    with pytest.raises(WeightsUnavailableError, match="all zero"):
        load_alpha_beta({"alpha": torch.zeros(1475), "beta": torch.zeros(1475)})


# ------------------------------------------------------------------------------------------------- bad input


def test_extractor_options_are_forwarded_and_checked(metric: DISTS) -> None:
    x, y = pair((40, 36))
    forwarded = DISTS(reduction="none", memory_format="contiguous", precision="float32")
    extractor = forwarded.extractor
    assert (extractor.memory_format, extractor.precision) == ("contiguous", "float32")
    torch.testing.assert_close(forwarded(x, y), metric(x, y), atol=ATOL, rtol=0)
    with pytest.raises(InvalidTypeError, match="DISTS takes no option precison=; .*'precision'"):
        DISTS(weights=None, calibrated=False, precison="bf16")
    with pytest.raises(InvalidTypeError, match="DISTS sets std= itself"):
        DISTS(weights=None, calibrated=False, std=(1.0, 1.0, 1.0))


def test_bad_arguments_and_images_are_clear_errors(metric: DISTS) -> None:
    x, y = pair((40, 36))
    with pytest.raises(InvalidValueError, match="reduction"):
        DISTS(reduction="max")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="calibrated=False"):
        DISTS(calibrated=False, alpha_beta=find_alpha_beta())
    with pytest.raises(InvalidTypeError, match="alpha_beta must be a path"):
        DISTS(alpha_beta=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match=r"input \(2, 3, 40, 36\) and target \(2, 3, 36, 40\) do not match"):
        metric(x, y.transpose(2, 3))
    with pytest.raises(InvalidValueError, match="target's batch must be 1 or the input's"):
        metric(x, torch.cat([y, y]))
    with pytest.raises(InvalidValueError, match="3 channels.*expand"):
        metric(x[:, :1], y[:, :1])
    with pytest.raises(InvalidTypeError, match="target must be a Tensor"):
        metric(x, y.numpy())  # type: ignore[arg-type]
    small = torch.rand(1, 3, MIN_SIDE - 1, 40)
    with pytest.raises(InvalidValueError, match=f"at least {MIN_SIDE}x{MIN_SIDE}.*upsample"):
        metric(small, small)
