"""The tap engine: per-call taps with FX's names, structured outputs, threads, nested captures, no meta leftovers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import featurehooks as fh


def test_each_call_of_a_shared_module_equals_the_fx_node(resnet18_cached: Path) -> None:
    nodes = ["layer1.0.relu", "layer1.0.relu_1", "layer2.1.relu_1", "relu"]
    assert set(nodes) <= set(get_graph_node_names(fh.FeatureExtractor("resnet18", "fc").backbone)[1])
    extractor = fh.FeatureExtractor("resnet18", nodes, mode="grad")
    reference = create_feature_extractor(extractor.backbone, nodes)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    ours_input = x.clone().requires_grad_(True)
    fx_input = x.clone().requires_grad_(True)
    ours, theirs = extractor(ours_input), reference(extractor.normalize(fx_input))
    weights = {name: torch.randn_like(value) for name, value in theirs.items()}
    for name in nodes:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    sum((ours[n] * weights[n]).sum() for n in nodes).backward()
    sum((theirs[n] * weights[n]).sum() for n in nodes).backward()
    torch.testing.assert_close(ours_input.grad, fx_input.grad, rtol=1e-5, atol=1e-6)
    rows = {row.name: row for row in extractor.feature_info}
    assert (rows["layer1.0.relu_1"].call, rows["layer1.0.relu_1"].calls) == (1, 2)


def test_list_layers_has_a_row_per_call() -> None:
    rows = [row for row in fh.list_layers("resnet50") if row.path == "layer1.0.relu"]
    assert [(row.name, row.call, row.calls) for row in rows] == [
        ("layer1.0.relu", 0, 3),
        ("layer1.0.relu_1", 1, 3),
        ("layer1.0.relu_2", 2, 3),
    ]


def test_four_threads_sharing_one_extractor_get_their_own_features(resnet18_cached: Path) -> None:
    extractor = fh.FeatureExtractor("resnet18", ["layer1.0.relu_1", "layer2", "layer3.0.bn2"])
    generator = torch.Generator().manual_seed(0)
    batches = [torch.rand(1, 3, 32, 32, generator=generator) for _ in range(200)]
    serial = [extractor(batch) for batch in batches]

    def work(start: int) -> list[dict[str, torch.Tensor]]:
        return [extractor(batches[i]) for i in range(start, len(batches), 4)]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(work, range(4)))
    for start, got in enumerate(results):
        for offset, features in enumerate(got):
            expected = serial[start + 4 * offset]
            assert all(torch.equal(features[k], expected[k]) for k in expected)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True))
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.stem(x))


def test_nested_and_overlapping_captures_each_hold_real_outputs() -> None:
    net, x = Net(), torch.rand(1, 3, 8, 8)
    conv, body = net.stem[0](x), net.body(net.stem(x))
    with fh.capture(net, ["stem.0", "body"], mode="detach") as outer:
        with fh.capture(net, ["body", "stem.0"], mode="detach") as inner, fh.capture(net.body, ["0"]) as sub:
            net(x)
        net(x * 2)
    for feats in (inner, outer):
        assert not any(value.is_meta for value in feats.values())
    torch.testing.assert_close(inner["stem.0"], conv)
    torch.testing.assert_close(inner["body"], body)
    torch.testing.assert_close(outer["stem.0"], net.stem[0](x * 2))
    torch.testing.assert_close(sub["0"], net.body[0](net.stem(x)))
    assert (inner["stem.0"] < 0).any(), "the conv tap is taken before the in-place ReLU"


def test_captures_in_threads_read_their_own_forward() -> None:
    net = Net()
    inputs = [torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    results: list[bool] = []
    start = threading.Barrier(len(inputs))  # four distinct threads, all running at once
    with fh.capture(net, ["body"], mode="detach") as feats:

        def work(x: torch.Tensor) -> None:
            start.wait()
            ok = True
            for _ in range(20):
                out = net(x)
                ok &= torch.equal(feats["body"], out.detach())
            results.append(ok)

        threads = [threading.Thread(target=work, args=(x,)) for x in inputs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [True] * len(inputs)
        with pytest.raises(RuntimeError, match="other threads"):
            _ = feats["body"]


class TupleStage(nn.Module):
    """A stage that returns a tuple whose tensors the next stage changes in place (like timm's HRNet)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.a(x), self.b(x)


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stage1 = TupleStage()
        self.stage2 = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.stage1(x)
        first += second  # in place, like HRNet's fuse layers
        return self.stage2(first.relu_())


@pytest.mark.parametrize("mode", ["grad", "detach"])
def test_tuple_outputs_changed_in_place_later_are_cloned(mode: str) -> None:
    net = TupleNet()
    x = torch.rand(1, 3, 8, 8)
    both = fh.FeatureExtractor(net, ["stage1", "stage2"], mode=mode)(x)
    alone = fh.FeatureExtractor(net, ["stage1"], mode=mode)(x)
    expected = net.stage1(x)
    for got in (both["stage1"], alone["stage1"]):
        assert isinstance(got, tuple)
        for value, reference in zip(got, expected):
            torch.testing.assert_close(value, reference.detach())


@pytest.mark.slow
def test_hrnet_stage_tuple_with_a_deeper_tap() -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("hrnet_w18_small_v2", pretrained=False)
    x = torch.rand(1, 3, 64, 64)
    both = fh.FeatureExtractor(model, ["stage3.0", "stage4"], mode="grad")(x)
    alone = fh.FeatureExtractor(model, ["stage3.0"], mode="grad")(x)
    assert isinstance(both["stage3.0"], (list, tuple))
    for value, reference in zip(both["stage3.0"], alone["stage3.0"]):
        torch.testing.assert_close(value, reference, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tresnet_m", "csatv2"])
def test_input_channels_come_from_the_model_not_its_first_conv(name: str) -> None:
    timm = pytest.importorskip("timm")
    if not timm.is_model(name):
        pytest.skip(f"timm {timm.__version__} has no {name}")
    rows = fh.list_layers(f"timm/{name}", input_size=64)
    assert rows and rows[-1].layout is not None
    extractor = fh.FeatureExtractor(f"timm/{name}", [rows[len(rows) // 2].name], weights=None)
    assert extractor.in_channels == 3
    extractor(torch.rand(1, 3, 64, 64))


def _meta_tensors(model: nn.Module) -> list[str]:
    found = []
    for path, module in model.named_modules():
        for key, value in vars(module).items():
            keys = list(value) if isinstance(value, dict) else []
            values = list(value.values()) if isinstance(value, dict) else value
            values = values if isinstance(values, (list, tuple)) else [values]
            if any(isinstance(v, torch.Tensor) and v.is_meta for v in values) or "meta" in map(str, keys):
                found.append(f"{path}.{key}")
    return found


def test_meta_trace_leaves_nothing_in_the_callers_model() -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("levit_128s", pretrained=False).eval()
    x = torch.rand(1, 3, 224, 224)
    model(x)  # fills attention_bias_cache with a real entry
    caches = {
        path: dict(module.attention_bias_cache)
        for path, module in model.named_modules()
        if hasattr(module, "attention_bias_cache")
    }
    assert caches
    fh.list_layers(model)
    with fh.capture(model, ["stages.0"]) as feats:
        model(x)
    assert not feats["stages.0"].is_meta
    assert _meta_tensors(model) == []
    for path, cache in caches.items():
        assert list(model.get_submodule(path).attention_bias_cache) == list(cache)


def test_layouts_channels_and_strides() -> None:
    swin = {row.name: row for row in fh.list_layers("swin_t")}
    assert (swin["features.1"].layout, swin["features.1"].channels, swin["features.1"].stride) == ("NHWC", 96, 4)
    assert (swin["features.7"].layout, swin["features.7"].channels, swin["features.7"].stride) == ("NHWC", 768, 32)
    vit = {row.name: row for row in fh.list_layers("vit_b_16")}
    block = vit["encoder.layers.encoder_layer_3"]
    assert (block.layout, block.channels, block.stride, block.prefix_tokens) == ("NLC", 768, 16, 1)
    assert (vit["heads"].layout, vit["heads"].channels) == ("NC", 1000)
    resnet = {row.name: row for row in fh.list_layers("resnet18")}
    assert (resnet["layer3"].layout, resnet["layer3"].channels, resnet["layer3"].stride) == ("NCHW", 256, 16)


def test_list_layers_of_a_model_that_cannot_trace_is_one_clear_error() -> None:
    with pytest.raises(fh.TraceError, match=r"cannot list the layers of Sequential: .* 2x2 image"):
        fh.list_layers(nn.Sequential(nn.Conv2d(3, 4, 5)), input_size=2)


def test_a_float64_module_is_traced_in_its_own_dtype() -> None:
    net = Net().double()
    extractor = fh.FeatureExtractor(net, ["stem.0", "body"])
    assert [row.channels for row in extractor.feature_info] == [4, 2]
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(extractor(x)["stem.0"], net.stem[0](x).detach())
