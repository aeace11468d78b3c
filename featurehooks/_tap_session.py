"""The taps of an extractor or of ``capture``: ``TapSession`` stores what the requested module calls output.

A tap is one call of one module (``layer1.0.relu`` and ``layer1.0.relu_1`` are two taps on one module).
``FeatureExtractor`` calls ``run``, where with ``stop_early`` the hook of the last tap to fire raises
``StopForward``, caught in ``run``, so nothing after the deepest tap runs; ``capture`` calls ``follow``, which
brackets every forward of the model its caller runs (``HookSession``).

A tap that the model changes in place later in the forward (an in-place ReLU, ``out += identity``) is stored as a
clone; on a private copy (``owns_model``), in-place activations that change a tap are made out of place instead
where that gives bitwise the same values and gradients (``release_inplace``), which spares the clone; and its
large CPU max pools run ATen's channels-last kernel on a channels-last copy of their input, their output made NCHW
again: a max is exact, so the bytes are those of the NCHW kernel, only sooner (``pool_channels_last``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from . import _trace
from ._hooks import Bracket, HookSession, SessionHook, StopForward
from ._taps import Site, Taps, call_name
from ._trace import Trace, trace
from .errors import LayerNotRunError

__all__ = ["TapSession", "pool_channels_last", "release_inplace"]

# dtypes whose channels-last max pool is bytewise the NCHW kernel's, NaNs and signed zeros included (bfloat16 is
# not: its NaNs come back with another bit pattern)
_EXACT_POOL_DTYPES = (torch.float32, torch.float16, torch.float64)
# below these, the copies in and out cost more than the channels-last kernel saves (benchmarks/max_pool.py)
POOL_MIN_CHANNELS = 8
POOL_MIN_ELEMENTS = 1 << 16

K = TypeVar("K")  # what a tap session keeps of each tapped output (capture's gradient slots)


class _Collect(SessionHook["TapSession[Any]"]):
    """Forward hook of a tapped module: stores its output into the current forward."""

    def __call__(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        self.session._collect(self.path, output)


def _detached(output: Any) -> Any:
    return tree_map_only(torch.Tensor, torch.Tensor.detach, output)


def _own_containers(output: Any) -> Any:
    """A copy of the lists, tuples and dicts around the tensors, which a model may refill later."""
    return tree_map_only(torch.Tensor, lambda t: t, output)


def _cloned(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.clone()
    return tree_map_only(torch.Tensor, torch.Tensor.clone, output)


def _versions(output: Any) -> list[tuple[torch.Tensor, int]]:
    """Every tensor leaf with its version (inference tensors have none and cannot change later)."""
    return [(t, t._version) for t in tree_leaves(output) if isinstance(t, torch.Tensor) and not t.is_inference()]


class _Forward(Bracket, Generic[K]):
    """What one forward of a tap session collected: outputs by name, what ``keep`` made of them, calls per
    tapped module, and (when checking real forwards for in-place changes) the versions of what was stored."""

    __slots__ = ("calls", "fired", "kept", "published", "store", "versions")

    def __init__(self, check_versions: bool, frame: FrameType | None = None) -> None:
        super().__init__("", frame)
        self.store: dict[str, Any] = {}
        self.kept: dict[str, K] = {}
        self.calls: dict[str, int] = {}
        self.fired = 0
        self.published = False
        self.versions: list[tuple[Site, list[tuple[torch.Tensor, int]]]] | None = [] if check_versions else None

    def changed(self) -> set[Site]:
        """Sites whose stored tensors were changed in place after they were stored."""
        return {site for site, leaves in self.versions or () if any(t._version != v for t, v in leaves)}


class TapSession(HookSession[_Forward[K]], Generic[K]):
    """Forward hooks on the modules of ``taps``; ``prepare``, then ``run`` (or ``follow``), then ``remove``.

    Args:
        model: the model whose submodules are hooked.
        taps: the validated request.
        detach: store detached outputs (no graph).
        stop_early: end the forward once every tap has fired (``run``).
        keep: called with each tapped output as the module returned it; kept beside the store.
        owns_model: see ``HookSession``.
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Taps,
        *,
        detach: bool = True,
        stop_early: bool = False,
        keep: Callable[[Any], K] | None = None,
        owns_model: bool = False,
    ) -> None:
        super().__init__(model, owns_model=owns_model)
        self.taps = taps
        self._keep = keep
        self.detach = detach
        self.stop_early = stop_early
        self._names = taps.names_by_site()
        self._order = taps.names
        self._clone: frozenset[Site] = frozenset()
        self._check_versions = True  # until a trace says which taps change in place
        self._prepared = False
        self._publish: Callable[[dict[str, Any], dict[str, K]], None] | None = None
        self._discard: Callable[[dict[str, K]], None] | None = None
        try:
            for path in taps.paths:
                self.adopt(model.get_submodule(path).register_forward_hook(_Collect(self, path)))
            if owns_model:  # a forward of the instance, not a hook: small pools pay no hook dispatch
                for module in model.modules():
                    if type(module) is nn.MaxPool2d and not module.return_indices:
                        vars(module)["forward"] = _ChannelsLastPool(module)
        except BaseException:
            self.remove()
            raise

    def prepare(self, found: Trace | None, *, clone_all_untraced: bool = False) -> None:
        """Decide which taps are cloned: those the trace saw changed in place later in the forward.

        Without a trace, real forwards are checked instead (``run`` then repeats a forward whose
        taps were changed, cloning them from then on), or, where a forward cannot be repeated
        (``clone_all_untraced``), every tap is cloned. When the session owns the model (a private copy
        nobody else runs), in-place activations that change taps are first made out of place where that
        spares the clone (``release_inplace()``).
        """
        sites = self.taps.sites
        if found is not None:
            if self._owns_model:
                found = release_inplace(self._model, found, sites, self.stop_early)
            self._clone, self._check_versions = found.changed_in_place(sites, self.stop_early), False
        elif clone_all_untraced:
            self._clone, self._check_versions = frozenset(sites), False
        else:
            self._check_versions = True
        self._prepared = True

    def _collect(self, path: str, output: Any) -> None:
        """Store the output of one call of a tapped module into this thread's current forward."""
        stack = self._stack()
        if not stack or _trace.STATE.active:  # outside a forward of this session, or in a meta trace
            return
        forward = stack[-1]
        calls = forward.calls
        call = calls.get(path, 0)
        calls[path] = call + 1
        site = (path, call)
        names = self._names.get(site)
        if names is None:
            return
        if self._keep is not None:  # sees the output as the module returned it, before any clone
            kept = self._keep(output)
            for name in names:
                forward.kept[name] = kept
        if isinstance(output, torch.Tensor):
            output = output.detach() if self.detach else output
        else:
            output = _detached(output) if self.detach else _own_containers(output)
        if site in self._clone:
            output = _cloned(output)
        elif forward.versions is not None:
            forward.versions.append((site, _versions(output)))
        for name in names:
            forward.store[name] = output
        forward.fired += 1
        if forward.fired == len(self._names) and self.stop_early:
            raise StopForward

    def run(self, model_forward: Callable[..., object], *args: Any) -> dict[str, Any]:
        """Call ``model_forward(*args)`` and return the collected outputs by output name, in request order.

        The raise of StopForward and its catch sit in this one frame, so ``torch.compile`` traces
        the whole call as one graph (an exception leaving a frame would make dynamo skip it).

        Raises:
            LayerNotRunError: a tap never fired (the model's forward skips that module call).
        """
        forward: _Forward[K] = _Forward(self._check_versions)
        stack = self._stack()
        stack.append(forward)
        try:
            try:
                model_forward(*args)
            except StopForward:
                pass
        finally:
            stack.pop()
        if forward.fired < len(self._names):
            self._raise_missing(forward)
        changed = forward.changed() if forward.versions is not None else set()
        if changed:  # untraced model: clone these from now on, and repeat this forward
            names = ", ".join(sorted(call_name(*site) for site in changed))
            warnings.warn(
                f"outputs of {names} are changed in place later in the forward "
                "(an in-place activation or +=); they are cloned from now on",
                stacklevel=3,
            )
            self._clone = self._clone | changed
            return self.run(model_forward, *args)
        store = forward.store
        return {name: store[name] for name in self._order}

    def _raise_missing(self, forward: _Forward[K]) -> None:
        missing = [name for name in self.taps.names if name not in forward.store]
        raise LayerNotRunError(f"requested layers never ran in the forward pass: {', '.join(missing)}")

    def follow(
        self,
        publish: Callable[[dict[str, Any], dict[str, K]], None],
        discard: Callable[[dict[str, K]], None] | None = None,
    ) -> None:
        """Collect every forward of the hooked model that its caller runs (for ``capture``).

        Each completed forward hands its store, and what ``keep`` made of each output, to ``publish``;
        a forward that fails (or that a KeyboardInterrupt left open) hands the latter to ``discard``. The first
        forward is traced on the meta device with its own arguments to learn which taps need a clone; a model
        that cannot be traced has every tap cloned. The model's own hooks for this are removed by ``remove``.
        """
        self._publish, self._discard = publish, discard
        self._bracket([""])

    def _begin(
        self, path: str, frame: FrameType, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Forward[K]:
        if not self._prepared:
            self.prepare(_try_trace(module, args, kwargs, self.taps.sites), clone_all_untraced=True)
        return _Forward(False, frame)

    def _finished(self, forward: _Forward[K], output: Any) -> None:
        forward.published = True
        if self._publish is not None:
            self._publish(forward.store, forward.kept)

    def _closed(self, forward: _Forward[K]) -> None:
        if not forward.published:  # it raised: dropped as one left open is
            self._left_open(forward)

    def _left_open(self, forward: _Forward[K]) -> None:
        if self._discard is not None:  # nobody will read what was kept of it
            self._discard(forward.kept)


# In-place modules whose out-of-place form gives bitwise the same values and first and second order
# gradients (measured on torch 2.14: ELU, CELU and SELU differ in gradients, Mish in fp16 second order;
# dropout, in eval, changes no values).
_SAME_OUT_OF_PLACE = frozenset(
    {nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Threshold, nn.RReLU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid}
)


class _InPlace(Protocol):
    """A module of ``_SAME_OUT_OF_PLACE``: it has an ``inplace`` flag."""

    inplace: bool


def _switches(model: nn.Module, by: frozenset[str | None]) -> set[str]:
    """The modules to switch out of place so that nothing changes a site changed ``by`` these: all of them, or
    none where something else changes it too (a ``+=``, a functional op, a module not in ``_SAME_OUT_OF_PLACE``)."""
    paths = {path for path in by if path is not None}
    modules = [model.get_submodule(path) for path in paths]
    if len(paths) < len(by) or not all(
        type(m) in _SAME_OUT_OF_PLACE and cast(_InPlace, m).inplace is True for m in modules
    ):
        return set()
    return paths


def release_inplace(model: nn.Module, found: Trace, sites: list[Site], stop_early: bool) -> Trace:
    """Switch out of place the in-place activations of ``model`` that change ``sites``, where that leaves a
    site unchanged, so its tap needs no clone (one memory pass less); returns the trace of ``model`` as it
    now runs. Only for a private copy: every call of a switched module changes.

    A site changed by anything else too (``out += identity``) keeps its clone and switches nothing. The
    switched model is traced again: the taps it still changes are cloned, and if the model reads a switched
    module's input after the call (code relying on the in-place side effect), everything is switched back.
    """
    changed = found.changed_by(sites, stop_early)
    paths = set().union(*(_switches(model, by) for by in changed.values()))
    if not paths:
        return found
    modules = [cast(_InPlace, model.get_submodule(path)) for path in sorted(paths)]
    for module in modules:
        module.inplace = False
    again = found.again(model, watch=sites, check_reads=paths)
    if not again.reread:
        return again
    for module in modules:
        module.inplace = True
    return found


class _ChannelsLastPool:
    """A private copy's max pool forward: a large NCHW input on the CPU through ATen's channels-last kernel
    (``pool_channels_last``; the NCHW kernel also computes the indices nobody asked for, one element at a time), its
    output made NCHW again, as the next layer and the taps expect; anything else, and under ``torch.compile`` (which
    picks its own kernels), as ``nn.MaxPool2d`` does. An object, not a bound function: copies and pickles keep it."""

    def __init__(self, pool: nn.MaxPool2d) -> None:
        self.pool = pool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        channels_last = pool_channels_last(x) and not torch.compiler.is_compiling()
        pooled: torch.Tensor = F.max_pool2d(
            x.contiguous(memory_format=torch.channels_last) if channels_last else x,
            pool.kernel_size,
            pool.stride,
            pool.padding,
            pool.dilation,
            ceil_mode=pool.ceil_mode,
        )
        return pooled.contiguous() if channels_last else pooled


def pool_channels_last(x: Any) -> bool:
    """Whether a max pool of ``x`` runs channels-last: an NCHW float32/float16/float64 batch on the CPU, outside a
    graph, of at least ``POOL_MIN_CHANNELS`` channels and ``POOL_MIN_ELEMENTS`` values; there its bytes are those of
    the NCHW kernel, and it is faster, the copies in and out included (``benchmarks/max_pool.py``)."""
    return (
        isinstance(x, torch.Tensor)
        and x.numel() >= POOL_MIN_ELEMENTS  # first: most small inputs stop here
        and x.device.type == "cpu"
        and x.dim() == 4
        and x.shape[1] >= POOL_MIN_CHANNELS
        and x.dtype in _EXACT_POOL_DTYPES
        and not (x.requires_grad and torch.is_grad_enabled())
        and x.is_contiguous()
        and not x.is_contiguous(memory_format=torch.channels_last)
    )


def _try_trace(root: nn.Module, args: Iterable[Any], kwargs: dict[str, Any], sites: list[Site]) -> Trace | None:
    try:
        return trace(root, tuple(args), kwargs, watch=sites)
    except Exception:  # data-dependent Python control flow, ops without meta kernels, ...
        return None
