"""memory_format: what "auto" picks and why, values and gradients of each format against float64, dumps.

tests/extractor/test_zoo.py holds channels-last to NCHW on every torchvision classification model; this file
holds both formats to a float64 reference on a spread of families, and covers the choice itself,
device moves, strides, losses, metrics, dumps and the command line.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import Tensor, nn

import featurehooks as fh
from featurehooks import _formats
from featurehooks._stream import forward as stream_forward
from featurehooks._stream import tiling
from featurehooks._stream.cpus import forward_threads
from featurehooks.cli import main
from featurehooks.dump import dump_features
from featurehooks.errors import InvalidValueError
from featurehooks.losses import PerceptualLoss, StyleLoss

from helpers import TINY_CLI_MODEL, FlattensWithView, photos, tiny_extractor

SEED = 0


def seeded_extractor(backbone: str, layers: list[str], **kwargs: object) -> fh.FeatureExtractor:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return fh.FeatureExtractor(backbone, layers, weights=None, **kwargs)


LARGE = (1, 3, 2048, 2048)  # images for which channels-last pays on every convolutional backbone here


def conv_weights(extractor: fh.FeatureExtractor) -> list[Tensor]:
    return [m.weight for m in extractor.backbone.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize(
    ("backbone", "layers", "expected"),
    [
        pytest.param("vgg16", ["relu3_3"], "channels_last", marks=pytest.mark.slow),
        ("resnet18", ["layer2", "layer4"], "channels_last"),
        ("efficientnet_b0", ["features.5"], "channels_last"),
        ("mobilenet_v3_small", ["features.8"], "channels_last"),
        pytest.param("densenet121", ["features.denseblock2"], "channels_last", marks=pytest.mark.slow),
        ("timm/resnet18", ["layer3"], "channels_last"),
        # its work is in Linear layers on permuted maps
        pytest.param("convnext_tiny", ["features.5"], "contiguous", marks=pytest.mark.slow),
        pytest.param("vit_b_16", ["encoder.layers.encoder_layer_2"], "contiguous", marks=pytest.mark.slow),
        pytest.param("swin_t", ["features.3"], "contiguous", marks=pytest.mark.slow),
        # 46% of its FLOPs are convolutions
        pytest.param("maxvit_t", ["blocks.1"], "contiguous", marks=pytest.mark.slow),
        ("timm/vit_tiny_patch16_224", ["blocks.3"], "contiguous"),
    ],
)
def test_auto_runs_channels_last_where_convolutions_do_the_work(
    backbone: str, layers: list[str], expected: str
) -> None:
    extractor = seeded_extractor(backbone, layers)
    assert extractor.memory_format == "auto" and extractor.memory_format_for(LARGE) == expected
    assert extractor.memory_format_in_use == "contiguous"  # no forward yet
    convs = conv_weights(extractor)
    assert convs and all(w.is_contiguous() for w in convs)  # auto converts images, never the weights
    assert seeded_extractor(backbone, layers, mode="grad").memory_format_for(LARGE) == "contiguous"


class ConvThenMatmul(nn.Module):
    """A convolution, then a matmul head of 3x the convolution's FLOPs at 224 px."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(16)
        self.head = nn.Linear(8 * 16 * 16, 16384)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.conv(x)).flatten(1))


def test_the_share_counts_only_the_work_up_to_the_deepest_requested_layer() -> None:
    early = fh.FeatureExtractor(ConvThenMatmul(), ["conv"], weights=None)
    late = fh.FeatureExtractor(ConvThenMatmul(), ["head"], weights=None)
    assert early.conv_work.share == pytest.approx(1.0) and early.memory_format_for(LARGE) == "channels_last"
    assert late.conv_work.share < 0.5 and late.memory_format_for(LARGE) == "contiguous"


