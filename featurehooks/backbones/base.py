"""What a loaded backbone carries besides its weights: its name, provenance and preprocessing."""

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
    """A model ready to be wrapped, with the facts a manifest or a repr needs about it."""

    model: nn.Module
    name: str
    weights: str | None
    preprocessing: Preprocessing
