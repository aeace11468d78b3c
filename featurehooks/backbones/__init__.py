"""Backbone registry: torchvision names, ``timm/<name>``, or a user's ``nn.Module``."""

from __future__ import annotations

import fnmatch
import os
import warnings
from dataclasses import replace
from typing import Union

from torch import nn
from torchvision.models import WeightsEnum

from .._copy import private_copy
from ..errors import InvalidTypeError, InvalidValueError
from . import timm_models, torchvision_models
from ._files import is_state_dict_file, load_fitting, read_state_dict
from .base import Backbone, Preprocessing

BackboneSpec = Union[str, nn.Module]
WeightsSpec = Union[str, "os.PathLike[str]", WeightsEnum, None]

__all__ = [
    "Backbone",
    "BackboneSpec",
    "Preprocessing",
    "WeightsSpec",
    "available_backbones",
    "build_architecture",
    "load_backbone",
]


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

    A user's ``nn.Module`` is copied (parameters and buffers; other tensors it references are shared), so
    freezing and hooking never touch the caller's object; it keeps its own weights (or loads a local file given
    as ``weights``) and gets the preprocessing its own library gives it, so the defaults equal the user's own
    pipeline:

    - a timm model (built by ``timm.create_model``) gets its ``pretrained_cfg`` exactly as ``"timm/<name>"``
      does: timm's eval transform and normalization, and its input channels;
    - an instance of a class a torchvision classification builder returns (``ResNet``, ``VGG``, ...) gets what
      the names of that class give with ``weights="DEFAULT"`` where they all agree: ImageNet's mean and std,
      and the resize and crop too where those agree (VGG, AlexNet...; not ResNet: resnet18 and resnet50
      resize differently); where even the mean and std differ (``EfficientNet``), no normalization and a
      warning, unless ``mean`` and ``std`` are given;
    - any other module gets nothing: no normalization, resize or crop, so its images keep their own size.
    """
    if (mean is None) != (std is None):
        raise InvalidValueError("give both mean and std, or neither")
    if isinstance(spec, nn.Module):
        backbone = _own_module(spec, weights, explained=mean is not None)
    elif isinstance(spec, str) and spec.startswith(timm_models.PREFIX):
        backbone = timm_models.load(spec[len(timm_models.PREFIX) :], weights)
    elif isinstance(spec, str):
        backbone = torchvision_models.load(spec, weights)
    else:
        raise InvalidTypeError(f"backbone must be a model name or an nn.Module, not {type(spec).__name__}")
    if mean is not None and std is not None:
        backbone.preprocessing = replace(backbone.preprocessing, mean=tuple(mean), std=tuple(std))
    return backbone


def _own_module(module: nn.Module, weights: WeightsSpec, *, explained: bool) -> Backbone:
    """A copy of the user's module (``private_copy``); ``weights`` may name a local file to load into it.

    ``explained``: the user gave mean and std, so a warning that the instance's normalization is unknown
    would say nothing.
    """
    model = private_copy(module)
    source = None
    if is_state_dict_file(weights):
        load_fitting(model, read_state_dict(weights), str(weights))  # type: ignore[arg-type]
        source = str(weights)
    elif weights not in ("DEFAULT", None):
        raise InvalidValueError(
            f"weights={weights!r} cannot apply to an nn.Module: pass a local state-dict file, or "
            "'DEFAULT'/None to use the module's own weights"
        )
    preprocessing, channels, unknown = _instance_facts(model)
    if unknown is not None and not explained:
        warnings.warn(unknown, stacklevel=3)
    return Backbone(model, type(module).__name__, source, preprocessing, channels)


def _instance_facts(module: nn.Module) -> tuple[Preprocessing, int | None, str | None]:
    """Preprocessing, input channels and a warning (or None) for a model given as an instance: timm's, torchvision's
    or none (see ``load_backbone``)."""
    if timm_models.is_timm_model(module):
        preprocessing, channels = timm_models.model_facts(module)
        return preprocessing, channels, None
    shared = torchvision_models.instance_preprocessing(module)
    if shared is not None:
        preprocessing, unknown = shared
        return preprocessing, torchvision_models.IN_CHANNELS, unknown
    return Preprocessing(), None, None


def build_architecture(spec: str, weights: WeightsSpec = "DEFAULT") -> Backbone:
    """The Backbone ``load_backbone(spec, weights)`` would give, with its parameters on the meta device.

    Nothing is downloaded, read or randomly initialized: layer listings need shapes, not values. For
    torchvision, ``weights`` picks the member whose architecture and preprocessing it has (an enum member or
    name, "DEFAULT"; None or a local file mean DEFAULT's); timm architectures do not depend on ``weights``.
    """
    if spec.startswith(timm_models.PREFIX):
        return timm_models.architecture(spec[len(timm_models.PREFIX) :], weights)
    return torchvision_models.architecture(spec, weights)