@pytest.mark.parametrize(
    ("backbone", "layers", "side"),
    [
        pytest.param("vgg16", ["relu1_2", "relu3_3"], 64, marks=pytest.mark.slow),
        ("resnet18", ["layer1", "layer3"], 64),
        pytest.param("mobilenet_v3_large", ["features.4", "features.12"], 96, marks=pytest.mark.slow),
        pytest.param("efficientnet_b0", ["features.3", "features.6"], 96, marks=pytest.mark.slow),
        ("squeezenet1_1", ["fire4", "fire7"], 64),
        pytest.param("regnet_y_400mf", ["trunk_output.block2", "trunk_output.block3"], 96, marks=pytest.mark.slow),
    ],
)
def test_each_format_equals_float64_values_and_gradients(backbone: str, layers: list[str], side: int) -> None:
    """Values to 1e-5 of each feature's scale; input gradients by norm-relative error (element-wise maxima
    mislead: a ReLU tie that float32 decides the other way moves a whole gradient path), the same bound
    for both formats: channels-last is not allowed to be the less exact one by a margin."""
    reference = seeded_extractor(backbone, layers, mode="grad", memory_format="contiguous").double()
    images = torch.rand(2, 3, side, side, generator=torch.Generator().manual_seed(SEED), dtype=torch.float64)
    weights = {name: None for name in layers}

    def run(extractor: fh.FeatureExtractor, dtype: torch.dtype) -> tuple[dict[str, Tensor], Tensor]:
        leaf = images.to(dtype).requires_grad_()
        features = extractor(leaf)
        generator = torch.Generator().manual_seed(SEED + 1)
        for name in layers:
            weights[name] = torch.randn(features[name].shape, generator=generator, dtype=torch.float64)
        loss = sum((features[name].double() * weights[name]).sum() for name in layers)
        (grad,) = torch.autograd.grad(loss, leaf)
        return {name: value.detach().double() for name, value in features.items()}, grad.double()

    expected, expected_grad = run(reference, torch.float64)
    errors = {}
    for memory_format in ("contiguous", "channels_last"):
        extractor = seeded_extractor(backbone, layers, mode="grad", memory_format=memory_format)
        found, grad = run(extractor, torch.float32)
        assert extractor.memory_format_in_use == memory_format
        for name in layers:
            scale = float(expected[name].abs().max())
            torch.testing.assert_close(found[name], expected[name], rtol=0, atol=1e-5 * scale, msg=name)
        errors[memory_format] = float((grad - expected_grad).norm() / expected_grad.norm())
    assert max(errors.values()) < 1e-2, errors
    assert errors["channels_last"] <= 2 * errors["contiguous"] + 1e-5, errors


@pytest.mark.slow
def test_features_keep_their_shape_and_say_their_strides() -> None:
    images = torch.rand(2, 3, 64, 64)
    last = seeded_extractor("vgg16", ["relu2_2"])(images)["relu2_2"]
    nchw = seeded_extractor("vgg16", ["relu2_2"], memory_format="contiguous")(images)["relu2_2"]
    assert last.shape == nchw.shape == (2, 128, 32, 32)
    assert last.is_contiguous(memory_format=torch.channels_last) and not last.is_contiguous()
    assert nchw.is_contiguous()


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x,
        lambda x: x.contiguous(memory_format=torch.channels_last),
        lambda x: x[..., ::2, ::2],  # strided view
        lambda x: x.permute(0, 1, 3, 2),  # a transposed view
        lambda x: x.double(),
    ],
)
def test_inputs_of_any_strides_and_dtype_give_the_same_features_and_gradients(make: object) -> None:
    extractor = seeded_extractor("resnet18", ["layer2"], mode="grad")
    nchw = seeded_extractor("resnet18", ["layer2"], mode="grad", memory_format="contiguous")
    base = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(SEED))
    leaf = base.clone().requires_grad_()
    image = make(leaf)  # type: ignore[operator]
    reference = image.detach().contiguous().float().requires_grad_()
    found, expected = extractor(image)["layer2"], nchw(reference)["layer2"]
    torch.testing.assert_close(found.float(), expected, rtol=0, atol=1e-5 * float(expected.detach().abs().max()))
    found.sum().backward()
    expected.sum().backward()
    assert leaf.grad is not None and reference.grad is not None


