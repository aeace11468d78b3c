"""Layer names: readable aliases, module paths, and per-layer metadata known before any real forward."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

import torch
from torch import nn
from torchvision.models import VGG

from ._hooks import preserved_attributes
from .backbones import BackboneSpec, build_architecture
from .errors import LayerNotFoundError, did_you_mean

__all__ = ["FeatureInfo", "LayerIndex", "list_layers", "vgg_aliases"]


@dataclass(frozen=True)
class FeatureInfo:
    """One tappable layer: its preferred ``name`` (the alias if any), module ``path`` and output facts.

    ``channels`` and ``stride`` come from a shape-only forward on the meta device (no compute, no
    download); they are ``None`` for outputs that are not feature maps. ``calls`` counts how often the
    module runs in one forward: a module that runs twice cannot be tapped by FeatureExtractor.
    """

    name: str
    alias: str | None
    path: str
    type: str
    channels: int | None
    stride: int | None
    calls: int


def vgg_aliases(model: nn.Module) -> dict[str, str]:
    """``convB_I``/``bnB_I``/``reluB_I``/``poolB`` aliases of a torchvision VGG, mapped to module paths.

    Derived from ``model.features``, so every depth (11/13/16/19, with or without BN) gets them.
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


def aliases_of(model: nn.Module) -> dict[str, str]:
    """Readable aliases known for this architecture (alias -> module path); empty when none."""
    return vgg_aliases(model) if isinstance(model, VGG) else {}


class LayerIndex:
    """Resolves user-facing layer names (aliases or module paths) of one model to module paths."""

    def __init__(self, model: nn.Module, label: str) -> None:
        self.label = label
        self.aliases = aliases_of(model)
        self.paths = [path for path, _ in model.named_modules() if path]
        self._known = set(self.paths)
        self.alias_of = {path: alias for alias, path in self.aliases.items()}

    def names(self) -> list[str]:
        """Every accepted name: aliases first, then module paths."""
        return [*self.aliases, *self.paths]

    def resolve(self, name: str) -> str:
        """Module path for ``name``; raises LayerNotFoundError with the three closest names."""
        if name in self.aliases:
            return self.aliases[name]
        if name in self._known:
            return name
        hint = did_you_mean(name, self.names())
        raise LayerNotFoundError(
            f"unknown layer {name!r} for {self.label}; {hint} See featurehooks.list_layers({self.label!r})"
        )


def _meta_shapes(
    model: nn.Module, input_shape: tuple[int, ...]
) -> tuple[dict[str, tuple[int, ...] | None], dict[str, int]]:
    """Output shape and call count of every module, from one forward on the meta device."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    calls: dict[str, int] = {}
    handles = []

    def record(path: str):
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            calls[path] = calls.get(path, 0) + 1
            shapes.setdefault(path, tuple(output.shape) if isinstance(output, torch.Tensor) else None)

        return hook

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_hook(record(path)))
    state = {
        name: torch.empty_like(tensor, device="meta")
        for name, tensor in chain(model.named_parameters(), model.named_buffers())  # non-persistent buffers too
    }
    try:
        with preserved_attributes(model), torch.no_grad():  # the caller's train/eval flags come back too
            model.eval()  # as FeatureExtractor runs it: a train-mode BatchNorm rejects a 1x1 map at batch 1
            torch.func.functional_call(model, state, (torch.empty(input_shape, device="meta"),), strict=False)
    finally:
        for handle in handles:
            handle.remove()
    return shapes, calls


def _channels_and_stride(shape: tuple[int, ...] | None, input_size: int) -> tuple[int | None, int | None]:
    if shape is None or len(shape) < 2:
        return None, None
    if len(shape) == 3:  # tokens: (batch, tokens, channels)
        return shape[-1], None
    channels = shape[1]
    stride = input_size // shape[-1] if len(shape) == 4 and shape[-1] else None
    return channels, stride


def describe(model: nn.Module, input_shape: tuple[int, ...], label: str) -> list[FeatureInfo]:
    """FeatureInfo for every submodule of ``model``, in definition order."""
    shapes, calls = _meta_shapes(model, input_shape)
    index = LayerIndex(model, label)
    rows = []
    for path, module in model.named_modules():
        if not path:
            continue
        channels, stride = _channels_and_stride(shapes.get(path), input_shape[-1])
        alias = index.alias_of.get(path)
        rows.append(
            FeatureInfo(alias or path, alias, path, type(module).__name__, channels, stride, calls.get(path, 0))
        )
    return rows


def list_layers(
    backbone: BackboneSpec, *, input_size: int | None = None, include: Iterable[str] | None = None
) -> list[FeatureInfo]:
    """Every tappable layer of ``backbone`` with alias, module path, type, channels and stride.

    Named backbones are built on the meta device: nothing is downloaded or computed. ``input_size``
    (default: the weights' crop size, else 224) sets the spatial size used to derive strides.
    ``include`` keeps only the rows whose name or path is listed.

    Example:
        >>> [row.name for row in list_layers("vgg16")][:3]
        ['conv1_1', 'relu1_1', 'conv1_2']
    """
    if isinstance(backbone, nn.Module):
        model, label, size = backbone, type(backbone).__name__, input_size or 224
        channels = next((m.in_channels for m in model.modules() if isinstance(m, nn.Conv2d)), 3)
    else:
        with torch.device("meta"):
            model, preprocessing = build_architecture(backbone)
        label, size, channels = backbone, input_size or preprocessing.crop_size or 224, 3
    rows = describe(model, (1, channels, size, size), label)
    if include is not None:
        wanted = set(include)
        rows = [row for row in rows if row.name in wanted or row.path in wanted]
    return rows
