"""What a loaded backbone carries besides its weights: its name, provenance, preprocessing and input channels."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Preprocessing:
    """How images must be prepared for a backbone, as its weights define it.

    ``mean`` and ``std`` apply to images scaled to [0, 1]; ``None`` means no normalization.
    ``resize_size`` and ``crop_size`` are the shorter-side resize and center crop used by dumps.
    """

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize_size: int | None = None
    crop_size: int | None = None
    interpolation: str = "bilinear"


@dataclass
class Backbone:
    """A model ready to be wrapped, with the facts a manifest or a repr needs about it.

    ``in_channels`` is the input's channel count from the model's own metadata (a stem's first conv may take
    more, e.g. after a space-to-depth); None for a user's module, which has no such metadata.
    """

    model: nn.Module
    name: str
    weights: str | None
    preprocessing: Preprocessing
    in_channels: int | None = None
