"""Architectures without weights: parameters on the meta device as they are registered, buffers real.

``with torch.device("meta")`` would put every tensor an ``__init__`` creates on the meta device, which breaks
models that compute their layout from tensors (RegNet's widths come from ``torch.arange(...).tolist()``) and
leaves non-persistent buffers (Swin's ``relative_position_index``) without values that no checkpoint restores.
Moving only the parameters keeps both; the random init of a meta parameter is skipped, having nothing to write.

Some ``__init__`` code computes on the parameters' device, so on the meta device: Swin V2 and mixed-RoPE tables
built with ``device=weight.device`` and copied into real buffers, a hybrid ViT's probe forward of a CPU image
through its meta backbone. An op that fails because it mixes meta and real tensors runs again on the meta
device, its real tensors moved there (a real buffer it writes into becomes meta too, left without values like
the parameters), so the build finishes with the shapes it needs. Ops that succeed are never changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from ..errors import WeightsUnavailableError
from ._files import check_kinds, load_fitting

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
# Names of in-place ops without a trailing underscore: their first argument is written.
_IN_PLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"})


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``nn.Module.register_parameter``, then a move to the meta device when this thread asked for it."""
    _original(module, name, param)
    if getattr(_local, "depth", 0) and type(param) is nn.Parameter and not param.is_meta:
        module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


class _BuildOnMeta(TorchFunctionMode):
    """Skip ``torch.nn.init`` functions and value-only in-place ops on meta tensors, and run an op that fails on
    a mix of meta and real tensors again on the meta device (modes are per thread)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init dispatches with tensor= as a keyword
        if isinstance(target, torch.Tensor) and target.is_meta and _writes_values_only(func):
            return target
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:  # "Cannot copy out of meta tensor", "not on ... cpu"
            if not _mixes_meta_and_real((args, kwargs)):
                raise
            return _again_on_meta(func, target, args, kwargs, error)


def _writes_values_only(func: Callable[..., object]) -> bool:
    """Whether ``func`` is a ``torch.nn.init`` function or a value-only in-place op."""
    return getattr(func, "__module__", None) == "torch.nn.init" or getattr(func, "__name__", "") in _VALUE_ONLY_OPS


def _mixes_meta_and_real(tree: object) -> bool:
    """Whether the tensors in ``tree`` are some on the meta device and some not."""
    devices = {leaf.is_meta for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)}
    return len(devices) == 2


def _writes_first_argument(func: Callable[..., object]) -> bool:
    """Whether ``func`` is an in-place op: ``copy_``, ``masked_fill_``, ``t[i] = v``, ``t += v``."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDERS


def _again_on_meta(
    func: Callable[..., object], target: object, args: tuple[object, ...], kwargs: dict[str, object], error: Exception
) -> object:
    """``func`` on meta copies of the real tensors it was given; a real tensor it writes into becomes a meta tensor
    in place (same object, so the module that holds it holds the meta one). Raises ``error`` when that cannot be."""
    if isinstance(target, torch.Tensor) and not target.is_meta and _writes_first_argument(func):
        try:
            torch.utils.swap_tensors(target, torch.empty_like(target, device="meta"))
        except RuntimeError:  # a view, or a tensor something else holds a weak reference to
            raise error from None
        if _writes_values_only(func):
            return target
    meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t if t.is_meta else t.to("meta"), (args, kwargs))
    return func(*meta_args, **meta_kwargs)


def _install() -> None:
    """Replace ``nn.Module.register_parameter`` while any thread is inside ``meta_parameters()``."""
    global _original, _users
    with _install_lock:
        if _users == 0:
            _original = nn.Module.register_parameter
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign,assignment]
        _users += 1


def _uninstall() -> None:
    """Put the original ``nn.Module.register_parameter`` back once the last thread has left."""
    global _users
    with _install_lock:
        _users -= 1
        if _users == 0:
            nn.Module.register_parameter = _original  # type: ignore[method-assign,assignment]


@contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built in this block, by this thread only, get their parameters on the meta device, uninitialized.

    Other threads building models at the same time are not affected; the patched method is restored in
    ``finally`` when the last user leaves. Load real tensors afterwards with ``load_state_dict(assign=True)``.
    """
    _install()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with _BuildOnMeta():
            yield
    finally:
        _local.depth -= 1
        _uninstall()


def meta_tensor_names(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``model`` that are still on the meta device."""
    named = chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    return [name for name, tensor in named if tensor.is_meta]


def adopt_state(model: nn.Module, state: dict[str, torch.Tensor], source: str, what: str) -> nn.Module:
    """Load ``state`` into ``model`` built under ``meta_parameters()``, adopting its tensors in the architecture's
    dtypes; ``what`` names the model in the error raised when tensors are left without values."""
    check_kinds(model, state, source)  # before the cast below, which would turn integers into floats
    # assign=True adopts the file's tensors as they are: keep the architecture's dtypes (a half-precision file
    # would otherwise make a half-precision model), as a copying load_state_dict does
    dtypes = {key: value.dtype for key, value in model.state_dict().items()}
    state = {key: value.to(dtypes.get(key, value.dtype)) for key, value in state.items()}
    load_fitting(model, state, source, assign=True)
    left = meta_tensor_names(model)
    if left:
        raise WeightsUnavailableError(
            f"the weights in {source} leave {len(left)} tensors of {what} without values: {', '.join(left[:5])}"
        )
    return model
