"""Backbone registry and weights: enum names, local files, offline errors, never a silent random init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision.models as tvm
from safetensors.torch import save_file

import featurehooks as fh
from featurehooks.backbones import load_backbone, torchvision_models


def test_registry_lists_the_promised_families() -> None:
    names = fh.available_backbones()
    for name in [
        "vgg11",
        "vgg13",
        "vgg16",
        "vgg19",
        "vgg11_bn",
        "vgg19_bn",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
        "alexnet",
        "squeezenet1_0",
        "squeezenet1_1",
        "convnext_tiny",
    ]:
        assert name in names
    assert fh.available_backbones("vgg1?_bn") == ["vgg11_bn", "vgg13_bn", "vgg16_bn", "vgg19_bn"]


def test_unknown_backbone_names_the_closest() -> None:
    with pytest.raises(fh.BackboneNotFoundError, match="'vgg16'") as info:
        load_backbone("vgg61")
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)


def test_unknown_timm_model_names_the_closest() -> None:
    pytest.importorskip("timm")
    with pytest.raises(fh.BackboneNotFoundError, match="resnet18"):
        load_backbone("timm/resnet18x")


def test_default_weights_load_from_the_cache(resnet18_cached: Path) -> None:
    backbone = load_backbone("resnet18")
    assert backbone.weights == "ResNet18_Weights.IMAGENET1K_V1"
    assert backbone.in_channels == 3
    expected = torch.load(resnet18_cached, weights_only=True)
    assert torch.equal(backbone.model.conv1.weight, expected["conv1.weight"])
    assert not any(t.is_meta for t in backbone.model.state_dict().values())


@pytest.mark.parametrize("zip_format", [True, False])
def test_cached_weights_are_mapped_where_torch_can_and_read_where_not(
    resnet18_cached: Path, zip_format: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zip-format hub file is memory-mapped (tensors read when used), an older torch.save file is read; both
    give the file's values."""
    expected = torch.load(resnet18_cached, weights_only=True)
    if not zip_format:  # the same weights as torch.save wrote them before torch 1.6
        legacy = tmp_path / "hub" / "checkpoints" / resnet18_cached.name
        legacy.parent.mkdir(parents=True)
        torch.save(expected, legacy, _use_new_zipfile_serialization=False)
        monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    mapped: list[bool] = []
    load = torch.load

    def spy(*args: object, **kwargs: object) -> object:
        mapped.append(bool(kwargs.get("mmap")))
        return load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "load", spy)
    backbone = load_backbone("resnet18")
    assert mapped == [zip_format]
    for key, value in backbone.model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_loading_never_leaves_meta_tensors(resnet18_cached: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = torchvision_models.build

    def build_with_a_buffer_no_file_fills(name: str, member: tvm.WeightsEnum, *, meta: bool) -> torch.nn.Module:
        model = build(name, member, meta=meta)
        model.register_buffer("derived", torch.empty(3, device="meta"), persistent=False)
        return model

    monkeypatch.setattr(torchvision_models, "build", build_with_a_buffer_no_file_fills)
    with pytest.raises(fh.WeightsUnavailableError, match="without values: derived"):
        load_backbone("resnet18")


def test_enum_member_names_are_accepted(resnet18_cached: Path) -> None:
    for weights in ["IMAGENET1K_V1", "ResNet18_Weights.IMAGENET1K_V1", tvm.ResNet18_Weights.IMAGENET1K_V1]:
        assert load_backbone("resnet18", weights).weights == "ResNet18_Weights.IMAGENET1K_V1"
    with pytest.raises(fh.WeightsUnavailableError, match="IMAGENET1K_V1"):
        load_backbone("resnet18", "IMAGENET1K_V9")
    with pytest.raises(fh.WeightsUnavailableError, match="not weights of resnet18"):
        load_backbone("resnet18", tvm.VGG16_Weights.IMAGENET1K_V1)


def test_missing_weights_raise_one_clear_error_and_never_fall_back(torch_home: Path) -> None:
    with pytest.raises(fh.WeightsUnavailableError) as info:
        load_backbone("resnet34")
    message = str(info.value)
    assert "resnet34-b627a593.pth" in message
    assert str(torch_home / "hub" / "checkpoints") in message
    assert "weights=None" in message and "local file" in message


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_local_weights_file(tmp_path: Path, suffix: str) -> None:
    torch.manual_seed(3)
    state = tvm.resnet18().state_dict()
    path = tmp_path / f"mine{suffix}"
    if suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save({"state_dict": state}, path)
    backbone = load_backbone("resnet18", str(path))
    assert backbone.weights == str(path)
    assert torch.equal(backbone.model.fc.weight, state["fc.weight"])
    assert backbone.preprocessing.mean == pytest.approx((0.485, 0.456, 0.406))


def test_local_file_with_pickled_objects_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pth"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "payload": Path("/")}, path)
    with pytest.raises(fh.WeightsUnavailableError, match="could not read"):
        load_backbone("resnet18", str(path))


def test_missing_local_file(tmp_path: Path) -> None:
    with pytest.raises(fh.WeightsUnavailableError, match="not found"):
        load_backbone("resnet18", str(tmp_path / "nope.pth"))


def test_random_init_is_explicit() -> None:
    backbone = load_backbone("alexnet", None)
    assert backbone.weights is None
    assert backbone.preprocessing.crop_size == 224


def test_timm_missing_pretrained_weights_error(torch_home: Path) -> None:
    pytest.importorskip("timm")
    with pytest.raises(fh.WeightsUnavailableError, match="weights=None"):
        load_backbone("timm/resnet18")


def test_timm_is_imported_lazily_with_a_helpful_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_timm(name: str, *args, **kwargs):
        if name == "timm" or name.startswith("timm."):
            raise ImportError("No module named 'timm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_timm)
    with pytest.raises(ImportError, match=r"featurehooks\[timm\]"):
        load_backbone("timm/resnet18", None)


def test_nn_module_takes_a_local_file_and_rejects_enum_names(tmp_path: Path) -> None:
    net = torch.nn.Conv2d(3, 4, 3)
    other = torch.nn.Conv2d(3, 4, 3)
    path = tmp_path / "net.pt"
    torch.save(other.state_dict(), path)
    assert torch.equal(load_backbone(net, path).model.weight, other.weight)
    with pytest.raises(ValueError, match="nn.Module"):
        load_backbone(net, "IMAGENET1K_V1")


def test_mean_and_std_override_and_must_come_together() -> None:
    backbone = load_backbone("alexnet", None, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert backbone.preprocessing.mean == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="both"):
        load_backbone("alexnet", None, mean=(0.5, 0.5, 0.5))