@pytest.mark.slow
def test_explicit_formats_are_obeyed_on_any_model() -> None:
    vit = seeded_extractor("vit_b_16", ["encoder.layers.encoder_layer_1"], memory_format="channels_last")
    assert vit.memory_format_in_use == "channels_last"
    assert vit.backbone.conv_proj.weight.is_contiguous(memory_format=torch.channels_last)
    nchw = seeded_extractor("vit_b_16", ["encoder.layers.encoder_layer_1"], memory_format="contiguous")
    images = torch.rand(2, 3, 224, 224)
    name = "encoder.layers.encoder_layer_1"
    expected = nchw(images)[name]
    torch.testing.assert_close(vit(images)[name], expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    resnet = seeded_extractor("resnet18", ["layer1"], memory_format="contiguous")
    assert resnet.memory_format_in_use == "contiguous" and all(w.is_contiguous() for w in conv_weights(resnet))
    assert "memory_format='contiguous'" in repr(resnet) and "memory_format" not in repr(
        seeded_extractor("resnet18", ["layer1"])
    )


def test_auto_keeps_a_model_that_fails_in_channels_last_in_nchw() -> None:
    model = FlattensWithView()
    images = torch.rand(2, 3, 64, 64)
    extractor = fh.FeatureExtractor(model, ["conv", "head"], weights=None)
    assert extractor.memory_format_for(images.shape) == "contiguous"  # its channels-last meta forward fails
    assert extractor.conv_work is None
    got = extractor(images)
    assert extractor.memory_format_in_use == "contiguous"
    conv_only = fh.FeatureExtractor(model, ["conv"], weights=None)  # the forward stops before the .view
    assert conv_only.memory_format_for(images.shape) == "channels_last"
    want = fh.FeatureExtractor(model, ["conv", "head"], weights=None, memory_format="contiguous")(images)
    assert all(torch.equal(got[name], want[name]) for name in want)
    forced = fh.FeatureExtractor(model, ["head"], weights=None, memory_format="channels_last")
    with pytest.raises(RuntimeError, match="view"):
        forced(images)


def test_untraceable_models_stay_nchw_under_auto() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.conv(x) if float(x.mean()) > -1 else x  # a value read: no meta trace

    extractor = fh.FeatureExtractor(DataDependent(), ["conv"], weights=None)
    assert extractor.conv_work is None and extractor.memory_format_in_use == "contiguous"  # no trace: no evidence
    with pytest.raises(RuntimeError, match="cannot run on the meta device"):
        extractor.feature_info  # noqa: B018 - the property raises for an untraced model


@pytest.mark.parametrize(
    ("work", "device", "shape", "expected"),
    [
        (_formats.ConvWork(0.9, 0.1), "cpu", LARGE, "channels_last"),
        (_formats.ConvWork(0.9, 0.1), "cuda", LARGE, "channels_last"),
        (_formats.ConvWork(0.9, 0.1), "mps", LARGE, "contiguous"),  # not measured: NCHW
        (_formats.ConvWork(0.3, 0.1), "cpu", LARGE, "contiguous"),  # not convolutional enough
        (None, "cpu", LARGE, "contiguous"),  # no evidence
        (_formats.ConvWork(0.9, 0.1), "cpu", (64, 3, 32, 32), "contiguous"),  # each weight used 102 times per image
        (_formats.ConvWork(0.9, 0.1), "cpu", (1, 3, 100, 100), "channels_last"),  # 1000 times
    ],
)
def test_auto_decides_by_share_device_and_the_work_per_weight_of_one_image(
    work: _formats.ConvWork | None, device: str, shape: tuple[int, ...], expected: str
) -> None:
    assert _formats.auto_format(work, device, shape) == expected


@pytest.mark.slow
def test_the_work_per_weight_is_counted_up_to_the_deepest_layer() -> None:
    """VGG16 up to relu3_3 at 64x64: multiply-adds of its seven convolutions over their weight elements."""
    extractor = seeded_extractor("vgg16", ["relu3_3"])
    channels = [
        (3, 64, 64),
        (64, 64, 64),
        (64, 128, 32),
        (128, 128, 32),
        (128, 256, 16),
        (256, 256, 16),
        (256, 256, 16),
    ]
    macs = sum(c_in * c_out * 9 * side * side for c_in, c_out, side in channels)
    weights = sum(c_in * c_out * 9 for c_in, c_out, _ in channels)
    assert extractor.conv_work is not None
    assert extractor.conv_work.reuse(64, 64) == pytest.approx(macs / weights)
    resnet = seeded_extractor("resnet50", ["layer4"])  # big weights on small maps: NCHW at 224, channels-last at 640
    assert resnet.memory_format_for((8, 3, 224, 224)) == "contiguous"
    assert resnet.memory_format_for((1, 3, 640, 640)) == "channels_last"


def test_forced_formats_are_kept_whatever_the_mode_or_shape() -> None:
    for fmt in ("contiguous", "channels_last"):
        for mode in ("detach", "grad"):
            extractor = seeded_extractor("resnet18", ["layer1"], mode=mode, memory_format=fmt)
            assert extractor.memory_format_for((1, 3, 16, 16)) == extractor.memory_format_for(LARGE) == fmt


@pytest.mark.slow
def test_a_device_type_not_measured_runs_nchw(monkeypatch: pytest.MonkeyPatch) -> None:
    extractor = seeded_extractor("vgg16", ["relu2_2"])
    images = torch.rand(2, 3, 64, 64)
    before = extractor(images)["relu2_2"]
    assert extractor.memory_format_in_use == "channels_last"
    monkeypatch.setattr(_formats, "CHANNELS_LAST_DEVICES", ("cuda",))  # as if the CPU were a device not measured
    after = extractor(images)["relu2_2"]
    assert extractor.memory_format_in_use == "contiguous" and after.is_contiguous()
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5 * float(before.abs().max()))


