"""Torchvision classification models by their torchvision names, with offline-first weights."""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torchvision.models as tvm
from torch import nn
from torchvision.models import WeightsEnum

from ..errors import BackboneNotFoundError, WeightsUnavailableError, did_you_mean
from ._files import is_state_dict_file, load_hub_checkpoint, read_state_dict
from ._meta import adopt_state, meta_parameters
from .base import Backbone, Preprocessing

IN_CHANNELS = 3  # every torchvision classification model takes RGB images

_INCEPTION_ARGS = {"transform_input": True, "aux_logits": True, "init_weights": False}
# What each torchvision builder module adds to the model's arguments when given weights, besides num_classes
# (`_ovewrite_named_param`, and VGG's plain assignment, in torchvision/models/*.py).
_BUILDER_ARGS: dict[str, Callable[[WeightsEnum], dict[str, Any]]] = {
    "vgg": lambda member: {"init_weights": False},
    "inception": lambda member: dict(_INCEPTION_ARGS),
    "googlenet": lambda member: dict(_INCEPTION_ARGS),
    "vision_transformer": lambda member: {"image_size": member.meta["min_size"][0]},
    "maxvit": lambda member: {"input_size": member.meta["min_size"]},
}
# Heads a builder sets to None after loading its checkpoint: googlenet's auxiliary heads are not pretrained.
_DISCARDED_HEADS = {"googlenet": ("aux1", "aux2")}
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


@functools.cache
def _builders_by_class() -> dict[type, tuple[str, ...]]:
    """The classification builders' names, by the class the builder returns (its annotation).

    Read from the signatures, so no model is built: ``ResNet`` collects resnet18 ... wide_resnet101_2.
    """
    groups: dict[type, list[str]] = {}
    for name in tvm.list_models(module=tvm):
        returned = inspect.signature(tvm.get_model_builder(name)).return_annotation
        if isinstance(returned, type):
            groups.setdefault(returned, []).append(name)
    return {cls: tuple(names) for cls, names in groups.items()}


