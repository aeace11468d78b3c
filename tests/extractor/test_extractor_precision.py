"""``precision=``: float32 stays what it was, bf16 stores the backbone once and runs in it, devices that cannot are
refused, and ``repr`` says what runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import featurehooks as fh
from featurehooks import _precision
from featurehooks.errors import InvalidValueError

from helpers import CASTS, bf16_anywhere, needs_cpu_bf16, photos, tiny_extractor

LAYERS = ["relu2_2", "relu3_3"]


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return photos(64, 2)


def vgg(**options: object) -> fh.FeatureExtractor:
    torch.manual_seed(0)
    return fh.FeatureExtractor("vgg16", LAYERS, weights=None, **options)  # type: ignore[arg-type]


def test_float32_is_the_default_and_changes_nothing(images: torch.Tensor) -> None:
    default, explicit = tiny_extractor(), tiny_extractor(precision="float32")
    assert default.precision == "float32" and default.compute_dtype == torch.float32
    assert "precision" not in repr(default)
    assert all(p.dtype == torch.float32 for p in default.backbone.parameters())
    for a, b in zip(default(images).values(), explicit(images).values()):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    # the hand-written arithmetic, bitwise: (x - mean) / std through the same seeded layers
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, stride=2)
    expected = torch.relu(conv((images - 0.5) / 0.25))
    assert torch.equal(default(images)["relu1"], expected)


def test_float32_keeps_an_enclosing_autocast(images: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert tiny_extractor()(images)["conv2"].dtype == torch.bfloat16


@needs_cpu_bf16
def test_bf16_stores_the_backbone_once_and_returns_bf16_features(images: torch.Tensor) -> None:
    ext, reference = vgg(precision="bf16"), vgg()
    assert ext.compute_dtype == torch.bfloat16 and ext.dtype == torch.float32  # normalization stays float32
    assert ext.mean.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in ext.backbone.parameters())
    found, expected = ext(images), reference(images)
    for name in LAYERS:
        assert found[name].dtype == torch.bfloat16 and found[name].shape == expected[name].shape
        scale = expected[name].abs().max()
        assert (found[name].float() - expected[name]).abs().max() / scale < 0.05  # bf16: ~3 significant digits
    assert ext.output_shapes((1, 3, 40, 48)) == reference.output_shapes((1, 3, 40, 48))
    assert ext.activation_bytes(64, 64) * 2 == reference.activation_bytes(64, 64)


@bf16_anywhere
def test_bf16_outranks_an_enclosing_autocast_and_survives_casts(images: torch.Tensor) -> None:
    ext = tiny_extractor(precision="bf16")
    with torch.autocast("cpu", dtype=torch.float16):
        assert ext(images)["conv2"].dtype == torch.bfloat16
    ext.float()  # a parent's .float() / .to(dtype) must not undo the precision
    assert all(p.dtype == torch.bfloat16 for p in ext.backbone.parameters())
    assert ext(images)["conv2"].dtype == torch.bfloat16


@bf16_anywhere
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bf16_input_gradients_come_back_in_the_inputs_dtype(images: torch.Tensor, dtype: torch.dtype) -> None:
    ext, reference = tiny_extractor(mode="grad", precision="bf16"), tiny_extractor(mode="grad")
    leaf, leaf32 = images.to(dtype, copy=True).requires_grad_(), images.clone().requires_grad_()
    ext(leaf)["conv2"].float().square().mean().backward()
    reference(leaf32)["conv2"].square().mean().backward()
    assert leaf.grad is not None and leaf32.grad is not None and leaf.grad.dtype == dtype
    cosine = torch.nn.functional.cosine_similarity(leaf.grad.flatten().float(), leaf32.grad.flatten(), dim=0)
    assert cosine > 0.99


@bf16_anywhere
def test_repr_says_what_runs() -> None:
    text = repr(tiny_extractor(precision="bf16"))
    assert "precision='bf16'" in text
    assert "precision='bf16'" in repr(fh.PerceptualLoss(tiny_extractor(mode="grad", precision="bf16"), ["relu1"]))


@pytest.mark.parametrize("bad", ["bfloat16", "half", torch.bfloat16, None])
def test_an_unknown_precision_is_refused(bad: object) -> None:
    with pytest.raises(InvalidValueError, match="precision must be 'float32', 'bf16' or 'fp16'"):
        tiny_extractor(precision=bad)


def test_fp16_on_a_cpu_without_float16_kernels_is_refused_at_the_forward(images: torch.Tensor) -> None:
    if torch.ops.mkldnn._is_mkldnn_fp16_supported():
        pytest.skip("this CPU has native float16 kernels: fp16 runs")
    ext = tiny_extractor(precision="fp16")  # built anywhere: it may be moved to a GPU before its first forward
    assert "precision='fp16'" in repr(ext)
    with pytest.raises(InvalidValueError, match=r"precision='fp16' cannot run on cpu: .*emulated.*bf16"):
        ext(images)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile's caches emptied before and after: a compiled check's answer (a constant) stays in them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_compiled_forward_is_refused_as_an_eager_one(
    monkeypatch: pytest.MonkeyPatch, images: torch.Tensor, precision: str
) -> None:
    """The device check runs while torch.compile traces (its answer a constant there): a compiled extractor on a
    device that cannot run the precision raises the eager error, not a silently emulated forward."""
    monkeypatch.setattr(_precision, "unsupported", lambda *args: "no kernels for it here")
    whole = torch.compile(tiny_extractor(precision=precision), backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="no kernels for it here"):  # torch's error, our reason
        whole(images)
    torch._dynamo.reset()
    compiled = torch.compile(tiny_extractor(precision=precision), backend="eager")
    with pytest.raises(InvalidValueError, match=rf"precision='{precision}' cannot run on cpu: no kernels for it here"):
        compiled(images)


@bf16_anywhere
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_bf16_forward_compiles_to_one_graph(images: torch.Tensor) -> None:
    """Where the device runs it, the check costs a compiled forward no graph break: fullgraph=True compiles."""
    ext = tiny_extractor(mode="grad", precision="bf16")
    found = torch.compile(ext, fullgraph=True, backend="eager")(images)
    for name, expected in ext(images).items():
        assert found[name].dtype == torch.bfloat16 and torch.equal(found[name], expected), name


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    _precision.unsupported.cache_clear()
    try:
        with pytest.raises(InvalidValueError, match=r"precision='bf16' cannot run on cuda:0: .*capability 8\.0"):
            _precision.check_device("bf16", torch.device("cuda", 0))
        _precision.check_device("fp16", torch.device("cuda", 0))  # fp16 runs on every CUDA device
    finally:
        _precision.unsupported.cache_clear()


@bf16_anywhere
def test_a_users_module_is_copied_not_cast(images: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    ext = fh.FeatureExtractor(model, ["2"], precision="bf16")
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
    copied = ext.backbone.state_dict()
    assert copied["1.running_var"].dtype == torch.bfloat16 and copied["1.num_batches_tracked"].dtype == torch.int64
    torch.testing.assert_close(ext(images)["2"].float(), model(images), rtol=0.02, atol=0.02)


@needs_cpu_bf16
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_tap_before_an_in_place_activation_builds_in_any_precision(images: torch.Tensor, precision: str) -> None:
    """conv1_1 feeds an in-place ReLU, which the extractor runs out of place (found on its float32 trace, before
    the backbone is stored in the precision); Real-ESRGAN's layers are all such."""
    layers = ["conv1_1", "relu2_2"]
    torch.manual_seed(0)
    ext = fh.FeatureExtractor("vgg16", layers, weights=None, precision=precision)  # type: ignore[arg-type]
    torch.manual_seed(0)
    reference = fh.FeatureExtractor("vgg16", layers, weights=None)
    assert all(p.dtype == ext.compute_dtype for p in ext.backbone.parameters())
    if precision == "fp16":  # refused at the forward on CPUs without float16 kernels
        return
    found = ext(images)
    for name, expected in reference(images).items():
        assert found[name].dtype == torch.bfloat16
        assert (found[name].float() - expected).abs().max() / expected.abs().max() < 0.05, name