def test_copies_keep_the_format() -> None:
    extractor = seeded_extractor("resnet18", ["layer1"])
    buffer = io.BytesIO()
    torch.save(extractor, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(extractor), torch.load(buffer, weights_only=False)):
        assert copied.memory_format_for(LARGE) == "channels_last"
    forced = seeded_extractor("resnet18", ["layer1"], memory_format="channels_last")
    for copied in (copy.deepcopy(forced),):
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights(copied))


def test_a_bad_memory_format_is_refused() -> None:
    with pytest.raises(InvalidValueError, match="memory_format must be"):
        fh.FeatureExtractor("resnet18", ["layer1"], weights=None, memory_format="nhwc")  # type: ignore[arg-type]


@pytest.mark.slow
def test_losses_and_lpips_take_the_format_and_agree_across_formats() -> None:
    images, target = torch.rand(2, 3, 64, 64), torch.rand(2, 3, 64, 64)
    for make in (
        # ResNet-18: the same forwarding as VGG16's at a tenth of the random init (the suite builds each 3 times)
        lambda fmt: PerceptualLoss("resnet18", ["layer1", "layer2"], weights=None, memory_format=fmt),
        lambda fmt: StyleLoss("resnet18", ["relu", "layer1"], weights=None, memory_format=fmt),
        lambda fmt: fh.LPIPS("alex", weights=None, calibrated=False, memory_format=fmt),
    ):
        values = {}
        for fmt in ("contiguous", "channels_last", "auto"):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                loss = make(fmt)
            assert loss.extractor.memory_format == fmt
            values[fmt] = loss(images, target)
        torch.testing.assert_close(values["channels_last"], values["contiguous"], rtol=1e-5, atol=0)
        torch.testing.assert_close(values["auto"], values["contiguous"], rtol=0, atol=0)  # a graph: NCHW


