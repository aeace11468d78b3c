"""Torchvision classification models by their torchvision names, with offline-first weights."""

from __future__ import annotations

import os
import re
from itertools import chain
from typing import Any

import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models import WeightsEnum

from ..errors import BackboneNotFoundError, WeightsUnavailableError, did_you_mean
from ._files import is_state_dict_file, load_fitting, load_hub_checkpoint, read_state_dict
from .base import Backbone, Preprocessing

# Builders that change the architecture when pretrained weights are requested; we build with
# weights=None (to load the file ourselves with weights_only=True), so we pass the same arguments.
_PRETRAINED_BUILD_ARGS: dict[str, dict[str, Any]] = {
    "inception_v3": {"transform_input": True, "aux_logits": True, "init_weights": False},
    "googlenet": {"transform_input": True, "aux_logits": True, "init_weights": False},
}
# DenseNet checkpoints predate the ban on '.' in module names ('norm.1' is now 'norm1').
_DENSENET_OLD_KEY = re.compile(r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.(?:weight|bias|running_\w+))$")


def torchvision_names() -> list[str]:
    """Names of the torchvision classification models, sorted."""
    return sorted(tvm.list_models(module=tvm))


def is_torchvision_name(name: str) -> bool:
    """Whether ``name`` is a torchvision classification model."""
    return name in tvm.list_models(module=tvm)


def _check_name(name: str) -> None:
    if not is_torchvision_name(name):
        hint = did_you_mean(name, torchvision_names())
        raise BackboneNotFoundError(
            f"unknown backbone {name!r}; {hint} Use a torchvision classification model name "
            "(featurehooks.available_backbones()), 'timm/<name>' for timm, or an nn.Module."
        )


def resolve_weights(name: str, weights: str | WeightsEnum) -> WeightsEnum:
    """Turn ``"DEFAULT"``, ``"IMAGENET1K_V1"``, ``"VGG16_Weights.IMAGENET1K_V1"`` or a member into the enum member."""
    enum = tvm.get_model_weights(name)
    if isinstance(weights, WeightsEnum):
        if not isinstance(weights, enum):
            raise WeightsUnavailableError(f"{weights} are not weights of {name}; use a member of {enum.__name__}")
        return weights
    member = weights.split(".")[-1]
    if member not in enum.__members__:
        options = ", ".join(repr(m) for m in enum.__members__)
        raise WeightsUnavailableError(
            f"unknown weights {weights!r} for {name}; choose one of {options}, None for random init, "
            "or a local .pth/.pt/.safetensors file"
        )
    return enum[member]


def preprocessing_of(weights: WeightsEnum) -> Preprocessing:
    """Mean, std, resize and crop from the weights' own inference transforms."""
    transforms = weights.transforms()
    resize = transforms.resize_size
    return Preprocessing(
        mean=tuple(float(v) for v in transforms.mean),
        std=tuple(float(v) for v in transforms.std),
        resize_size=int(resize[0]) if resize else None,
        crop_size=int(transforms.crop_size[0]),
        interpolation=transforms.interpolation.value,
    )


def build(name: str, *, pretrained_layout: bool = True) -> nn.Module:
    """Build the architecture with random weights; ``pretrained_layout`` matches the released checkpoints."""
    _check_name(name)
    default = tvm.get_model_weights(name).DEFAULT
    kwargs: dict[str, Any] = {"num_classes": len(default.meta["categories"])}
    if pretrained_layout:
        kwargs.update(_PRETRAINED_BUILD_ARGS.get(name, {}))
    return tvm.get_model(name, weights=None, **kwargs)


def _fix_legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fixed = {}
    for key, value in state.items():
        match = _DENSENET_OLD_KEY.match(key)
        fixed[match.group(1) + match.group(2) if match else key] = value
    return fixed


def load(name: str, weights: str | os.PathLike[str] | WeightsEnum | None) -> Backbone:
    """Build torchvision model ``name`` and load ``weights`` (enum name, member, local file or None)."""
    _check_name(name)
    default = tvm.get_model_weights(name).DEFAULT
    if weights is None:
        return Backbone(build(name, pretrained_layout=False), name, None, preprocessing_of(default))
    if is_state_dict_file(weights):
        state = read_state_dict(weights)
        source = str(weights)
    else:
        member = resolve_weights(name, weights)
        alternatives = f"pass weights=None for random init or weights='path/to/{name}.pth' for a local file"
        state = load_hub_checkpoint(member.url, f"{name} ({member})", alternatives)
        source, default = str(member), member
    return Backbone(_with_state(name, _fix_legacy_keys(state), source), name, source, preprocessing_of(default))


def _with_state(name: str, state: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Build on the meta device and adopt the loaded tensors, skipping a random init that would be overwritten.

    Architectures with buffers outside their state dict are built for real instead.
    """
    with torch.device("meta"):
        model = build(name)
    # assign=True adopts the file's tensors as they are: keep the architecture's dtypes (a half-precision
    # file would otherwise make a half-precision model), as a copying load_state_dict does.
    dtypes = {key: value.dtype for key, value in model.state_dict().items()}
    state = {key: value.to(dtypes.get(key, value.dtype)) for key, value in state.items()}
    load_fitting(model, state, source, assign=True)
    if any(t.is_meta for t in chain(model.parameters(), model.buffers())):
        model = build(name)
        load_fitting(model, state, source)
    return model
