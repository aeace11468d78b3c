"""intermediates: the outputs of chosen layers of your own live module, from one forward that stops after the deepest.

For a network being trained whose own intermediate features a loss needs (CUT's PatchNCE loss takes them from the
first layers of the generator it trains): the module runs as it is, neither copied, frozen nor switched to eval, and
its forward ends once every requested layer has run (the engine's ``StopForward``), so the layers after the deepest
one never run and never touch their buffers. The hooks (a ``TapSession``) are on the module for the one call only.

Which outputs need a clone (those the model changes in place later, before the forward stops) is read from one meta
trace, on a meta copy: no compute, no hook of the user's, the random state kept. That plan is made on the first call
and reused by the calls with the same layers, the same train/eval mode of the module and inputs of the same shapes,
dtypes and other values, so a training step pays only the hooks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ._capture import refuse_torchscript
from ._tap_session import TapSession
from ._taps import Taps
from ._trace import Trace, trace
from .errors import InvalidTypeError
from .layers import LayerIndex, LayerSpec

__all__ = ["intermediates"]

_PLANS_PER_MODULE = 8  # request and input signatures remembered per module, the oldest dropped first
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)  # arguments kept by value in a key


def intermediates(model: nn.Module, x: Any, layers: LayerSpec, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``model(x, *args, **kwargs)`` only until every requested layer has run; return their outputs.

    The module is used as it is: not copied, not frozen, its train/eval mode kept, so the outputs keep their graph
    to its parameters (under ``torch.no_grad()`` they have none) and, in train mode, the layers that run update
    their buffers (BatchNorm statistics) exactly as a forward of those layers does; the layers after the deepest
    requested one never run. The hooks are on the module during this call only, and each thread's call
    collects its own outputs.

    Args:
        model: your module (a generator or discriminator being trained, ...).
        x: its first positional argument.
        layers: module paths (``"model.4"``, ``"model.4_1"`` for the second call of a module called twice), or a
            dict ``{"module.path": "output_name"}``; as for ``capture``.
        *args: further positional arguments of ``model``.
        **kwargs: keyword arguments of ``model``.

    Returns:
        The outputs by name, in request order, as the layers returned them (an output the model changes in place
        later is a copy taken before the change).

    Raises:
        LayerNotFoundError: an unknown layer (with the closest names), or one that this forward never runs.
        LayerNotRunError: a requested layer did not run, for a model that cannot run on the meta device (then
            the whole forward ran).
        InvalidTypeError: ``model`` is not an ``nn.Module``, or it (or a module above a requested layer) is
            TorchScript, where hooks do not fire.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks import intermediates
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3)).train()
        >>> feats = intermediates(net, torch.rand(2, 3, 16, 16), {"0": "conv", "2": "act"})  # net.3 never runs
        >>> {name: tuple(f.shape) for name, f in feats.items()}, feats["act"].requires_grad
        ({'conv': (2, 8, 14, 14), 'act': (2, 8, 14, 14)}, True)
    """
    inputs = (x, *args)
    plan = _plan(model, layers, inputs, kwargs)
    session: TapSession[None] = TapSession(model, plan.taps, detach=False, stop_early=True)
    try:
        session.prepare(plan.found, clone_all_untraced=True)  # never a second real forward to find in-place changes
        return session.run(partial(model, **kwargs) if kwargs else model, *inputs)
    finally:
        session.remove()


@dataclass(frozen=True)
class _Plan:
    """A request resolved for one module and one input signature: the taps, and the meta trace that says which of
    them are changed in place before the forward stops (None: the model cannot run on meta; every tap is cloned)."""

    taps: Taps
    found: Trace | None


class _Plans:
    """The plans made so far, per module (held weakly: a plan never keeps a module alive) and per request key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_module: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, _Plan]] = weakref.WeakKeyDictionary()

    def get(self, model: nn.Module, key: Hashable) -> _Plan | None:
        with self._lock:
            plans = self._by_module.get(model)
            return plans.get(key) if plans is not None else None

    def put(self, model: nn.Module, key: Hashable, plan: _Plan) -> None:
        with self._lock:
            plans = self._by_module.setdefault(model, {})
            plans[key] = plan
            while len(plans) > _PLANS_PER_MODULE:
                del plans[next(iter(plans))]


_PLANS = _Plans()


def _plan(model: nn.Module, layers: LayerSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan:
    """The plan of this call: remembered, or made (and remembered when its key is hashable)."""
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"intermediates takes an nn.Module, not {type(model).__name__}")
    key = _key(model, layers, args, kwargs)
    plan = _PLANS.get(model, key) if key is not None else None
    if plan is None:
        plan = _make_plan(model, layers, args, kwargs)
        if key is not None:
            _PLANS.put(model, key, plan)
    return plan


def _make_plan(model: nn.Module, layers: LayerSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Plan:
    """Resolve the layers and trace the model on meta tensors shaped like the inputs (in its own train/eval mode)."""
    refuse_torchscript(model, (), "intermediates")
    index = LayerIndex(model, type(model).__name__)
    taps = index.taps(layers)
    refuse_torchscript(model, taps.paths, "intermediates")
    try:
        with torch.random.fork_rng(devices=[]):  # a forward may draw on the CPU: the real one draws the same
            found: Trace | None = trace(model, args, kwargs, watch=taps.sites)
    except Exception:  # data-dependent control flow, ops without meta kernels: the real forward says what it does
        found = None
    if found is not None:
        index.check_calls(taps, found)
    return _Plan(taps, found)


def _key(model: nn.Module, layers: LayerSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable | None:
    """What a plan depends on: the request; the module's tree (each submodule by identity, with its train/eval mode
    and in-place flag, so that a submodule replaced or switched to an in-place activation is traced again); the
    inputs' structure, shapes, dtypes and plain values. None where an input is neither a tensor nor a plain value
    (a plan is then made each call)."""
    if not kwargs and len(args) == 1 and isinstance(args[0], Tensor):  # the usual call, without flattening
        inputs: Hashable = (args[0].shape, args[0].dtype)
    else:
        leaves, spec = tree_flatten((args, kwargs))
        if not all(isinstance(leaf, (Tensor, *_PLAIN)) for leaf in leaves):
            return None
        inputs = (spec, *map(_leaf_key, leaves))
    try:
        if isinstance(layers, str):
            request: Hashable = ("names", layers)
        elif isinstance(layers, Mapping):
            request = ("renamed", tuple(layers.items()))
        else:
            request = ("names", *layers)
        tree = tuple((id(module), module.training, getattr(module, "inplace", None)) for module in model.modules())
        key = (request, tree, inputs)
        hash(key)
    except TypeError:  # a request that is no sequence of names: LayerIndex says what is wrong with it
        return None
    return key


def _leaf_key(leaf: Any) -> Hashable:
    """A tensor by shape and dtype, a plain value by type and value (``1`` and ``True`` are two keys)."""
    return (leaf.shape, leaf.dtype) if isinstance(leaf, Tensor) else (type(leaf), leaf)