@pytest.mark.slow
def test_a_shared_extractor_brings_its_own_format() -> None:
    shared = seeded_extractor("vgg16", ["relu3_3"], mode="grad", memory_format="contiguous")
    assert PerceptualLoss(shared).extractor.memory_format == "contiguous"
    with pytest.raises(InvalidValueError, match="come from the shared FeatureExtractor"):
        PerceptualLoss(shared, memory_format="channels_last")


@pytest.mark.slow
def test_activation_bytes_is_the_largest_output_per_image_up_to_the_deepest_layer() -> None:
    resnet = seeded_extractor("resnet18", ["layer4"])
    assert resnet.activation_bytes(224, 224) == 64 * 112 * 112 * 4  # conv1's output (bn1, relu the same size)
    assert resnet.activation_bytes(448, 448) == 4 * resnet.activation_bytes(224, 224)
    early = seeded_extractor("vgg16", ["relu1_1"])
    assert early.activation_bytes(32, 32) == 64 * 32 * 32 * 4
    assert seeded_extractor("vgg16", ["relu1_1"]).double().activation_bytes(32, 32) == 64 * 32 * 32 * 8


@pytest.mark.parametrize(
    ("text", "expected"), [("32768K", 32 * 2**20), ("1024K", 2**20), ("2M", 2 * 2**20), ("512", 512), ("lots", None)]
)
def test_cache_sizes_are_read_as_sysfs_writes_them(text: str, expected: int | None) -> None:
    assert tiling.size_in_bytes(text) == expected


def test_micro_batches_fit_the_budget_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    resnet = seeded_extractor("resnet18", ["layer4"])
    mib = 2**20
    with forward_threads(2):
        assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224), 16 * mib) == 5  # 16 MiB / 3.06 MiB each
        assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224), tiling.WORKERS_BUDGET) == 20
        assert tiling.micro_batch_size(resnet, torch.empty(3, 3, 224, 224), 16 * mib) == 3
        assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224, device="meta"), 16 * mib) == 32
        assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224), 1) == 2  # ATen's kernels change below 2
    with forward_threads(1):  # and at one thread below 16, for a batch of 16 or more
        assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224), 16 * mib) == 16
        assert tiling.micro_batch_size(resnet, torch.empty(15, 3, 224, 224), 16 * mib) == 5
    monkeypatch.setattr(resnet, "activation_bytes", lambda height, width: None)  # untraced: no sizes to go by
    assert tiling.micro_batch_size(resnet, torch.empty(32, 3, 224, 224), 16 * mib) == 32


@pytest.mark.parametrize("pool", [None, "avg"])
def test_micro_batched_dump_rows_equal_one_forward(monkeypatch: pytest.MonkeyPatch, pool: str | None) -> None:
    extractor = seeded_extractor("resnet18", ["layer2", "layer3"])
    images = torch.rand(7, 3, 64, 64)
    whole = stream_forward.features_as_arrays(extractor, images, pool, "float32")
    monkeypatch.setattr(stream_forward, "micro_batch_size", lambda *_: 3)  # 3 + 4: no piece of one image
    tiled = stream_forward.features_as_arrays(extractor, images, pool, "float32", budget=1)
    direct = extractor(images)
    for name, array in tiled.items():
        assert array.flags.c_contiguous and array.shape == whole[name].shape
        np.testing.assert_array_equal(array, whole[name])
        if pool is None:
            np.testing.assert_array_equal(whole[name], direct[name].numpy())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("backbone", "layers"), [("resnet18", ["layer4"]), ("mobilenet_v3_small", ["features.6"])])
