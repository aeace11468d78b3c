"""timm models as ``timm/<name>``; timm is an optional extra, imported only when asked for."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from torch import nn

from ..errors import BackboneNotFoundError, WeightsUnavailableError, did_you_mean
from ._files import is_state_dict_file
from ._meta import meta_parameters
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


def _data_config(model: nn.Module) -> dict[str, Any]:
    """The model's ``pretrained_cfg`` resolved the way timm's own transforms resolve it."""
    return import_timm().data.resolve_data_config({}, model=model)


def _preprocessing(config: dict[str, Any]) -> Preprocessing:
    """Mean, std, resize and crop from a resolved data config."""
    crop = int(config["input_size"][-1])
    crop_pct = float(config.get("crop_pct", 1.0))
    return Preprocessing(
        mean=tuple(float(v) for v in config["mean"]),
        std=tuple(float(v) for v in config["std"]),
        resize_size=int(round(crop / crop_pct)),
        crop_size=crop,
        interpolation=str(config.get("interpolation", "bilinear")),
    )


def _backbone(model: nn.Module, name: str, source: str | None) -> Backbone:
    """A Backbone with preprocessing and input channels from the model's ``pretrained_cfg``.

    The channels come from the config, not the first conv: tresnet's space-to-depth stem convolves 48 channels
    of a 3-channel image.
    """
    config = _data_config(model)
    return Backbone(model, PREFIX + name, source, _preprocessing(config), int(config["input_size"][0]))


def _source(name: str, weights: str | os.PathLike[str] | None) -> str | None:
    """Where the weights of ``name`` come from: None, the local file, or ``timm:<name>`` for "DEFAULT"."""
    if weights is None:
        return None
    if is_state_dict_file(weights):
        return str(weights)
    if weights == "DEFAULT":
        return f"timm:{name}"
    raise WeightsUnavailableError(
        f"timm weights must be 'DEFAULT', a local .pth/.safetensors file or None, not {weights!r}; "
        f"pick a pretrained tag in the name instead (timm/{name}.<tag>)"
    )


def architecture(name: str, weights: str | os.PathLike[str] | None) -> Backbone:
    """What ``load`` gives for these ``weights``, with meta parameters: nothing downloaded, read or initialized."""
    timm = import_timm()
    _check_name(timm, name)
    source = _source(name, weights)
    with meta_parameters():
        model = timm.create_model(name, pretrained=False)
    return _backbone(model, name, source)


def load(name: str, weights: str | os.PathLike[str] | None) -> Backbone:
    """Create timm model ``name``; ``weights``: "DEFAULT" (timm's pretrained tag), a local file, or None.

    timm reads files with ``weights_only=True`` (or safetensors) and applies the model's checkpoint filter.
    """
    timm = import_timm()
    _check_name(timm, name)
    source = _source(name, weights)
    if source is None:
        return _backbone(timm.create_model(name, pretrained=False), name, None)
    if is_state_dict_file(weights) and not os.path.isfile(source):
        raise WeightsUnavailableError(f"weights file not found: {source}")
    overlay = {"file": source} if is_state_dict_file(weights) else None
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    except (OSError, RuntimeError, ValueError) as exc:
        raise WeightsUnavailableError(
            f"pretrained weights for timm model {name!r} are not cached and could not be loaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Set HF_HOME to a cache that "
            "holds them, pass weights='path/to/file.safetensors', or weights=None for random init"
        ) from exc
    return _backbone(model, name, source)
