"""The forward step of a dump: features of one batch, pooled and cast for the ``.npy`` files."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import InvalidTypeError

__all__ = ["device_of", "features_as_arrays", "pool_features"]


def pool_features(feature: Tensor, pool: str | None) -> Tensor:
    """Average or max over the spatial axes of ``(B, C, ...)`` maps or the token axis of ``(B, T, C)``."""
    if pool is None or feature.dim() <= 2:
        return feature
    dims = (1,) if feature.dim() == 3 else tuple(range(2, feature.dim()))  # tokens (B, T, C) or maps (B, C, ...)
    return feature.mean(dim=dims) if pool == "avg" else feature.amax(dim=dims)


def device_of(extractor: torch.nn.Module) -> torch.device:
    """The device the extractor computes on (of its buffers, else of the backbone's parameters)."""
    for tensor in extractor.buffers():
        return tensor.device
    backbone = getattr(extractor, "backbone", extractor)
    for tensor in backbone.parameters():
        return tensor.device
    return torch.device("cpu")


def features_as_arrays(extractor: Any, images: Tensor, pool: str | None, dtype: str) -> dict[str, np.ndarray]:
    """``{layer: array}`` of one batch: forward without a graph, pool, cast to ``dtype``, move to the CPU.

    The extractor casts the images to its own dtype, so a ``.half()`` or ``.bfloat16()`` extractor works.
    """
    with torch.no_grad():
        outputs = extractor(images)
    arrays = {}
    for name, value in outputs.items():
        if not isinstance(value, Tensor):
            raise InvalidTypeError(
                f"layer {name!r} returned a {type(value).__name__}, not a tensor; it cannot be dumped"
            )
        arrays[name] = pool_features(value.detach(), pool).to(getattr(torch, dtype)).cpu().numpy()
    return arrays
