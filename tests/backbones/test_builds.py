"""Every torchvision model and weights member builds by name exactly as torchvision's own builder builds it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models import WeightsEnum

from featurehooks.backbones import build_architecture, load_backbone
from featurehooks.backbones._meta import meta_parameters, meta_tensor_names

from helpers import slow_unless

MEMBERS = [
    (name, member.name) for name in sorted(tvm.list_models(module=tvm)) for member in tvm.get_model_weights(name)
]
REGNETS = sorted(tvm.list_models(module=tvm, include="regnet_*"))
# make test-fast: plain members, and members whose layout the builder derives from the weights (SWAG ViT and
# RegNet at 384 px)
FAST_MEMBERS = (
    ("resnet18", "IMAGENET1K_V1"),
    ("vit_b_16", "IMAGENET1K_SWAG_E2E_V1"),
    ("vit_b_16", "IMAGENET1K_SWAG_LINEAR_V1"),
    ("regnet_y_16gf", "IMAGENET1K_SWAG_E2E_V1"),
    ("googlenet", "IMAGENET1K_V1"),
    ("inception_v3", "IMAGENET1K_V1"),
)
_SIMPLE = (bool, int, float, str, tuple, list, type(None))


def _attributes(module: nn.Module) -> dict[str, Any]:
    """A module's plain public attributes: image_size, transform_input, aux_logits, kernel sizes, ..."""
    return {key: value for key, value in vars(module).items() if isinstance(value, _SIMPLE) and key[0] != "_"}


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes of a module's own parameters and buffers."""
    tensors = [*module._parameters.items(), *module._buffers.items()]
    return {key: tuple(tensor.shape) for key, tensor in tensors if tensor is not None}


def _layout(model: nn.Module) -> dict[str, Any]:
    """Per submodule: its class, its plain attributes and its tensor shapes."""
    return {path: (type(m).__name__, _attributes(m), _shapes(m)) for path, m in model.named_modules()}


