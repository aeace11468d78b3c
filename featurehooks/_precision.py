"""Precision: the dtype a frozen backbone computes in, and which devices can compute in it.

``"float32"`` (the default) runs the backbone as it is: bitwise what it gave before the option existed, and an
enclosing ``torch.autocast`` still applies. ``"bf16"`` and ``"fp16"`` store the frozen backbone's floating
parameters and buffers once in that dtype (see ``FeatureExtractor``) and hand it the normalized images in it.
Normalization and the input conversion stay in float32; losses and metrics reduce the features in float32.

A device that cannot compute in a precision, or only more slowly than in float32, is refused with an error that
says why and what to use instead (``check_device``):

- CPU ``"fp16"``: only where oneDNN has native float16 kernels (AVX512-FP16 / AMX-FP16 CPUs); elsewhere float16
  convolutions are emulated and slower than float32 (measured on this project's AVX512-BF16 EPYC: see
  ``docs/performance.md``).
- CPU ``"bf16"``: where oneDNN has bfloat16 kernels (AVX512 CPUs, Arm with BF16).
- CUDA ``"bf16"``: devices with native bfloat16 (compute capability 8.0 and newer).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal

import torch

from .errors import InvalidValueError

__all__ = ["COMPUTE_DTYPES", "PRECISIONS", "Precision", "autocast_off", "check_device", "check_precision"]

Precision = Literal["float32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("float32", "bf16", "fp16")
COMPUTE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: object) -> None:
    """Refuse anything but ``"float32"``, ``"bf16"`` or ``"fp16"`` (torch dtypes are not taken: one spelling)."""
    if precision not in PRECISIONS:
        hint = " (pass its name: 'bf16', 'fp16' or 'float32')" if isinstance(precision, torch.dtype) else ""
        raise InvalidValueError(f"precision must be 'float32', 'bf16' or 'fp16', not {precision!r}{hint}")


def check_device(precision: str, device: torch.device) -> None:
    """Raise ``InvalidValueError`` if ``device`` cannot run ``precision`` (or runs it slower than float32)."""
    if precision == "float32":
        return
    reason = _unsupported(precision, device.type, device.index)
    if reason:
        raise InvalidValueError(f"precision={precision!r} cannot run on {device}: {reason}")


@functools.cache
def _unsupported(precision: str, device_type: str, index: int | None) -> str:
    """Why ``precision`` cannot run on the device, or "" when it can (asked once per device)."""
    if device_type == "cpu":
        if precision == "fp16" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return (
                "this CPU has no native float16 kernels (AVX512-FP16 or AMX-FP16), so float16 convolutions are "
                "emulated and slower than float32; use precision='bf16' where the CPU has bfloat16 (AVX512), "
                "or 'float32'"
            )
        if precision == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "this CPU has no bfloat16 kernels (oneDNN needs AVX512 or Arm BF16); use precision='float32'"
        return ""
    if device_type == "cuda" and precision == "bf16" and torch.cuda.get_device_capability(index)[0] < 8:
        return "this GPU has no native bfloat16 (it needs compute capability 8.0 or newer); use precision='fp16'"
    return ""


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Autocast disabled on ``device_type``; nothing to disable on devices autocast does not know (meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()
