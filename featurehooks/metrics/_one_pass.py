"""One pass over a set of images for several backbones: each image decoded once, embedded by each backbone.

A metric's vectors are one layer of one backbone, made vectors by a pool (``"avg"``, ``"cls"``) or by a rule of
its own (sFID's first channels of a spatial map): a ``Vectors``. ``one_pass`` streams a set through every
backbone that a list of such vectors needs, at each image's own size: each backbone prepares the image as its
single-metric function would (its own resize, from the same ``uint8`` pixels), runs once, and gives every
``Vectors`` of it; a ``FeatureStatistics`` of each comes out, with the origin its own function records.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .._layout import as_pool
from .._stream import GeneratedImages, SourceSpec, Streaming, StreamOptions
from .._stream.forward import pool_features
from .._stream.sources import first_tensor
from ..images import ImageTransform, transform_for
from .collect import PassSettings, _origins, collect
from .statistics import FeatureStatistics

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["Vectors", "one_pass"]


@dataclass(frozen=True)
class Vectors:
    """The vectors of ``layer`` of a backbone: pooled by ``pool`` (``None``: the layer gives vectors), or made by
    ``rule`` (then ``pool`` names the rule in the statistics' origin: they compare only with vectors made by it)."""

    layer: str
    pool: str | None
    rule: Callable[[Tensor], Tensor] | None = None


class _Embedding(nn.Module):
    """One backbone of the pass: prepares each image as its single-metric function does, embeds it once, and hands
    each of its ``Vectors`` to a child module of that name (where the pass's hooks take them)."""

    def __init__(self, extractor: FeatureExtractor, vectors: Mapping[str, Vectors], from_uint8: bool) -> None:
        super().__init__()
        self.extractor, self.vectors, self.from_uint8 = extractor, dict(vectors), from_uint8
        self.transform: ImageTransform = transform_for(extractor.preprocessing, extractor.input_range)
        self.outputs = nn.ModuleDict({name: nn.Identity() for name in vectors})

    def forward(self, images: Tensor) -> None:
        pixels = images.detach().cpu()
        if self.from_uint8:  # the pipeline's u / 255, back to the uint8 pixels its single-metric function resizes
            pixels = pixels.mul(255).round_().to(torch.uint8)
        prepared = torch.stack([self.transform(image) for image in pixels]).to(self.extractor.device)
        found = self.extractor(prepared)
        layouts = self.extractor.output_layouts
        for name, want in self.vectors.items():
            value = found[want.layer]
            if want.rule is not None:
                self.outputs[name](want.rule(value))
            else:
                self.outputs[name](pool_features(value, layouts[want.layer], as_pool(want.pool), want.layer))


class _Backbones(nn.Module):
    """The backbones of one pass as one module: a batch in, each backbone's vectors to its children."""

    def __init__(self, members: Mapping[str, _Embedding]) -> None:
        super().__init__()
        self.members = nn.ModuleDict(members)

    def forward(self, images: Tensor) -> None:
        for member in self.members.values():
            member(images)


def _pixels_are_uint8(source: SourceSpec) -> bool:
    """Whether the pipeline makes ``source``'s images from ``uint8`` pixels (files, ``uint8`` tensors and datasets)."""
    if isinstance(source, Tensor):
        return source.dtype == torch.uint8
    if isinstance(source, GeneratedImages):
        return source.first_batch().dtype == torch.uint8
    if isinstance(source, torch.utils.data.Dataset):
        try:
            return first_tensor(source[0]).dtype == torch.uint8
        except Exception:  # noqa: BLE001 - an unreadable first item: the pipeline reports it as an invalid row
            return False
    return True


def one_pass(
    source: SourceSpec,
    backbones: Mapping[str, tuple[FeatureExtractor, Mapping[str, Vectors]]],
    keep: int,
    kept: Collection[str],
    options: StreamOptions,
) -> dict[str, FeatureStatistics]:
    """``{name: FeatureStatistics}`` of every ``Vectors`` of ``backbones`` (``{backbone: (extractor, {name:
    Vectors})}``, names unique across backbones) over ``source``, in one pass; ``keep`` vectors of those in ``kept``."""
    from ..extractor import FeatureExtractor

    uint8 = _pixels_are_uint8(source)
    members = {name: _Embedding(ext, vectors, uint8) for name, (ext, vectors) in backbones.items()}
    paths = {name: f"members.{member}.outputs.{name}" for member, (_, vectors) in backbones.items() for name in vectors}
    passing = FeatureExtractor(_Backbones(members), list(paths.values()), mode="detach")
    native: StreamOptions = {**options, "resize_size": None, "crop_size": None}  # each backbone resizes its own
    settings = PassSettings("avg", keep, 0, Streaming.of(native), frozenset(paths[name] for name in kept))
    found = collect(passing, source, list(paths.values()), settings)
    stats = {}
    for member in members.values():
        for name, want in member.vectors.items():
            one = found[paths[name]]
            one.origin = _origins(member.extractor, [want.layer], want.pool, member.transform)[want.layer]
            stats[name] = one
    return stats
