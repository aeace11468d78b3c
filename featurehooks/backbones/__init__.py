"""Backbone registry: torchvision names, ``timm/<name>``, or a user's ``nn.Module``."""

from __future__ import annotations

import copy
import fnmatch
import os
from typing import Union

from torch import nn
from torchvision.models import WeightsEnum

from . import timm_models, torchvision_models
from .base import Backbone, Preprocessing

BackboneSpec = Union[str, nn.Module]
WeightsSpec = Union[str, "os.PathLike[str]", WeightsEnum, None]

__all__ = ["Backbone", "BackboneSpec", "Preprocessing", "WeightsSpec", "available_backbones", "build_architecture", "load_backbone"]


def available_backbones(include: str | None = None) -> list[str]:
    """Registered torchvision backbone names, optionally filtered by a glob (``"vgg*"``).

    Any timm model is available too, as ``"timm/<name>"`` (see ``timm.list_models()``).
    """
    names = torchvision_models.torchvision_names()
    return [n for n in names if include is None or fnmatch.fnmatch(n, include)]


def load_backbone(
    spec: BackboneSpec,
    weights: WeightsSpec = "DEFAULT",
    *,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
) -> Backbone:
    """Build a backbone and load its weights; ``mean``/``std`` override the weights' normalization.

    A user's ``nn.Module`` is deep-copied, so freezing and hooking never touch the caller's object;
    it gets no normalization unless ``mean`` and ``std`` are given.
    """
    if isinstance(spec, nn.Module):
        backbone = Backbone(copy.deepcopy(spec), type(spec).__name__, None, Preprocessing())
    elif isinstance(spec, str) and spec.startswith(timm_models.PREFIX):
        backbone = timm_models.load(spec[len(timm_models.PREFIX):], weights)
    elif isinstance(spec, str):
        backbone = torchvision_models.load(spec, weights)
    else:
        raise TypeError(f"backbone must be a model name or an nn.Module, not {type(spec).__name__}")
    if (mean is None) != (std is None):
        raise ValueError("give both mean and std, or neither")
    if mean is not None and std is not None:
        pre = backbone.preprocessing
        backbone.preprocessing = Preprocessing(tuple(mean), tuple(std), pre.resize_size, pre.crop_size, pre.interpolation)
    return backbone


def build_architecture(spec: str) -> tuple[nn.Module, Preprocessing]:
    """The architecture of a named backbone with random weights and its default preprocessing (no download)."""
    if spec.startswith(timm_models.PREFIX):
        model = timm_models.build(spec[len(timm_models.PREFIX):])
        return model, timm_models.preprocessing_of(model)
    model = torchvision_models.build(spec)
    default = torchvision_models.resolve_weights(spec, "DEFAULT")
    return model, torchvision_models.preprocessing_of(default)