@bf16_anywhere
@pytest.mark.parametrize("cast", list(CASTS))
def test_bf16_casts_change_neither_the_stored_weights_nor_the_normalization(images: torch.Tensor, cast: str) -> None:
    """A cast of a bf16 extractor (or of a model holding one) leaves what runs bitwise as it was: weights are not
    rounded through float16 (whose range ends at 65504) and the normalization stays float32."""
    ext = tiny_extractor(precision="bf16")
    with torch.no_grad():
        ext.backbone[0].weight[0, 0, 0, 0] = 1e5  # past float16's range
    weights = {k: v.clone() for k, v in ext.backbone.state_dict().items()}
    mean, std, before = ext.mean.clone(), ext.std.clone(), ext(images)
    CASTS[cast](ext)
    assert ext.mean.dtype == ext.std.dtype == torch.float32
    assert torch.equal(ext.mean, mean) and torch.equal(ext.std, std)
    after = ext.backbone.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in weights.items())
    for name, value in ext(images).items():
        assert torch.equal(value, before[name]), name


@bf16_anywhere
def test_a_bf16_extractor_can_be_made_on_the_meta_device_and_materialized() -> None:
    ext = tiny_extractor(precision="bf16").to("meta").to_empty(device="cpu")
    assert ext.mean.device.type == "cpu" and ext.mean.dtype == ext.std.dtype == torch.float32
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in ext.backbone.parameters())


@bf16_anywhere
def test_a_bf16_users_module_is_normalized_in_float32(images: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).to(torch.bfloat16)
    ext = fh.FeatureExtractor(model, ["1"], precision="bf16", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert ext.mean.dtype == ext.std.dtype == torch.float32
    with torch.no_grad():
        expected = model(((images - 0.5) / 0.25).to(torch.bfloat16))
    assert torch.equal(ext(images)["1"], expected)


def test_precision_is_fixed_at_construction() -> None:
    ext = tiny_extractor()
    with pytest.raises(AttributeError):
        ext.precision = "bf16"  # type: ignore[misc]
    assert ext.precision == "float32"
