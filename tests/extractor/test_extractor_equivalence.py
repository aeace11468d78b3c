"""FeatureExtractor equals torchvision's create_feature_extractor and timm's forward_intermediates."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import featurehooks as fh


def fx_reference(name: str, nodes: dict[str, str]) -> nn.Module:
    """torchvision's FX extractor over the same cached weights, with in-place ReLUs made out-of-place.

    With ``ReLU(inplace=True)`` the FX extractor's conv outputs are overwritten by the ReLU that
    follows; the out-of-place copy gives the true pre-activation values.
    """
    model = tvm.get_model(name, weights="DEFAULT").eval()
    for module in model.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return create_feature_extractor(model, nodes)


@pytest.mark.slow
def test_vgg16_every_alias_matches_fx(vgg16_cached: Path, images: torch.Tensor) -> None:
    aliases = [row.alias for row in fh.list_layers("vgg16") if row.alias]
    assert len(aliases) == 13 * 2 + 5
    extractor = fh.FeatureExtractor("vgg16", aliases, memory_format="contiguous")  # bit-exact: NCHW as FX
    paths = {row.path: row.alias for row in fh.list_layers("vgg16") if row.alias}
    reference = fx_reference("vgg16", paths)
    ours = extractor(images)
    theirs = reference(extractor.normalize(images))
    assert list(ours) == aliases
    for alias in aliases:
        torch.testing.assert_close(ours[alias], theirs[alias], rtol=0, atol=0, msg=alias)
    assert (ours["conv3_3"] < 0).any(), "conv taps must be pre-activation"


def test_resnet18_stages_and_inner_modules_match_fx(resnet18_cached: Path, images: torch.Tensor) -> None:
    nodes = ["conv1", "maxpool", "layer1", "layer2.0.conv1", "layer2.0.downsample", "layer3.1.bn1", "layer3", "layer4"]
    extractor = fh.FeatureExtractor("resnet18", nodes, memory_format="contiguous")  # bit-exact: NCHW as FX
    reference = fx_reference("resnet18", {n: n for n in nodes})
    ours, theirs = extractor(images), reference(extractor.normalize(images))
    assert list(ours) == nodes
    for node in nodes:
        torch.testing.assert_close(ours[node], theirs[node], rtol=0, atol=0, msg=node)
    assert (ours["layer3.1.bn1"] < 0).any(), "a bn tap before an in-place ReLU must keep negative values"


def test_dict_layers_rename_outputs(vgg16_cached: Path, images: torch.Tensor) -> None:
    renamed = fh.FeatureExtractor("vgg16", {"features.15": "mid", "relu1_2": "low"})(images)
    plain = fh.FeatureExtractor("vgg16", ["relu3_3", "relu1_2"])(images)
    assert list(renamed) == ["mid", "low"]
    assert torch.equal(renamed["mid"], plain["relu3_3"])
    assert torch.equal(renamed["low"], plain["relu1_2"])


def test_timm_matches_forward_intermediates(tmp_path: Path, images: torch.Tensor) -> None:
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    torch.manual_seed(1)
    reference = timm.create_model("resnet18", pretrained=False).eval()
    weights_file = tmp_path / "resnet18.safetensors"
    save_file(reference.state_dict(), str(weights_file))

    stages = ["layer1", "layer2", "layer3", "layer4"]
    extractor = fh.FeatureExtractor("timm/resnet18", stages, weights=weights_file)
    assert extractor.weights == str(weights_file)
    x = extractor.normalize(images)
    with torch.no_grad():
        expected = reference.forward_intermediates(x, indices=[1, 2, 3, 4], stop_early=True, intermediates_only=True)
    ours = extractor(images)
    for stage, tensor in zip(stages, expected):
        torch.testing.assert_close(ours[stage], tensor, rtol=0, atol=0, msg=stage)


def test_timm_normalization_comes_from_pretrained_cfg(tmp_path: Path) -> None:
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", pretrained=False)
    extractor = fh.FeatureExtractor("timm/resnet18", ["layer1"], weights=None)
    assert extractor.preprocessing.mean == pytest.approx(model.pretrained_cfg["mean"])
    assert extractor.preprocessing.std == pytest.approx(model.pretrained_cfg["std"])


def test_user_module_is_copied_not_mutated(images: torch.Tensor) -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3)).train()
    before = copy.deepcopy(net.state_dict())
    extractor = fh.FeatureExtractor(net, ["0", "2"])
    out = extractor(images)
    assert net.training and all(p.requires_grad for p in net.parameters())
    assert not net[0]._forward_hooks
    assert (out["0"] < 0).any(), "the conv tap is taken before the in-place ReLU"
    with torch.no_grad():
        expected = net.eval()(images)
    torch.testing.assert_close(out["2"], expected)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key])
