"""Layer aliases, list_layers metadata, and did-you-mean errors."""

from __future__ import annotations

import pytest
import torch
import torchvision.models as tvm
from torch import nn

import featurehooks as fh

VGG_CONVS = {"vgg11": [1, 1, 2, 2, 2], "vgg13": [2, 2, 2, 2, 2], "vgg16": [2, 2, 3, 3, 3], "vgg19": [2, 2, 4, 4, 4]}


@pytest.mark.parametrize("name", sorted(VGG_CONVS))
@pytest.mark.parametrize("bn", [False, True])
def test_vgg_aliases_for_every_depth(name: str, bn: bool) -> None:
    arch = name + ("_bn" if bn else "")
    rows = {row.alias: row for row in fh.list_layers(arch) if row.alias}
    with torch.device("meta"):  # module types only: no 100M-parameter init
        model = tvm.get_model(arch)
    for block, convs in enumerate(VGG_CONVS[name], start=1):
        for index in range(1, convs + 1):
            conv = rows[f"conv{block}_{index}"]
            assert isinstance(model.get_submodule(conv.path), nn.Conv2d)
            assert isinstance(model.get_submodule(rows[f"relu{block}_{index}"].path), nn.ReLU)
            assert (f"bn{block}_{index}" in rows) == bn
            assert conv.stride == 2 ** (block - 1)
        assert rows[f"pool{block}"].type == "MaxPool2d"
    assert len(rows) == sum(VGG_CONVS[name]) * (3 if bn else 2) + 5


def test_list_layers_rows_carry_channels_and_stride() -> None:
    rows = {row.name: row for row in fh.list_layers("vgg16")}
    assert rows["relu3_3"] == fh.FeatureInfo("relu3_3", "relu3_3", "features.15", "ReLU", 256, 4, 1, 0, "NCHW", None)
    resnet = {row.path: row for row in fh.list_layers("resnet50")}
    assert (resnet["layer1"].channels, resnet["layer1"].stride) == (256, 4)
    assert (resnet["layer4"].channels, resnet["layer4"].stride) == (2048, 32)
    assert resnet["layer1.0.relu"].calls == 3
    assert resnet["layer1.0.relu"].alias is None


def test_list_layers_downloads_nothing(torch_home) -> None:
    fh.list_layers("resnet152")
    assert not (torch_home / "hub" / "checkpoints" / "resnet152-f82ba261.pth").exists()


def test_list_layers_timm_and_module() -> None:
    pytest.importorskip("timm")
    stages = {row.path: row for row in fh.list_layers("timm/resnet18")}
    assert (stages["layer3"].channels, stages["layer3"].stride) == (256, 16)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.ReLU())
    rows = fh.list_layers(net, input_size=32)
    assert [(r.path, r.channels, r.stride) for r in rows] == [("0", 8, 2), ("1", 8, 2)]


def test_list_layers_include_filter() -> None:
    rows = fh.list_layers("vgg16", include=["relu1_2", "features.30"])
    assert [r.path for r in rows] == ["features.3", "features.30"]


def test_unknown_layer_names_the_three_closest(vgg16_cached) -> None:
    with pytest.raises(fh.LayerNotFoundError) as info:
        fh.FeatureExtractor("vgg16", ["relu3_4"])
    message = str(info.value)
    assert "'relu3_4'" in message and "'relu3_3'" in message and "list_layers('vgg16')" in message
    assert message.count("'relu") + message.count("'conv") <= 4
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)


def test_errors_on_a_model_instance_point_at_list_layers_of_the_model() -> None:
    """A module is labelled by its class name, which list_layers cannot build: the hint names the model itself."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with pytest.raises(fh.LayerNotFoundError, match=r"See featurehooks\.list_layers\(model\)$"):
        fh.FeatureExtractor(model, ["2"])
    assert [row.path for row in fh.list_layers(model)] == ["0", "1"]


def test_native_paths_and_aliases_resolve_to_the_same_module(vgg16_cached, images) -> None:
    out = fh.FeatureExtractor("vgg16", ["relu2_2", "features.8"])(images)
    assert out["relu2_2"] is out["features.8"]


def test_layer_specs_are_validated(vgg16_cached) -> None:
    with pytest.raises(ValueError, match="no layers"):
        fh.FeatureExtractor("vgg16", [])
    with pytest.raises(ValueError, match="twice"):
        fh.FeatureExtractor("vgg16", ["relu1_1", "relu1_1"])
    with pytest.raises(ValueError, match="mode"):
        fh.FeatureExtractor("vgg16", ["relu1_1"], mode="train")  # type: ignore[arg-type]


def test_extractor_feature_info_follows_request_order(vgg16_cached) -> None:
    extractor = fh.FeatureExtractor("vgg16", {"features.15": "mid", "relu1_2": "low"})
    rows = [(r.path, r.channels, r.stride) for r in extractor.feature_info]
    assert rows == [("features.15", 256, 4), ("features.3", 64, 1)]


def test_alexnet_and_squeezenet_aliases_name_the_taps_lpips_uses() -> None:
    alex = {row.alias: (row.path, row.channels) for row in fh.list_layers("alexnet", weights=None) if row.alias}
    assert [alex[f"relu{k}"] for k in range(1, 6)] == [
        ("features.1", 64),
        ("features.4", 192),
        ("features.7", 384),
        ("features.9", 256),
        ("features.11", 256),
    ]
    assert alex["conv1"][0] == "features.0" and alex["pool5"][0] == "features.12"
    rows = fh.list_layers("squeezenet1_1", weights=None)
    squeeze = {row.alias: (row.path, row.channels) for row in rows if row.alias}
    assert squeeze["relu1"] == ("features.1", 64)
    assert [squeeze[f"fire{k}"] for k in (3, 5, 6, 7, 8, 9)] == [
        ("features.4", 128),
        ("features.7", 256),
        ("features.9", 384),
        ("features.10", 384),
        ("features.11", 512),
        ("features.12", 512),
    ]
    paper = {row.alias for row in fh.list_layers("squeezenet1_0", weights=None) if row.alias}
    assert {f"fire{k}" for k in range(2, 10)} <= paper and {"pool1", "pool2", "pool3"} <= paper