@pytest.mark.parametrize("batch", [5, 20])
def test_the_smallest_micro_batches_round_as_the_whole_batch(
    backbone: str, layers: list[str], threads: int, batch: int
) -> None:
    """ATen runs 1x1 convolutions natively for a batch of one, and at one thread below 16: micro-batches of one
    image (or, at one thread, under 16 of a batch of 16 or more) rounded differently from one forward."""
    extractor = seeded_extractor(backbone, layers)
    images = torch.rand(batch, 3, 48, 48)
    with forward_threads(threads):
        whole = stream_forward.features_as_arrays(extractor, images, None, "float32")
        smallest = stream_forward.features_as_arrays(extractor, images, None, "float32", budget=1)
    for name, array in whole.items():
        np.testing.assert_array_equal(smallest[name], array)


def test_dumps_of_both_formats_agree_and_are_c_ordered(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=90)
    arrays = {}
    for fmt in ("contiguous", "auto"):
        extractor = seeded_extractor("resnet18", ["layer2"], memory_format=fmt)
        result = dump_features(
            extractor, folder, tmp_path / fmt, batch_size=4, progress=False, num_workers=0, resize_size=36, crop_size=32
        )
        arrays[fmt] = result.load("layer2", mmap=False)
        assert arrays[fmt].flags.c_contiguous and arrays[fmt].shape == (5, 128, 4, 4)
    scale = float(np.abs(arrays["contiguous"]).max())
    np.testing.assert_allclose(arrays["auto"], arrays["contiguous"], rtol=0, atol=1e-5 * scale)


def test_the_command_line_takes_a_memory_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(folder / "a.png")
    common = ["extract", str(folder), *TINY_CLI_MODEL, "--device", "cpu", "-q"]
    assert main([*common, "--out", str(tmp_path / "out"), "--memory-format", "contiguous"]) == 0
    assert np.load(tmp_path / "out" / "layer1.npy").shape == (1, 64, 8, 8)
    with pytest.raises(SystemExit):
        main([*common, "--out", str(tmp_path / "bad"), "--memory-format", "nhwc"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [0, 1])
def test_dumps_tile_to_the_cache_only_when_no_worker_shares_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    calls = []
    monkeypatch.setattr(stream_forward, "micro_batch_size", lambda _, images, budget: calls.append(budget) or 1)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((40, 40, 3), 40 * i, dtype=np.uint8)).save(folder / f"{i}.png")
    extractor = seeded_extractor("resnet18", ["layer1"])
    result = dump_features(
        extractor,
        folder,
        tmp_path / "out",
        batch_size=3,
        num_workers=workers,
        progress=False,
        resize_size=36,
        crop_size=32,
        pool="avg",
    )
    expected = tiling.cache_budget() if workers == 0 else tiling.WORKERS_BUDGET  # workers: memory-bounded
    assert set(calls) == {expected} and result.load("layer1").shape == (3, 64)


@pytest.mark.slow
def test_a_memory_format_given_to_to_cannot_override_the_choice() -> None:
    vit = seeded_extractor("vit_b_16", ["encoder.layers.encoder_layer_0"])
    vit.to(memory_format=torch.channels_last)
    assert vit.memory_format_for(LARGE) == "contiguous"
    resnet = seeded_extractor("resnet18", ["layer1"], memory_format="channels_last")
    resnet.to(memory_format=torch.contiguous_format)
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights(resnet))