@functools.cache
def _layout(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The names and shapes of the state of builder ``name`` with its DEFAULT weights' arguments (meta, no init)."""
    model = build(name, tvm.get_model_weights(name).DEFAULT, meta=True)
    return tuple((key, tuple(value.shape)) for key, value in model.state_dict().items())


def _builders_of(model: nn.Module) -> tuple[str, ...]:
    """The builders of ``type(model)`` whose architecture ``model`` has (its state's names and shapes), or, when
    none has it (another ``num_classes``, a changed layer), every builder of the class."""
    names = _builders_by_class().get(type(model), ())
    layout = tuple((key, tuple(value.shape)) for key, value in model.state_dict().items())
    same = tuple(name for name in names if _layout(name) == layout)
    return same or names


def instance_preprocessing(model: nn.Module, *, explained: bool) -> tuple[Preprocessing, str | None] | None:
    """What the name of the instance's builder gives with ``weights="DEFAULT"``, and a one-line warning when that
    cannot be told: for its normalization (unless ``explained``: mean and std were given), else for its resize and
    crop.

    None when no classification builder returns exactly that class (a subclass, a quantizable or detection
    model). An instance records neither its builder nor its weights, but its architecture tells the builder:
    ``tvm.resnet50()`` has the state names and shapes of resnet50 alone among the ``ResNet`` builders, so it
    gets resnet50's DEFAULT preprocessing, exactly as the name ``"resnet50"`` does. An instance no builder
    matches (another ``num_classes``) gets what the DEFAULT weights of all the builders of its class share: the
    mean and std (ImageNet's for every class but ``EfficientNet``, whose efficientnet_v2_l uses 0.5, hence a
    warning), and the resize, crop and interpolation where those agree too (else a warning: a fine-tuned
    ``resnet50(num_classes=10)`` would silently get neither). Weights other than DEFAULT that normalize otherwise
    (VGG16's IMAGENET1K_FEATURES) need ``mean=``/``std=``, or the name and ``weights=``.
    """
    if type(model) not in _builders_by_class():
        return None
    members = [tvm.get_model_weights(name).DEFAULT for name in _builders_of(model)]
    options = {member: preprocessing_of(member) for member in members}
    statistics = {(pre.mean, pre.std) for pre in options.values()}
    sizes = {(pre.resize_size, pre.crop_size, pre.interpolation) for pre in options.values()}
    mean, std = next(iter(statistics)) if len(statistics) == 1 else (None, None)
    resize, crop, interpolation = next(iter(sizes)) if len(sizes) == 1 else (None, None, "bilinear")
    shared = Preprocessing(mean, std, resize, crop, interpolation)
    if len(statistics) > 1 and not explained:
        return shared, _no_normalization(type(model), options)
    return shared, _no_sizes(type(model), options) if len(sizes) > 1 else None


def _no_normalization(cls: type, options: dict[WeightsEnum, Preprocessing]) -> str:
    """Why a ``cls`` instance gets no normalization (nor a resize or crop): which weights use which mean/std, and
    what to pass."""
    described = _grouped(options, lambda pre: f"mean {_short(pre.mean)}, std {_short(pre.std)}")
    return (
        f"{cls.__name__} instances get no normalization: the DEFAULT weights of {cls.__name__}'s builders disagree "
        f"({described}) and an instance does not say which it holds; pass mean= and std= (and resize_size=/"
        "crop_size= where images are prepared), or give the model's name and weights instead of an instance"
    )


def _no_sizes(cls: type, options: dict[WeightsEnum, Preprocessing]) -> str:
    """Why a ``cls`` instance gets no resize or crop: which weights prepare images how, and what to pass."""
    described = _grouped(options, lambda pre: f"resize {pre.resize_size}, crop {pre.crop_size} {pre.interpolation}")
    return (
        f"{cls.__name__} instance gets no resize or crop: no builder has its architecture (another num_classes, a "
        f"changed layer?) and the DEFAULT weights of {cls.__name__}'s builders prepare images apart ({described}); "
        "pass resize_size= and crop_size= where images are prepared (prepare_image, dump_features, statistics; "
        "--resize/--crop), e.g. those of the weights it was fine-tuned from"
    )


def _grouped(options: dict[WeightsEnum, Preprocessing], describe: Callable[[Preprocessing], str]) -> str:
    """The weights of ``options`` grouped by what ``describe`` says of their preprocessing: three groups at most,
    two names a group."""
    groups: dict[str, list[str]] = {}
    for member, pre in options.items():
        groups.setdefault(describe(pre), []).append(str(member))
    shown = [
        f"{said} for {', '.join(names[:2])}" + (f" and {len(names) - 2} more" if len(names) > 2 else "")
        for said, names in list(groups.items())[:3]
    ]
    return "; ".join(shown) + (f"; {len(groups) - 3} more" if len(groups) > 3 else "")


def _short(values: tuple[float, ...] | None) -> str:
    """A mean or std, four significant digits a value."""
    return "(" + ", ".join(f"{v:.4g}" for v in values or ()) + ")"


def builder_kwargs(name: str, member: WeightsEnum) -> dict[str, Any]:
    """The arguments torchvision's builder of ``name`` derives from ``member`` (its ``_ovewrite_named_param`` calls).

    We build with weights=None and load the checkpoint ourselves (``weights_only=True``, our own offline errors),
    so the architecture must get these arguments from us: ``vit_b_16`` with IMAGENET1K_SWAG_E2E_V1 is a 384 model.
    """
    kwargs: dict[str, Any] = {}
    if member.meta["categories"] is not None:
        kwargs["num_classes"] = len(member.meta["categories"])
    family = tvm.get_model_builder(name).__module__.rsplit(".", 1)[-1]
    if family in _BUILDER_ARGS:
        kwargs.update(_BUILDER_ARGS[family](member))
    return kwargs


def layout_member(name: str, weights: str | os.PathLike[str] | WeightsEnum | None) -> WeightsEnum:
    """The member whose architecture and preprocessing ``weights`` get: itself, or DEFAULT for None or a file.

    Random init and local files take DEFAULT's layout, so the architecture agrees with DEFAULT's
    preprocessing (``vit_h_14`` is a 518 model either way).
    """
    _check_name(name)
    if weights is None or is_state_dict_file(weights):
        return tvm.get_model_weights(name).DEFAULT
    return resolve_weights(name, weights if isinstance(weights, WeightsEnum) else str(weights))


def random_init_kwargs(name: str, member: WeightsEnum) -> dict[str, Any]:
    """``builder_kwargs`` with the architecture's own init, which the builder turns off only to load weights."""
    kwargs = builder_kwargs(name, member)
    if "init_weights" in kwargs:
        kwargs["init_weights"] = True
    return kwargs


def build(name: str, member: WeightsEnum, *, meta: bool) -> nn.Module:
    """The model torchvision's builder returns for ``member``, before its weights are loaded.

    ``meta=True`` puts the parameters on the meta device without a random init; ``meta=False`` is a real
    random init on the CPU.
    """
    if meta:
        with meta_parameters():
            model = tvm.get_model(name, weights=None, **builder_kwargs(name, member))
    else:
        model = tvm.get_model(name, weights=None, **random_init_kwargs(name, member))
    return _discard_heads(name, model)


def _discard_heads(name: str, model: nn.Module) -> nn.Module:
    """Set to None the heads torchvision's builder discards after loading, as it does."""
    heads = _DISCARDED_HEADS.get(name, ())
    for head in heads:
        setattr(model, head, None)
    if heads:
        model.aux_logits = False  # type: ignore[assignment]  # a plain attribute, as the builder sets it
    return model


def _without_discarded_heads(name: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state without the keys of discarded heads: hub files have them, a saved torchvision model does not."""
    prefixes = tuple(f"{head}." for head in _DISCARDED_HEADS.get(name, ()))
    return {key: value for key, value in state.items() if not key.startswith(prefixes)}


def architecture(name: str, weights: str | os.PathLike[str] | WeightsEnum | None) -> Backbone:
    """What ``load`` gives for these ``weights``, with meta parameters: nothing downloaded, read or initialized."""
    member = layout_member(name, weights)
    model = build(name, member, meta=True)
    return Backbone(model, name, _source(weights, member), preprocessing_of(member), IN_CHANNELS)


def _source(weights: str | os.PathLike[str] | WeightsEnum | None, member: WeightsEnum) -> str | None:
    """Where the weights come from, as a Backbone records it: None, the file, or the enum member."""
    if weights is None:
        return None
    return str(weights) if is_state_dict_file(weights) else str(member)


def _fix_legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    fixed = {}
    for key, value in state.items():
        match = _DENSENET_OLD_KEY.match(key)
        fixed[match.group(1) + match.group(2) if match else key] = value
    return fixed


def load(name: str, weights: str | os.PathLike[str] | WeightsEnum | None) -> Backbone:
    """Build torchvision model ``name`` and load ``weights`` (enum name, member, local file or None)."""
    member = layout_member(name, weights)
    source = _source(weights, member)
    if weights is None:
        model = build(name, member, meta=False)
    elif is_state_dict_file(weights):
        model = _with_state(name, member, read_state_dict(weights), str(source))  # type: ignore[arg-type]
    else:
        alternatives = f"pass weights=None for random init or weights='path/to/{name}.pth' for a local file"
        state = load_hub_checkpoint(member.url, f"{name} ({member})", alternatives)
        model = _with_state(name, member, state, str(source))
    return Backbone(model, name, source, preprocessing_of(member), IN_CHANNELS)


def _with_state(name: str, member: WeightsEnum, state: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Build on the meta device and adopt the loaded tensors, skipping a random init that would be overwritten."""
    model = build(name, member, meta=True)
    return adopt_state(model, _without_discarded_heads(name, _fix_legacy_keys(state)), source, name)
