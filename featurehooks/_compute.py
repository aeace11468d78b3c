"""The compute policy of a frozen backbone: the precision it computes in and the memory format it runs in.

``ComputePolicy`` is one small object that ``FeatureExtractor`` holds (and through it the losses and metrics): the
precision (``_precision``: stored once, the device checked at each forward, any enclosing autocast off), the
memory format (``_formats``: forced, or chosen per forward under ``"auto"`` from the convolution work the meta
trace counted) and the fallback of ``"auto"`` to NCHW when a channels-last forward fails. ``KeepsPrecision`` is
the one definition of the rule that ``.to()``/``.half()``/... only move the tensors of a module computing in
bf16/fp16, never recast them: the extractor, LPIPS and DISTS inherit it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn

from ._formats import TORCH_FORMATS, ConvWork, MemoryFormat, auto_format, check_memory_format, in_format
from ._precision import COMPUTE_DTYPES, Precision, applied_under, autocast_off, check_device, check_precision
from .errors import FeatureHooksError

__all__ = ["ComputePolicy", "KeepsPrecision"]

R = TypeVar("R")


class ComputePolicy:
    """What a frozen backbone computes in (``precision``) and how its activations lie in memory (``memory_format``).

    ``conv_work`` is the evidence ``"auto"`` decides by (the convolution work of what the forward runs, from the
    meta trace; None: not counted, or no evidence that channels-last runs), ``fell_back`` whether a channels-last
    forward under ``"auto"`` raised, so that NCHW is used from then on.
    """

    def __init__(self, memory_format: MemoryFormat, precision: Precision) -> None:
        check_memory_format(memory_format)
        check_precision(precision)
        self.memory_format: MemoryFormat = memory_format
        self.precision: Precision = precision
        self.conv_work: ConvWork | None = None
        self.fell_back = False

    def counts_conv(self, graph: bool) -> bool:
        """Whether the meta trace should count the convolution work: ``"auto"`` uses channels-last only without a
        graph (or in bf16/fp16), so only such a policy needs it."""
        return self.memory_format == "auto" and (not graph or self.precision != "float32")

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
        if (graph and self.precision == "float32") or self.fell_back:
            return "contiguous"
        return auto_format(self.conv_work, device_type, shape)

    def run(self, forward: Callable[[Tensor], R], x: Tensor, chosen: str) -> tuple[R, str]:
        """``forward`` of ``x`` (normalized images) in the precision and the ``chosen`` format, and the format it ran
        in. Under bf16/fp16, ``x`` is cast to the precision's dtype (its gradient comes back in its own), on a device
        that can compute in it, with any enclosing autocast off: the precision says what runs."""
        if self.precision == "float32":
            return self._run(forward, x, chosen)
        check_device(self.precision, x.device)
        with autocast_off(x.device.type):
            return self._run(forward, x.to(COMPUTE_DTYPES[self.precision]), chosen)

    def _run(self, forward: Callable[[Tensor], R], x: Tensor, chosen: str) -> tuple[R, str]:
        """``forward`` with the images in the ``chosen`` format (the weights are in it already: NCHW under
        ``"auto"``), and the format it ran in.

        Under ``"auto"``, a channels-last forward that fails (a ``.view`` that needs NCHW strides, which no
        meta check sees for every op) runs again in NCHW; when that succeeds, the policy stays NCHW from
        then on: a default never crashes a model that runs in NCHW. Out-of-memory and featurehooks' own
        errors are raised as they are.
        """
        converted = in_format(x, chosen)
        if chosen != "channels_last" or self.memory_format != "auto":
            return forward(converted), chosen
        try:
            return forward(converted), chosen
        except (torch.cuda.OutOfMemoryError, FeatureHooksError):
            raise
        except RuntimeError:
            del converted
            result = forward(in_format(x, "contiguous"))
            self.fell_back = True
            return result, "contiguous"


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
