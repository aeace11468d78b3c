"""Precision: the dtype a frozen backbone computes in, and which devices can compute in it.

``"float32"`` (the default) runs the backbone as it is: bitwise what it gave before the option existed, and an
enclosing ``torch.autocast`` still applies. ``"bf16"`` and ``"fp16"`` store the frozen backbone's floating
parameters and buffers once in that dtype (see ``FeatureExtractor``) and hand it the normalized images in it, with
any enclosing autocast off. Normalization and the input conversion stay in float32; losses and metrics reduce the
features in float32.

Stored once rather than run under ``torch.autocast``: autocast casts frozen weights again on every call (its cast
cache keeps only weights that require grad), so stored weights measured faster, with equal values, and half the
backbone's memory (docs/performance.md#precision).

A device that cannot compute in a precision, or only more slowly than in float32, is refused with an error that
says why and what to use instead (``check_device``):

- CPU ``"fp16"``: only where oneDNN has native float16 kernels (AVX512-FP16 / AMX-FP16 CPUs); elsewhere float16
  convolutions are emulated and much slower than float32 (docs/performance.md#precision).
- CPU ``"bf16"``: where oneDNN has bfloat16 kernels and, on x86, the CPU has AVX512-BF16 or AMX-BF16 (oneDNN
  converts on other AVX512 CPUs, which is not expected to beat float32; not measured here).
- CUDA ``"bf16"``: devices with native bfloat16 (compute capability 8.0 and newer).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

from .errors import InvalidValueError

__all__ = [
    "COMPUTE_DTYPES",
    "PRECISIONS",
    "Precision",
    "applied_under",
    "autocast_off",
    "check_device",
    "check_precision",
]

Precision = Literal["float32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)  # the names, spelled once (float32 first: the default)
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
    reason = _refusal(precision, device.type, device.index)
    if reason:
        raise InvalidValueError(f"precision={precision!r} cannot run on {device}: {reason}")


@torch.compiler.assume_constant_result
def _refusal(precision: str, device_type: str, index: int | None) -> str:
    """``unsupported``, which ``torch.compile`` calls while it traces and keeps as a constant (a device's kernels do
    not change while a process runs): a compiled forward is refused as an eager one is, without a graph break."""
    return unsupported(precision, device_type, index)


@functools.cache
def unsupported(precision: str, device_type: str, index: int | None) -> str:
    """Why ``precision`` cannot run on the device, or "" when it can (asked once per device)."""
    if device_type == "cpu":
        if precision == "fp16" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            return (
                "this CPU has no native float16 kernels (AVX512-FP16 or AMX-FP16), so float16 convolutions are "
                "emulated and slower than float32; use precision='bf16' where the CPU has bfloat16 (AVX512-BF16 or "
                "AMX-BF16 on x86), or precision='float32'"
            )
        if precision == "bf16" and not _native_cpu_bf16():
            return (
                "this CPU has no native bfloat16 (AVX512-BF16 or AMX-BF16 on x86, BF16 on Arm), so bfloat16 would be "
                "emulated and slower than float32; use precision='float32'"
            )
        return ""
    if device_type == "cuda" and precision == "bf16" and torch.cuda.get_device_capability(index)[0] < 8:
        return "this GPU has no native bfloat16 (it needs compute capability 8.0 or newer); use precision='fp16'"
    return ""


def _native_cpu_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels here, and on x86 the CPU computes in bfloat16 natively (oneDNN also runs
    bfloat16 on any AVX512 CPU, by conversion: not faster than float32)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    capabilities = torch.cpu.get_capabilities()
    if capabilities.get("architecture") != "x86_64":
        return True
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Autocast disabled on ``device_type``; nothing to disable on devices autocast does not know (meta). A compiled
    forward runs on a device autocast knows, and asks nothing: torch 2.11's dynamo cannot trace the question."""
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def applied_under(precision: str, fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``fn`` (a ``Module._apply`` function: ``.to()``, ``.half()``, ...) as a module computing in ``precision``
    takes it: whole under float32; under bf16/fp16 without its change of dtype, a tensor it would convert moved
    to where ``fn`` puts it instead, from its own values (a bf16 weight never goes through float16 and back, the
    float32 normalization and a metric's float32 calibration stay float32)."""
    if precision == "float32":
        return fn

    def apply(tensor: Tensor) -> Tensor:
        applied = fn(tensor)
        return applied if applied.dtype == tensor.dtype else tensor.to(applied.device)

    return apply
