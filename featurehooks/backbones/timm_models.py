"""timm models as ``timm/<name>``; timm is an optional extra, imported only when asked for."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from torch import nn

from ..errors import BackboneNotFoundError, WeightsUnavailableError, did_you_mean
from ._files import is_state_dict_file
from .base import Backbone, Preprocessing

PREFIX = "timm/"


def import_timm() -> ModuleType:
    """Import timm or explain which extra installs it."""
    try:
        import timm
    except ImportError as exc:
        raise ImportError(
            "timm backbones need the optional dependency timm: pip install 'featurehooks[timm]'"
        ) from exc
    return timm


def _check_name(timm: ModuleType, name: str) -> None:
    if not timm.is_model(name):
        hint = did_you_mean(name, timm.list_models())
        raise BackboneNotFoundError(f"unknown timm model {name!r}; {hint} See timm.list_models().")


def preprocessing_of(model: nn.Module) -> Preprocessing:
    """Mean, std, resize and crop from the model's ``pretrained_cfg``, resolved the way timm does."""
    timm = import_timm()
    config: dict[str, Any] = timm.data.resolve_data_config({}, model=model)
    crop = int(config["input_size"][-1])
    crop_pct = float(config.get("crop_pct", 1.0))
    return Preprocessing(
        mean=tuple(float(v) for v in config["mean"]),
        std=tuple(float(v) for v in config["std"]),
        resize_size=int(round(crop / crop_pct)),
        crop_size=crop,
        interpolation=str(config.get("interpolation", "bilinear")),
    )


def build(name: str) -> nn.Module:
    """Build timm model ``name`` with random weights."""
    timm = import_timm()
    _check_name(timm, name)
    return timm.create_model(name, pretrained=False)


def load(name: str, weights: str | os.PathLike[str] | None) -> Backbone:
    """Create timm model ``name``; ``weights``: "DEFAULT" (timm's pretrained tag), a local file, or None.

    timm reads files with ``weights_only=True`` (or safetensors) and applies the model's checkpoint filter.
    """
    timm = import_timm()
    _check_name(timm, name)
    if weights is None:
        model = timm.create_model(name, pretrained=False)
        return Backbone(model, PREFIX + name, None, preprocessing_of(model))
    if is_state_dict_file(weights):
        if not os.path.isfile(weights):
            raise WeightsUnavailableError(f"weights file not found: {weights}")
        overlay = {"file": str(weights)}
        source = str(weights)
    elif weights == "DEFAULT":
        overlay, source = None, f"timm:{name}"
    else:
        raise WeightsUnavailableError(
            f"timm weights must be 'DEFAULT', a local .pth/.safetensors file or None, not {weights!r}; "
            f"pick a pretrained tag in the name instead (timm/{name}.<tag>)"
        )
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    except (OSError, RuntimeError, ValueError) as exc:
        raise WeightsUnavailableError(
            f"pretrained weights for timm model {name!r} are not cached and could not be loaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Set HF_HOME to a cache that "
            "holds them, pass weights='path/to/file.safetensors', or weights=None for random init"
        ) from exc
    return Backbone(model, PREFIX + name, source, preprocessing_of(model))
