"""The forward step of the pipeline: features of one batch, pooled and cast to arrays; their shapes before any."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from .._layout import Layout, Pool, pool_positions
from ..errors import FeatureHooksError, InvalidTypeError, InvalidValueError
from .cpus import Contention, WaitMeter
from .tiling import micro_batch_size, smallest_micro_batch

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

__all__ = ["features_as_arrays", "placement", "pool_features", "row_shapes"]


def placement(model: object) -> tuple[torch.device, torch.dtype]:
    """Where ``model`` computes and in what floating dtype: those of its first floating buffer or parameter
    (for a ``FeatureExtractor``, its ``device`` and ``dtype``: its normalization buffers); CPU float32 for a
    plain function. Batches go there before the forward."""
    if isinstance(model, nn.Module):
        for tensor in (*model.buffers(), *model.parameters()):
            if tensor.is_floating_point():
                return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.float32


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


def features_as_arrays(
    extractor: FeatureExtractor,
    images: Tensor,
    pool: Pool | None,
    dtype: str,
    *,
    budget: int | None = None,
    contention: Contention | None = None,
) -> dict[str, np.ndarray]:
    """``{layer: array}`` of one batch: forward without a graph, pool, cast to ``dtype``, move to the CPU;
    with a ``budget``, on the CPU in micro-batches whose largest activation takes at most that many bytes (see
    ``tiling``; the rows are bitwise those of one forward), the rest of the batch at once after a micro-batch
    whose threads waited for other jobs' (``cpus.WaitMeter``). A ``contention`` carries that across batches: while
    the last metered forward waited, a batch runs in one forward, metered. Arrays are C-ordered whatever the memory
    format the backbone ran in.

    The extractor casts the images to its own dtype, so a ``.half()`` or ``.bfloat16()`` extractor works; the
    features of a ``precision="bf16"``/``"fp16"`` extractor are pooled in float32, then cast to ``dtype``.
    """
    batch = images.shape[0]
    size = batch if budget is None else micro_batch_size(extractor, images, budget)
    smallest, threads = smallest_micro_batch(batch), torch.get_num_threads()
    contention = Contention() if contention is None else contention
    if contention.busy:
        size = batch
    parts, start = [], 0
    while start < batch:
        end = start + size if batch - start - size >= smallest else batch  # no smaller piece left at the end
        meter = WaitMeter() if threads > 1 and (end < batch or contention.busy) else None
        parts.append(_part_as_arrays(extractor, images[start:end], pool, dtype))
        if meter is not None:
            contention.busy = meter.contended(threads)
            if contention.busy:
                size = batch  # other jobs hold the cores: the rest in one forward, with fewer regions to wait at
        start = end
    if len(parts) == 1:
        return parts[0]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _part_as_arrays(
    extractor: FeatureExtractor, images: Tensor, pool: Pool | None, dtype: str
) -> dict[str, np.ndarray]:
    with torch.no_grad():
        outputs = extractor(images)
    arrays = {}
    layouts = extractor.output_layouts if pool is not None else {}  # known after a forward, traced or not
    widen = extractor.precision != "float32"
    for name, value in outputs.items():
        if not isinstance(value, Tensor):
            raise InvalidTypeError(
                f"layer {name!r} returned a {type(value).__name__}, not a tensor; it cannot be dumped"
            )
        value = value.detach()
        if pool is not None and widen:  # a bf16/fp16 backbone's maps are pooled in float32
            value = value.to(torch.promote_types(value.dtype, torch.float32))
        pooled = pool_features(value, layouts.get(name, Layout("other")), pool, name)
        arrays[name] = np.ascontiguousarray(pooled.to(getattr(torch, dtype)).cpu().numpy())
    return arrays


def row_shapes(
    extractor: FeatureExtractor, image_shape: tuple[int, ...], pool: Pool | None
) -> dict[str, tuple[int, ...]]:
    """The shape of one row of each output (pooled with ``pool``) for images of ``image_shape`` ``(C, H, W)``.

    Read from the extractor's meta trace, so planning a dump runs no forward. Where the trace cannot
    tell (a backbone that cannot run on the meta device, an output that is not a tensor, a trace that fails
    at this size), one real forward of an image in range does, leaving the range check to the first real batch.
    """
    try:
        shapes = extractor.output_shapes((2, *image_shape))  # a batch of two, as traced at construction: reused
    except FeatureHooksError:
        raise
    except Exception:  # noqa: BLE001 - the meta device was wrong about this model: the real forward decides
        return _probed_shapes(extractor, image_shape, pool)
    layouts = extractor.output_layouts
    rows = {}
    for name, shape in shapes.items():
        if shape is None:  # not a tensor: the real forward's error names what it is
            return _probed_shapes(extractor, image_shape, pool)
        rows[name] = tuple(pool_features(torch.empty(shape, device="meta"), layouts[name], pool, name).shape[1:])
    return rows


def _probed_shapes(
    extractor: FeatureExtractor, image_shape: tuple[int, ...], pool: Pool | None
) -> dict[str, tuple[int, ...]]:
    """``row_shapes`` from one real forward of an image at the low end of ``input_range``."""
    probe = torch.full((1, *image_shape), extractor.input_range[0], device=extractor.device)
    with extractor.assume_in_range():  # in range by construction: not a sample of the real images
        arrays = features_as_arrays(extractor, probe, pool, "float32")
    return {name: tuple(array.shape[1:]) for name, array in arrays.items()}