def _torchvisions_own(name: str, member: str, monkeypatch: pytest.MonkeyPatch) -> nn.Module:
    """``tvm.get_model(name, weights=member)`` on meta: torchvision's builder runs, its checkpoint load is left out."""
    no_checkpoint: dict[str, torch.Tensor] = {}
    load_state_dict = nn.Module.load_state_dict

    def load_unless_no_checkpoint(module: nn.Module, state: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return None if state is no_checkpoint else load_state_dict(module, state, *args, **kwargs)

    monkeypatch.setattr(WeightsEnum, "get_state_dict", lambda self, *args, **kwargs: no_checkpoint)
    monkeypatch.setattr(nn.Module, "load_state_dict", load_unless_no_checkpoint)
    with meta_parameters():
        return tvm.get_model(name, weights=member)


@pytest.mark.parametrize(("name", "member"), slow_unless(MEMBERS, FAST_MEMBERS), ids=[f"{n}-{m}" for n, m in MEMBERS])
def test_every_member_builds_like_torchvisions_own_builder(
    name: str, member: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backbone = build_architecture(name, member)
    assert all(p.is_meta for p in backbone.model.parameters())
    assert backbone.weights == str(tvm.get_model_weights(name)[member])
    assert backbone.in_channels == 3
    assert _layout(backbone.model) == _layout(_torchvisions_own(name, member, monkeypatch))


def test_member_names_the_architecture_and_the_preprocessing() -> None:
    swag = build_architecture("vit_b_16", "IMAGENET1K_SWAG_E2E_V1")
    assert swag.model.image_size == swag.preprocessing.crop_size == 384
    plain = build_architecture("vit_b_16", tvm.ViT_B_16_Weights.IMAGENET1K_V1)
    assert plain.model.image_size == plain.preprocessing.crop_size == 224


@pytest.mark.parametrize("weights", [None, "DEFAULT", "mine.pth"])
def test_random_init_and_local_files_take_defaults_architecture(weights: str | None) -> None:
    backbone = build_architecture("vit_h_14", weights)
    assert backbone.model.image_size == backbone.preprocessing.crop_size == 518
    assert backbone.weights == {None: None, "DEFAULT": "ViT_H_14_Weights.IMAGENET1K_SWAG_E2E_V1"}.get(weights, weights)


def test_random_init_builds_defaults_architecture_for_real() -> None:
    with meta_parameters():  # only to keep a 600M-parameter init out of the test: load_backbone runs as it is
        backbone = load_backbone("vit_h_14", None)
    assert backbone.model.image_size == backbone.preprocessing.crop_size == 518
    small = load_backbone("googlenet", None)
    assert small.model.transform_input and small.model.aux1 is None  # DEFAULT's layout, as torchvision returns it
    assert not meta_tensor_names(small.model)


@pytest.mark.slow
def test_swag_member_loads_and_equals_torchvision(seeded_weights: Callable[..., Path]) -> None:
    seeded_weights("vit_b_16", "IMAGENET1K_SWAG_E2E_V1")
    backbone = load_backbone("vit_b_16", "IMAGENET1K_SWAG_E2E_V1")
    assert backbone.model.image_size == backbone.preprocessing.crop_size == 384
    assert not meta_tensor_names(backbone.model)
    reference = tvm.get_model("vit_b_16", weights="IMAGENET1K_SWAG_E2E_V1").eval()
    images = torch.rand(1, 3, 384, 384, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(backbone.model.eval()(images), reference(images), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", REGNETS)
def test_every_regnet_builds_on_meta(name: str) -> None:
    model = build_architecture(name).model
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())


def test_buffers_computed_in_init_keep_their_values() -> None:
    model = build_architecture("swin_t").model
    reference = dict(tvm.swin_t().named_buffers())
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, reference[name]), name


def test_small_regnet_loads_and_equals_torchvision(seeded_weights: Callable[..., Path]) -> None:
    seeded_weights("regnet_y_400mf")
    backbone = load_backbone("regnet_y_400mf")
    assert not meta_tensor_names(backbone.model)
    reference = tvm.get_model("regnet_y_400mf", weights="DEFAULT").eval()
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(backbone.model.eval()(images), reference(images))


def test_googlenet_loads_like_torchvision(seeded_weights: Callable[..., Path], tmp_path: Path) -> None:
    seeded_weights("googlenet")
    reference = tvm.get_model("googlenet", weights="DEFAULT")
    backbone = load_backbone("googlenet")
    assert _layout(backbone.model) == _layout(reference)
    reference.eval()
    path = tmp_path / "saved.pth"
    torch.save(reference.state_dict(), path)  # a saved torchvision googlenet has no aux heads: it loads too
    from_file = load_backbone("googlenet", path)
    images = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_file.model.eval()(images), reference(images))
        assert torch.equal(backbone.model.eval()(images), reference(images))


def test_meta_parameters_touch_only_the_calling_thread_and_restore() -> None:
    original = nn.Module.register_parameter
    built: list[nn.Module] = []
    with meta_parameters():
        thread = threading.Thread(target=lambda: built.append(nn.Linear(2, 2)))
        thread.start()
        thread.join()
        here = nn.Linear(2, 2)
    assert here.weight.is_meta and not built[0].weight.is_meta
    with pytest.raises(RuntimeError, match="inside"), meta_parameters():
        raise RuntimeError("inside")
    assert nn.Module.register_parameter is original and not nn.Linear(2, 2).weight.is_meta


def test_timm_in_channels_come_from_the_config_not_the_stem() -> None:
    pytest.importorskip("timm")
    backbone = load_backbone("timm/tresnet_m", None)
    first_conv = next(m for m in backbone.model.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 48 and backbone.in_channels == 3
    assert build_architecture("timm/tresnet_m").in_channels == 3


@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        "vit_tiny_patch16_224",
        "swin_tiny_patch4_window7_224",
        "convnext_atto",
        "tresnet_m",
        "maxvit_tiny_tf_224",
    ],
)
def test_timm_architectures_build_on_meta(name: str) -> None:
    pytest.importorskip("timm")
    backbone = build_architecture(f"timm/{name}", None)
    assert all(p.is_meta for p in backbone.model.parameters())
    assert backbone.weights is None and backbone.in_channels == 3


def test_user_modules_have_no_channel_metadata() -> None:
    assert load_backbone(nn.Conv2d(5, 4, 3)).in_channels is None
