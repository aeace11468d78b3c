"""Architectures without weights: parameters on the meta device as they are registered, buffers real.

``with torch.device("meta")`` would put every tensor an ``__init__`` creates on the meta device, which breaks
models that compute their layout from tensors (RegNet's widths come from ``torch.arange(...).tolist()``) and
leaves non-persistent buffers (Swin's ``relative_position_index``) without values that no checkpoint restores.
Moving only the parameters keeps both; the random init of a meta parameter is skipped, having nothing to write.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_local = threading.local()  # .depth: how many meta_parameters() blocks the current thread is inside
_install_lock = threading.Lock()
# The method we replace; kept after restoring, for a thread that looked the patched one up just before.
_original: Callable[[nn.Module, str, nn.Parameter | None], None] = nn.Module.register_parameter
_users = 0  # meta_parameters() blocks open, across all threads
# In-place tensor ops that only write values. On a meta parameter there is nothing to write, and running them
# anyway costs half of a build: torch traces the meta ``normal_`` through its Python reference kernels.
_VALUE_ONLY_OPS = frozenset(
    {
        "normal_",
        "uniform_",
        "bernoulli_",
        "cauchy_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "random_",
        "erfinv_",
        "fill_",
        "zero_",
        "copy_",
        "add_",
        "sub_",
        "mul_",
        "div_",
        "clamp_",
    }
)


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``nn.Module.register_parameter``, then a move to the meta device when this thread asked for it."""
    _original(module, name, param)
    if getattr(_local, "depth", 0) and type(param) is nn.Parameter and not param.is_meta:
        module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


class _SkipInitOnMeta(TorchFunctionMode):
    """Skip ``torch.nn.init`` functions and value-only in-place ops on meta tensors (modes are per thread)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init dispatches with tensor= as a keyword
        if isinstance(target, torch.Tensor) and target.is_meta and _writes_values_only(func):
            return target
        return func(*args, **kwargs)


def _writes_values_only(func: Callable[..., object]) -> bool:
    """Whether ``func`` is a ``torch.nn.init`` function or a value-only in-place op."""
    return getattr(func, "__module__", None) == "torch.nn.init" or getattr(func, "__name__", "") in _VALUE_ONLY_OPS


def _install() -> None:
    """Replace ``nn.Module.register_parameter`` while any thread is inside ``meta_parameters()``."""
    global _original, _users
    with _install_lock:
        if _users == 0:
            _original = nn.Module.register_parameter
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]
        _users += 1


def _uninstall() -> None:
    """Put the original ``nn.Module.register_parameter`` back once the last thread has left."""
    global _users
    with _install_lock:
        _users -= 1
        if _users == 0:
            nn.Module.register_parameter = _original  # type: ignore[method-assign]


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built in this block, by this thread only, get their parameters on the meta device, uninitialized.

    Other threads building models at the same time are not affected; the patched method is restored in
    ``finally`` when the last user leaves. Load real tensors afterwards with ``load_state_dict(assign=True)``.
    """
    _install()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _SkipInitOnMeta():
            yield
    finally:
        _local.depth -= 1
        _uninstall()


def meta_tensor_names(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` that are still on the meta device."""
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return [name for name, tensor in named if tensor.is_meta]
