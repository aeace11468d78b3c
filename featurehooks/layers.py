"""Layer names: readable aliases, module paths with call indices, and per-layer metadata from one meta trace."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Union

from torch import nn
from torchvision.models import VGG, AlexNet, SqueezeNet

from ._attention_kinds import attention_kind
from ._layout import classify, patch_size_of, prefix_tokens_of
from ._taps import Selection, Site, Tap, Taps, call_name
from ._trace import Trace, fixed_input_size, trace_images
from .backbones import BackboneSpec, WeightsSpec, build_architecture
from .errors import InvalidTypeError, InvalidValueError, LayerNotFoundError, TraceError, did_you_mean

__all__ = [
    "FeatureInfo",
    "LayerIndex",
    "LayerSpec",
    "alexnet_aliases",
    "describe",
    "list_layers",
    "select_modules",
    "squeezenet_aliases",
    "vgg_aliases",
]

LayerSpec = Union[str, Sequence[str], Mapping[str, str]]
"""Layers to tap: one name, a list of names, or a dict ``{name: output_name}`` that renames the outputs.

Examples:
    >>> from featurehooks import FeatureExtractor
    >>> FeatureExtractor("alexnet", {"relu2": "low", "relu5": "high"}, weights=None).layers
    ['low', 'high']
"""
_CALL_SUFFIX = re.compile(r"(.+)_([1-9][0-9]*)")


@dataclass(frozen=True)
class FeatureInfo:
    """One tappable layer call: its preferred ``name`` (the alias if any), module ``path`` and output facts.

    ``name`` of the k-th extra call of a module is ``path_k``, as in torchvision FX. ``calls`` counts how
    often the module runs in one forward and ``call`` which of those runs this row is. ``layout`` says
    how the output is laid out: ``"NCHW"``, ``"NHWC"`` (Swin), ``"NLC"`` (tokens), ``"NC"``, ``"other"``
    (containers, other ranks), or ``None`` for a module that never runs. ``channels`` and ``stride``
    are read from the axes of that layout (``None`` where there are none); ``prefix_tokens`` counts
    the class/register/distillation tokens that lead an ``NLC`` output, when the model says. ``attention`` marks
    the attention modules whose maps ``capture_attention`` records.
    All of it comes from a shape-only forward on the meta device: no compute, no download.

    Examples:
        >>> from featurehooks import list_layers
        >>> row = list_layers("resnet18", include=["layer3"])[0]
        >>> row.name, row.type, row.layout, row.channels, row.stride
        ('layer3', 'Sequential', 'NCHW', 256, 16)
    """

    name: str
    alias: str | None
    path: str
    type: str
    channels: int | None
    stride: int | None
    calls: int
    call: int = 0
    layout: str | None = None
    prefix_tokens: int | None = None
    attention: bool = False


def vgg_aliases(model: nn.Module) -> dict[str, str]:
    """``convB_I``/``bnB_I``/``reluB_I``/``poolB`` aliases of a torchvision VGG, mapped to module paths.

    Derived from ``model.features``, so every depth (11/13/16/19, with or without BN) gets them.

    Examples:
        >>> import torchvision
        >>> from featurehooks.layers import vgg_aliases
        >>> aliases = vgg_aliases(torchvision.models.vgg11())
        >>> aliases["conv1_1"], aliases["relu1_1"], aliases["pool1"], aliases["relu5_2"]
        ('features.0', 'features.1', 'features.2', 'features.19')
    """
    aliases: dict[str, str] = {}
    block, index = 1, 1
    features = model.get_submodule("features")
    for position, module in enumerate(features.children()):
        path = f"features.{position}"
        if isinstance(module, nn.Conv2d):
            aliases[f"conv{block}_{index}"] = path
        elif isinstance(module, nn.BatchNorm2d):
            aliases[f"bn{block}_{index}"] = path
        elif isinstance(module, nn.ReLU):
            aliases[f"relu{block}_{index}"] = path
            index += 1
        elif isinstance(module, nn.MaxPool2d):
            aliases[f"pool{block}"] = path
            block, index = block + 1, 1
    return aliases


def alexnet_aliases(model: nn.Module) -> dict[str, str]:
    """``convK``/``reluK``/``poolK`` aliases of torchvision's AlexNet (K: the convolution before it), as in LPIPS.

    Examples:
        >>> import torchvision
        >>> from featurehooks.layers import alexnet_aliases
        >>> list(alexnet_aliases(torchvision.models.alexnet()))[:4]
        ['conv1', 'relu1', 'pool1', 'conv2']
    """
    aliases: dict[str, str] = {}
    block = 0
    for position, module in enumerate(model.get_submodule("features").children()):
        if isinstance(module, nn.Conv2d):
            block += 1
            aliases[f"conv{block}"] = f"features.{position}"
        elif isinstance(module, nn.ReLU):
            aliases[f"relu{block}"] = f"features.{position}"
        elif isinstance(module, nn.MaxPool2d):
            aliases[f"pool{block}"] = f"features.{position}"
    return aliases


def squeezenet_aliases(model: nn.Module) -> dict[str, str]:
    """``conv1``/``relu1``, ``poolK`` (in order) and ``fire2`` ... ``fire9`` aliases of torchvision's SqueezeNets,
    numbered as in the SqueezeNet paper.

    Examples:
        >>> import torchvision
        >>> from featurehooks.layers import squeezenet_aliases
        >>> aliases = squeezenet_aliases(torchvision.models.squeezenet1_1())
        >>> aliases["conv1"], aliases["fire2"], aliases["fire9"]
        ('features.0', 'features.3', 'features.12')
    """
    aliases: dict[str, str] = {}
    fires, pools = 1, 0
    for position, module in enumerate(model.get_submodule("features").children()):
        path = f"features.{position}"
        if isinstance(module, nn.Conv2d):
            aliases["conv1"] = path
        elif isinstance(module, nn.ReLU):
            aliases["relu1"] = path
        elif isinstance(module, nn.MaxPool2d):
            pools += 1
            aliases[f"pool{pools}"] = path
        elif type(module).__name__ == "Fire":
            fires += 1
            aliases[f"fire{fires}"] = path
    return aliases


def aliases_of(model: nn.Module) -> dict[str, str]:
    """Readable aliases known for this architecture (alias -> module path); empty when none."""
    if isinstance(model, VGG):
        return vgg_aliases(model)
    if isinstance(model, AlexNet):
        return alexnet_aliases(model)
    if isinstance(model, SqueezeNet):
        return squeezenet_aliases(model)
    return {}


class LayerIndex:
    """Resolves user-facing layer names (aliases, module paths, ``path_k`` calls) of one model.

    Examples:
        >>> import torchvision
        >>> from featurehooks.layers import LayerIndex
        >>> index = LayerIndex(torchvision.models.alexnet(), "alexnet")
        >>> index.resolve("relu2"), index.resolve("features.4"), index.resolve("features.4_1")
        (('features.4', 0), ('features.4', 0), ('features.4', 1))
        >>> index.resolve("relu9")
        Traceback (most recent call last):
        ...
        featurehooks.errors.LayerNotFoundError: unknown layer 'relu9' for alexnet; did you mean ...
    """

    def __init__(self, model: nn.Module, label: str) -> None:
        self.label = label
        # a module instance is labelled by its class name, which list_layers cannot build: point at the model
        by_name = label != type(model).__name__
        self.listing = f"featurehooks.list_layers({label!r})" if by_name else "featurehooks.list_layers(model)"
        self.aliases = aliases_of(model)
        self.paths = [path for path, _ in model.named_modules() if path]
        self._known = set(self.paths)
        self.alias_of = {path: alias for alias, path in self.aliases.items()}

    def names(self) -> list[str]:
        """Every accepted name of a first call: aliases first, then module paths."""
        return [*self.aliases, *self.paths]

    def resolve(self, name: str) -> Site:
        """(module path, call index) for ``name``; raises LayerNotFoundError with the three closest names.

        An exact alias or module path is its first call; ``path_k`` is the (k+1)-th call of ``path``.
        """
        if name in self.aliases:
            return self.aliases[name], 0
        if name in self._known:
            return name, 0
        match = _CALL_SUFFIX.fullmatch(name)
        if match and (match[1] in self._known or match[1] in self.aliases):
            return self.aliases.get(match[1], match[1]), int(match[2])
        hint = did_you_mean(name, self.names())
        raise LayerNotFoundError(f"unknown layer {name!r} for {self.label}; {hint} See {self.listing}")

    def taps(self, layers: LayerSpec) -> Taps:
        """Validate a request (names, or ``{name: output_name}``) and resolve it into Taps."""
        if isinstance(layers, str):
            layers = [layers]
        pairs = list(layers.items()) if isinstance(layers, Mapping) else [(name, name) for name in layers]
        if not pairs:
            raise InvalidValueError(f"no layers requested; pick some from {self.listing}")
        items: list[Tap] = []
        for name, out_name in pairs:
            if not isinstance(name, str) or not isinstance(out_name, str):
                raise InvalidTypeError(f"layer names must be strings, got {name!r}")
            if any(tap.name == out_name for tap in items):
                raise InvalidValueError(f"layer {out_name!r} requested twice")
            items.append(Tap(out_name, *self.resolve(name)))
        return Taps(tuple(items))

    def check_calls(self, taps: Taps, found: Trace) -> None:
        """Refuse taps of module calls that the traced forward never makes."""
        for tap in taps:
            calls = found.calls.get(tap.path, 0)
            if tap.call < calls:
                continue
            if calls == 0:
                raise LayerNotFoundError(
                    f"layer {tap.path!r} of {self.label} never runs in a forward (traced with input "
                    f"{tuple(found.input_shape)}); pick a layer that does, see {self.listing}"
                )
            named = ", ".join(call_name(tap.path, k) for k in range(calls))
            raise LayerNotFoundError(
                f"layer {call_name(tap.path, tap.call)!r}: module {tap.path!r} of {self.label} runs {calls} "
                f"time(s) per forward, named {named}"
            )


def select_modules(
    model: nn.Module,
    layers: str | Sequence[str] | None,
    *,
    default: Callable[[nn.Module], list[str]],
    what: str,
) -> Selection:
    """The module calls a probe observes (``what`` it does, for errors), in the model's module order.

    ``layers``: module paths or aliases (a path means every call, ``path_k`` call k only), or glob
    patterns over module paths; ``None`` takes every call of ``default(model)``, a list of paths.

    Examples:
        >>> import torch
        >>> from featurehooks.layers import select_modules
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
        >>> every_leaf = lambda model: [path for path, _ in model.named_modules() if path]
        >>> select_modules(net, ["2", "0"], default=every_leaf, what="watch").paths  # in module order
        ['0', '2']
        >>> select_modules(net, None, default=every_leaf, what="watch").paths
        ['0', '1', '2']
    """
    label = type(model).__name__
    if layers is None:
        paths = default(model)
        if not paths:
            raise InvalidValueError(f"{label} has no modules to {what}; name the layers")
        return Selection.every(paths)
    if isinstance(layers, str):
        layers = [layers]
    index = LayerIndex(model, label)
    chosen: dict[str, set[int] | None] = {}
    for name in layers:
        if not isinstance(name, str):
            raise InvalidTypeError(f"layer names must be strings, got {name!r}")
        if any(c in name for c in "*?["):
            matched = [path for path in index.paths if fnmatchcase(path, name)]
            if not matched:
                hint = did_you_mean(name, index.paths)
                raise LayerNotFoundError(f"no module path of {label} matches {name!r}; {hint}")
            chosen.update(dict.fromkeys(matched))
            continue
        path, call = index.resolve(name)
        if call == 0:
            chosen[path] = None
            continue
        calls = chosen.setdefault(path, set())
        if calls is not None:  # None: every call is chosen already
            calls.add(call)
    if not chosen:
        raise InvalidValueError("no layers requested; pick some from featurehooks.list_layers(model)")
    order = {path: k for k, path in enumerate(path for path, _ in model.named_modules())}
    return Selection(
        {
            path: None if calls is None else frozenset(calls)
            for path, calls in sorted(chosen.items(), key=lambda item: order[item[0]])
        }
    )


def describe(model: nn.Module, found: Trace, label: str) -> list[FeatureInfo]:
    """FeatureInfo for every call of every submodule of ``model``, in definition order, from a trace.

    ``found`` is the shape-only trace of one forward on the meta device that ``list_layers`` makes;
    ``list_layers`` is the way to call this.

    Examples:
        >>> import torch
        >>> from featurehooks import list_layers
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU())
        >>> [(row.name, row.type, row.channels, row.stride) for row in list_layers(net, input_size=32)]
        [('0', 'Conv2d', 8, 2), ('1', 'ReLU', 8, 2)]
    """
    index = LayerIndex(model, label)
    prefix, patch = prefix_tokens_of(model), patch_size_of(model)
    rows = []
    for path, module in model.named_modules():
        if not path:
            continue
        calls = found.calls.get(path, 0)
        for call in range(max(calls, 1)):
            output = found.outputs.get((path, call))
            layout = classify(output.shape, found.input_shape, prefix, patch) if output is not None else None
            alias = index.alias_of.get(path) if call == 0 else None
            name = alias or call_name(path, call)
            kind = type(module).__name__
            attention = attention_kind(module) is not None
            if layout is None:
                rows.append(FeatureInfo(name, alias, path, kind, None, None, calls, call, attention=attention))
                continue
            rows.append(
                FeatureInfo(
                    name,
                    alias,
                    path,
                    kind,
                    layout.channels,
                    layout.stride,
                    calls,
                    call,
                    layout.kind,
                    layout.prefix_tokens,
                    attention,
                )
            )
    return rows


def list_layers(
    backbone: BackboneSpec,
    *,
    weights: WeightsSpec = "DEFAULT",
    input_size: int | None = None,
    include: Iterable[str] | None = None,
) -> list[FeatureInfo]:
    """Every tappable layer call of ``backbone`` with alias, module path, type, layout, channels and stride.

    Named backbones are built on the meta device for ``weights`` (their architecture can depend on
    it): nothing is downloaded or computed. ``input_size`` (default: the weights' crop size, else
    224) sets the spatial size used to derive strides. A module that runs several times per forward
    has one row per call. ``include`` keeps only the rows whose name or path is listed.

    Examples:
        >>> from featurehooks import list_layers
        >>> [row.name for row in list_layers("vgg16")][:4]  # containers too: "features" holds the convolutions
        ['features', 'conv1_1', 'relu1_1', 'conv1_2']
    """
    size: int | tuple[int, int]
    if isinstance(backbone, nn.Module):
        model, label, size, channels = backbone, type(backbone).__name__, input_size or 224, None
    else:
        built = build_architecture(backbone, weights)
        model, label, channels = built.model, backbone, built.in_channels
        size = input_size or built.preprocessing.crop_size or 224
    given = size if isinstance(size, tuple) else (size, size)  # a timm crop may be (H, W)
    traced_size = given if input_size is not None else fixed_input_size(model) or given
    try:
        found, _ = trace_images(model, traced_size, channels)
    except Exception as exc:  # the model's own error: a wrong input size, ops without meta kernels, ...
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise TraceError(
            f"cannot list the layers of {label}: a shape-only forward of a {traced_size[0]}x{traced_size[1]} image "
            f"on the meta device failed ({type(exc).__name__}: {first_line}); try another input_size"
        ) from exc
    rows = describe(model, found, label)
    if include is not None:
        wanted = set(include)
        rows = [row for row in rows if row.name in wanted or row.path in wanted]
    return rows
