"""The compute policy of a frozen backbone: the precision it computes in and the memory format it runs in.

``ComputePolicy`` is one small object that ``FeatureExtractor`` holds (and through it the losses and metrics): the
precision (``_precision``: stored once, the device checked at each forward, any enclosing autocast off) and the
memory format (``_formats``: forced, or chosen per forward under ``"auto"`` from the convolution work the meta
trace counted, where a channels-last meta forward ran). ``KeepsPrecision`` is the one definition of the rule that
``.to()``/``.half()``/... only move the tensors of a module computing in bf16/fp16, never recast them: the
extractor, LPIPS and DISTS inherit it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

from ._formats import (
    CONV_SHARE,
    TORCH_FORMATS,
    ConvWork,
    MemoryFormat,
    auto_format,
    check_memory_format,
    in_format,
)
from ._precision import COMPUTE_DTYPES, Precision, applied_under, autocast_off, check_device, check_precision
from ._taps import Site
from ._trace import Trace

__all__ = ["ComputePolicy", "KeepsPrecision"]

R = TypeVar("R")


class ComputePolicy:
    """What a frozen backbone computes in (``precision``) and how its activations lie in memory (``memory_format``).

    ``conv_work`` is the evidence ``"auto"`` decides by (the convolution work of what the forward runs, from the
    meta trace; None: not counted, or no evidence that channels-last runs). A forward runs once, in the format
    chosen before it: whatever it raises is the model's, passed on as it is.
    """

    def __init__(self, memory_format: MemoryFormat, precision: Precision) -> None:
        check_memory_format(memory_format)
        check_precision(precision)
        self.memory_format: MemoryFormat = memory_format
        self.precision: Precision = precision
        self.conv_work: ConvWork | None = None

    def counts_conv(self, graph: bool) -> bool:
        """Whether the meta trace should count the convolution work: ``"auto"`` uses channels-last only without a
        graph (or in bf16/fp16), so only such a policy needs it."""
        return self.memory_format == "auto" and (not graph or self.precision != "float32")

    def weigh(self, found: Trace | None, stop: Site | None, model: nn.Module) -> None:
        """Take ``conv_work`` from the construction's trace: the work up to the call ``stop`` (None: the whole
        forward). Where it says channels-last could pay, ``model`` must also run channels-last on the meta device
        up to ``stop`` (``Trace.runs_channels_last``); a model that fails there is never run in it. Checked here,
        eagerly, rather than at the first forward: a compiled forward cannot run a meta forward inside its graph."""
        self.conv_work = found.conv_work.get(stop) if found is not None else None
        pays = found is not None and self.conv_work is not None and self.conv_work.share >= CONV_SHARE
        if pays and not found.runs_channels_last(model, stop):  # type: ignore[union-attr]  # found is set if pays
            self.conv_work = None

    @property
    def weights_format(self) -> str:
        """The format of the backbone's weights: the forced one, NCHW under ``"auto"`` (which converts images only)."""
        return "contiguous" if self.memory_format == "auto" else self.memory_format

    def settle_format(self, model: nn.Module) -> None:
        """Convert ``model``'s weights to ``weights_format``: at construction and after every ``.to()``/``.half()``,
        which could change it."""
        model.to(memory_format=TORCH_FORMATS[self.weights_format])

    def settle_precision(self, model: nn.Module) -> None:
        """Store ``model``'s floating parameters and buffers in the precision's dtype, once (``.to()``/``.half()``/
        ``.float()`` later leave it: ``KeepsPrecision``). Nothing for float32."""
        if self.precision != "float32":
            model.to(COMPUTE_DTYPES[self.precision])

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the backbone computes in: the precision's for bf16/fp16, else ``dtype`` (that of the images)."""
        return COMPUTE_DTYPES[self.precision] if self.precision != "float32" else dtype

    def format_for(self, shape: tuple[int, ...], *, graph: bool, device_type: str) -> str:
        """``"channels_last"`` or ``"contiguous"``: the format a forward of images of ``shape`` runs in (see
        ``FeatureExtractor.memory_format_for``)."""
        if self.memory_format != "auto":
            return self.memory_format
        if graph and self.precision == "float32":
            return "contiguous"
        return auto_format(self.conv_work, device_type, shape)

    def run(self, forward: Callable[[Tensor], R], x: Tensor, chosen: str) -> R:
        """``forward`` of ``x`` (normalized images) in the precision and the ``chosen`` format, once. Under bf16/fp16,
        ``x`` is cast to the precision's dtype (its gradient comes back in its own), on a device that can compute in
        it, with any enclosing autocast off: the precision says what runs."""
        if self.precision == "float32":
            return forward(in_format(x, chosen))
        check_device(self.precision, x.device)
        with autocast_off(x.device.type):
            return forward(in_format(x.to(COMPUTE_DTYPES[self.precision]), chosen))


class KeepsPrecision(nn.Module):
    """A module computing in a precision: under ``"bf16"``/``"fp16"``, ``.to()``, ``.half()``, ``.cuda()``, ... only
    move its tensors (``applied_under``), never recast them: a bf16 weight never goes through float16 and back, a
    float32 normalization or calibration stays float32. The one home of that rule: ``FeatureExtractor``,
    ``LPIPS`` and ``DISTS`` inherit it and say which precision applies (``_kept_precision``)."""

    def _kept_precision(self) -> str:
        """The precision whose rule ``.to()`` and friends follow (``"float32"``: all of their changes apply)."""
        raise NotImplementedError

    def _apply_outside(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` (already under the rule) to tensors held outside the module tree: none by default."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> KeepsPrecision:
        fn = applied_under(self._kept_precision(), fn)
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        if recurse:
            self._apply_outside(fn)
        return self
