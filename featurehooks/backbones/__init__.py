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
from . import clip, dinov2, timm_models, torchvision_models
from ._files import is_state_dict_file, load_fitting, read_state_dict
from .base import Backbone, Preprocessing
from .fid_inception import FID_INCEPTION, fid_inception_architecture, load_fid_inception

BackboneSpec = Union[str, nn.Module]
"""A backbone: a torchvision model name (``"vgg16"``), ``"timm/<name>"``, or your own ``nn.Module``.

Examples:
    >>> import torch
    >>> from featurehooks import load_backbone
    >>> [load_backbone(spec, weights=None).name for spec in ("resnet18", torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)))]
    ['resnet18', 'Sequential']
"""
WeightsSpec = Union[str, "os.PathLike[str]", WeightsEnum, None]
"""Weights: ``"DEFAULT"``, a weights name (``"IMAGENET1K_V1"``) or enum member, ``None`` for random init, or a
local ``.pth``/``.pt``/``.safetensors`` file.

Examples:
    >>> import os, tempfile, torch, torchvision
    >>> from featurehooks import load_backbone
    >>> path = os.path.join(tempfile.mkdtemp(), "squeezenet_finetuned.pth")
    >>> torch.save(torchvision.models.squeezenet1_1().state_dict(), path)  # your fine-tuned weights, say
    >>> load_backbone("squeezenet1_1", weights=path).weights == path
    True
    >>> load_backbone("squeezenet1_1", weights=None).weights is None  # random init
    True
"""

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

    Examples:
        >>> from featurehooks import available_backbones
        >>> available_backbones("vgg1?")
        ['vgg11', 'vgg13', 'vgg16', 'vgg19']
        >>> "resnet50" in available_backbones()
        True
    """
    names = torchvision_models.torchvision_names()
    names = sorted([*names, FID_INCEPTION, *dinov2.DINOV2_MODELS, *clip.CLIP_TOWERS])
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

    Examples:
        >>> import torch
        >>> from featurehooks import load_backbone
        >>> backbone = load_backbone("resnet18", weights=None)  # "DEFAULT": the pretrained weights
        >>> backbone.name, backbone.preprocessing.crop_size
        ('resnet18', 224)
        >>> custom = load_backbone(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), mean=(0.5,) * 3, std=(0.5,) * 3)
        >>> custom.name, custom.preprocessing.mean, custom.preprocessing.crop_size
        ('Sequential', (0.5, 0.5, 0.5), None)
    """
    if (mean is None) != (std is None):
        raise InvalidValueError("give both mean and std, or neither")
    if isinstance(spec, nn.Module):
        backbone = _own_module(spec, weights, explained=mean is not None)
    elif isinstance(spec, str) and spec.startswith(timm_models.PREFIX):
        backbone = timm_models.load(spec[len(timm_models.PREFIX) :], weights)
    elif spec == FID_INCEPTION:
        backbone = load_fid_inception(weights)
    elif dinov2.is_dinov2(spec):
        backbone = dinov2.load(spec, weights)  # type: ignore[arg-type]
    elif isinstance(spec, str) and spec.startswith(clip.PREFIX):
        backbone = clip.load(spec, weights)
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
    would say nothing (one that its resize and crop are unknown still would).
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
    preprocessing, channels, unknown = _instance_facts(model, explained)
    if unknown is not None:
        warnings.warn(unknown, stacklevel=3)
    return Backbone(model, type(module).__name__, source, preprocessing, channels)


def _instance_facts(module: nn.Module, explained: bool) -> tuple[Preprocessing, int | None, str | None]:
    """Preprocessing, input channels and a warning (or None) for a model given as an instance: timm's, torchvision's
    or none (see ``load_backbone``); ``explained`` as in ``_own_module``."""
    if timm_models.is_timm_model(module):
        preprocessing, channels = timm_models.model_facts(module)
        return preprocessing, channels, None
    shared = torchvision_models.instance_preprocessing(module, explained=explained)
    if shared is not None:
        preprocessing, unknown = shared
        return preprocessing, torchvision_models.IN_CHANNELS, unknown
    return Preprocessing(), None, None


def build_architecture(spec: str, weights: WeightsSpec = "DEFAULT") -> Backbone:
    """The Backbone ``load_backbone(spec, weights)`` would give, with its parameters on the meta device.

    Nothing is downloaded, read or randomly initialized: layer listings need shapes, not values. For
    torchvision, ``weights`` picks the member whose architecture and preprocessing it has (an enum member or
    name, "DEFAULT"; None or a local file mean DEFAULT's); timm architectures do not depend on ``weights``.

    Examples:
        >>> from featurehooks.backbones import build_architecture
        >>> backbone = build_architecture("resnet50")  # no download, no memory: shapes only
        >>> next(backbone.model.parameters()).device, backbone.preprocessing.resize_size
        (device(type='meta'), 232)
    """
    if spec == FID_INCEPTION:
        return fid_inception_architecture(weights)
    if dinov2.is_dinov2(spec):
        return dinov2.architecture(spec, weights)  # type: ignore[arg-type]
    if spec.startswith(clip.PREFIX):
        return clip.architecture(spec, weights)
    if spec.startswith(timm_models.PREFIX):
        return timm_models.architecture(spec[len(timm_models.PREFIX) :], weights)
    return torchvision_models.architecture(spec, weights)