class ViewAfterTheTap(nn.Module):
    """Channels-last-safe up to ``act``; a ``.view`` after it needs NCHW strides."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ReLU()
        self.head = nn.Linear(8 * 4 * 4, 2)

    def forward(self, x: Tensor) -> Tensor:
        pooled = nn.functional.adaptive_avg_pool2d(self.act(self.conv(x)), 4)
        return self.head(pooled.view(x.shape[0], -1))


def test_without_early_exit_the_whole_forward_must_run_in_channels_last() -> None:
    early = fh.FeatureExtractor(ViewAfterTheTap(), ["act"], weights=None)
    assert early.memory_format_for(LARGE) == "channels_last"  # the .view never runs
    assert early(torch.rand(2, 3, 128, 128))["act"].shape == (2, 8, 128, 128)
    assert early.memory_format_in_use == "channels_last"
    whole = fh.FeatureExtractor(ViewAfterTheTap(), ["act"], weights=None, early_exit=False)
    assert whole(torch.rand(2, 3, 128, 128))["act"].shape == (2, 8, 128, 128)  # the .view runs: NCHW again
    assert whole.memory_format_in_use == "contiguous" and whole.memory_format_for(LARGE) == "contiguous"


def test_a_model_catching_every_exception_cannot_stretch_the_share_past_the_tap() -> None:
    class Guarded(ConvThenMatmul):
        def forward(self, x: Tensor) -> Tensor:
            try:
                features = self.conv(x)
            except Exception:  # noqa: BLE001 - the point of the test
                features = torch.zeros_like(x)
            return self.head(self.pool(features).flatten(1))

    extractor = fh.FeatureExtractor(Guarded(), ["conv"], weights=None)
    assert extractor.conv_work is not None and extractor.conv_work.share == pytest.approx(1.0)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_input_gradients_come_back_in_the_inputs_own_memory_format(layout: torch.memory_format) -> None:
    extractor = seeded_extractor("resnet18", ["layer2"], mode="grad")
    images = torch.rand(2, 3, 32, 32).contiguous(memory_format=layout).requires_grad_()
    (grad,) = torch.autograd.grad(extractor(images)["layer2"].sum(), images)
    assert grad.is_contiguous(memory_format=layout)
    if layout == torch.contiguous_format:
        assert grad.view(2, -1).shape == (2, 3 * 32 * 32)  # what a gradient penalty does
    output = torch.rand(2, 3, 32, 32, requires_grad=True)
    loss = PerceptualLoss("resnet18", ["layer1"], weights=None)(output, torch.rand(2, 3, 32, 32))
    assert torch.autograd.grad(loss, output)[0].is_contiguous()


@pytest.mark.slow
def test_without_early_exit_activation_bytes_cover_the_whole_forward() -> None:
    assert seeded_extractor("resnet18", ["conv1"]).activation_bytes(32, 32) == 64 * 16 * 16 * 4
    assert seeded_extractor("vgg16", ["pool5"]).activation_bytes(32, 32) == 64 * 32 * 32 * 4
    pooled = seeded_extractor("vgg16", ["pool1"])  # its largest map, 64x32x32, runs before the tap either way
    assert pooled.activation_bytes(32, 32) == 64 * 32 * 32 * 4
    early = seeded_extractor("resnet18", ["maxpool"])
    whole = seeded_extractor("resnet18", ["maxpool"], early_exit=False)
    # what each forward runs: conv1 alone (each weight used once per position of its 16x16 output), or all of it
    # (the big weights of the later stages, used a few times each, weigh the average down)
    assert early.conv_work.reuse(32, 32) == pytest.approx(16 * 16) and whole.conv_work.reuse(32, 32) < 16
    assert early.activation_bytes(32, 32) == whole.activation_bytes(32, 32) == 64 * 16 * 16 * 4


def test_without_early_exit_the_layers_after_the_tap_count_too() -> None:
    widening = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 64, 3, padding=1))
    early = fh.FeatureExtractor(widening, ["0"], weights=None)
    whole = fh.FeatureExtractor(widening, ["0"], weights=None, early_exit=False)
    assert early.activation_bytes(32, 32) == 4 * 32 * 32 * 4
    assert whole.activation_bytes(32, 32) == 64 * 32 * 32 * 4


def test_torch_func_grad_takes_a_channels_last_forward() -> None:
    """The format change's autograd Function sets its context apart from its forward, as ``torch.func`` needs."""
    ext = tiny_extractor(mode="grad", memory_format="channels_last")
    images = photos(32, 2)

    def loss(x: Tensor) -> Tensor:
        return ext(x)["conv2"].square().sum()

    leaf = images.clone().requires_grad_(True)
    loss(leaf).backward()
    assert torch.equal(torch.func.grad(loss)(images), leaf.grad)
