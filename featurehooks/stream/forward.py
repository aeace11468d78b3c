"""The forward step of a dump: features of one batch, pooled and cast for the ``.npy`` files."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from .._layout import Layout, Pool, classify, pool_positions
from ..errors import InvalidTypeError, InvalidValueError
from .tiling import micro_batch_size

__all__ = ["device_of", "features_as_arrays", "pool_features"]


def pool_features(feature: Tensor, layout: Layout, pool: Pool | None, name: str) -> Tensor:
    """``feature`` unchanged, or pooled to ``(B, C)`` over its positions (never its prefix tokens) with
    ``"avg"``/``"max"``, or its class token with ``"cls"``; the layout says which axes those are."""
    if pool is None:
        return feature
    if pool != "cls" and name.endswith(".prefix") and layout.kind == "NLC" and layout.stride is None:
        raise InvalidValueError(
            f"{name!r} holds prefix tokens only, no positions to pool over; dump it with pool=None or pool='cls', "
            "or build the extractor without return_prefix_tokens"
        )
    return pool_positions(feature, layout, pool, name)


def _layouts(extractor: Any, outputs: dict[str, Any], images: Tensor) -> dict[str, Layout]:
    """The extractor's own layouts, or (for any other callable) layouts read from the output shapes."""
    layouts = getattr(extractor, "output_layouts", None)
    if isinstance(layouts, dict):
        return layouts
    shape = tuple(images.shape)
    return {
        name: classify(tuple(value.shape) if isinstance(value, Tensor) else None, shape, None)
        for name, value in outputs.items()
    }


def device_of(extractor: torch.nn.Module) -> torch.device:
    """The device the extractor computes on (of its buffers, else of the backbone's parameters)."""
    for tensor in extractor.buffers():
        return tensor.device
    backbone = getattr(extractor, "backbone", extractor)
    for tensor in backbone.parameters():
        return tensor.device
    return torch.device("cpu")


def features_as_arrays(
    extractor: Any, images: Tensor, pool: Pool | None, dtype: str, *, micro_batches: bool = False
) -> dict[str, np.ndarray]:
    """``{layer: array}`` of one batch: forward without a graph, pool, cast to ``dtype``, move to the CPU;
    with ``micro_batches``, on the CPU in micro-batches sized to the cache (see ``tiling``). Arrays are
    C-ordered whatever the memory format the backbone ran in.

    The extractor casts the images to its own dtype, so a ``.half()`` or ``.bfloat16()`` extractor works.
    """
    size = micro_batch_size(extractor, images) if micro_batches else images.shape[0]
    parts = [_part_as_arrays(extractor, part, pool, dtype) for part in images.split(max(size, 1))]
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _part_as_arrays(extractor: Any, images: Tensor, pool: Pool | None, dtype: str) -> dict[str, np.ndarray]:
    with torch.no_grad():
        outputs = extractor(images)
    arrays = {}
    layouts = _layouts(extractor, outputs, images) if pool is not None else {}
    for name, value in outputs.items():
        if not isinstance(value, Tensor):
            raise InvalidTypeError(
                f"layer {name!r} returned a {type(value).__name__}, not a tensor; it cannot be dumped"
            )
        pooled = pool_features(value.detach(), layouts.get(name, Layout("other")), pool, name)
        arrays[name] = np.ascontiguousarray(pooled.to(getattr(torch, dtype)).cpu().numpy())
    return arrays
