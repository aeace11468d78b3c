"""The hook session: the one place that registers, collects from, and removes forward hooks.

A session hooks the tapped modules of one model once. Every forward collects into a store of its
own, kept on a per-thread stack, so threads, ``nn.DataParallel`` replicas and nested forwards never
see each other's outputs. A tap is one call of one module (``layer1.0.relu`` and ``layer1.0.relu_1``
are two taps on one module). With ``stop_early`` the hook of the last tap to fire raises
``StopForward``, caught in ``run``, so nothing after the deepest tap runs.

Probes (``featurehooks.probes``) use the same session with an :class:`Observer` instead of a store:
every call of every hooked module is reported to the observer with its call index, and forwards are
bracketed (``start``/``end``): each call of the model itself, and each call of a hooked module made
while no forward is open (a container whose own ``forward`` never runs, such as a Lightning-style
module calling ``self.G`` and ``self.D``, or an ``nn.ModuleDict``). The tensor hooks a probe registers
on outputs for the backward pass are held by the session, so ``remove`` takes them away too.

Copies: the hooks a session puts on a model it does not own (probes, ``capture``, and the gradient
modifiers, which use :class:`InertInCopies` too) become inert in a copy of the model (``copy.deepcopy``,
pickling, ``torch.save``): a copy made while they run (an EMA or target network, a checkpoint) neither
feeds them nor carries their state. The taps of a :class:`FeatureExtractor`, whose private model is
copied together with its session, feed the copied session instead.

A KeyboardInterrupt skips the hooks that close a forward (torch runs ``always_call`` hooks only for
``Exception``); a forward left open that way is recognised by its finished opening frame and dropped
when the next call of a hooked module begins.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.hooks import RemovableHandle

from . import _trace
from ._taps import Site, Taps, call_name
from ._trace import Trace, trace, tracing
from .errors import LayerNotRunError

__all__ = ["HookSession", "InertInCopies", "Observer", "StopForward", "release_inplace"]


class StopForward(BaseException):
    """Raised by the last hook to end a forward early; never escapes the session's ``run``.

    A BaseException, like KeyboardInterrupt, so a model's own ``except Exception:`` cannot swallow it.
    """


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


def _ended(frame: FrameType | None) -> bool:
    """Whether the module call that opened a forward (``frame``) is over though its forward was never
    closed: a KeyboardInterrupt skips ``always_call`` hooks. Only a finished frame can be cleared."""
    if frame is None:
        return False
    try:
        frame.clear()
    except RuntimeError:  # still executing: the forward is open
        return False
    return True


class _Forward:
    """What one forward collected: outputs by name, calls per tapped module, and (when checking
    real forwards for in-place changes) the versions of what was stored."""

    __slots__ = ("calls", "fired", "frame", "kept", "published", "store", "versions")

    def __init__(self, check_versions: bool, frame: FrameType | None = None) -> None:
        self.frame = frame  # of the module call that opened it (None: closed by ``run``'s finally)
        self.store: dict[str, Any] = {}
        self.kept: dict[str, Any] = {}
        self.calls: dict[str, int] = {}
        self.fired = 0
        self.published = False
        self.versions: list[tuple[Site, list[tuple[torch.Tensor, int]]]] | None = [] if check_versions else None

    def changed(self) -> set[Site]:
        """Sites whose stored tensors were changed in place after they were stored."""
        return {site for site, leaves in self.versions or () if any(t._version != v for t, v in leaves)}


class _ThreadForwards(threading.local):
    """Per thread: the stack of this session's forwards in progress (innermost last).

    Set in ``__init__`` (which runs once per thread), not as a class default: torch.compile guards on
    the instance dict, and a stack first created inside a compiled frame would fail that guard.
    """

    def __init__(self) -> None:
        self.stack: list[Any] = []  # _Forward objects, or _Observed ones in a session with an observer


class _Tap:
    """The forward hook of one tapped module of a model its session owns.

    An object rather than a closure, so that ``copy.deepcopy`` and pickling of a model that holds
    a session give hooks that feed the copied session, not the original one.
    """

    def __init__(self, session: HookSession, path: str) -> None:
        self.session = session
        self.path = path

    def __call__(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self.session._collect(self.path, output)


class Observer:
    """What a probe implements to see every call of the hooked modules, instead of a store of outputs.

    A session built with ``observer=`` calls these in the thread that runs the forward:

    - ``start(args, kwargs)`` when a forward begins (a call of the model itself, or of a hooked
      module while no forward is open); its return value is that forward's ``state``, handed to the
      other calls (forwards nest and run in threads: keep per-forward data there, not on the observer);
    - ``before(state, path, call, module, args, kwargs)`` before each call of a hooked module, only
      when ``wants_inputs`` is true (it costs a second hook per module);
    - ``after(state, path, call, module, args, output)`` after each call;
    - ``end(state, output)`` when the forward returns; an exception raised here leaves the forward
      (the session still closes the forward). Not called when the forward itself raised.

    ``call`` counts the runs of ``path`` in this forward from 0, in the order they begin, as taps
    name them (``path``, ``path_1``, ...). Calls in meta traces are not reported.
    """

    wants_inputs = False

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return None

    def before(
        self, state: Any, path: str, call: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        pass

    def after(self, state: Any, path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        pass

    def end(self, state: Any, output: Any) -> None:
        pass


class _Observed:
    """One forward seen by an observer: the module call that opened it, calls per module, call indices of
    the calls in progress, the state."""

    __slots__ = ("calls", "depth", "frame", "opener", "running", "state")

    def __init__(self, state: Any, opener: str, frame: FrameType) -> None:
        self.state = state
        self.opener = opener  # path of the module whose call opened it ("" for the model itself)
        self.frame = frame
        self.depth = 0  # calls of the opener running inside its opening call (a module calling itself)
        self.calls: dict[str, int] = {}
        self.running: dict[str, list[int]] = {}  # path -> indices of its calls begun and not yet ended


class _Inert:
    """What a hook becomes in a copy of the model (``copy.deepcopy``, pickling): nothing.

    A probe watches the model it was given; a copy made while it runs (an EMA model, a checkpoint)
    must neither feed it nor copy it (with its locks and device sums).
    """

    def __call__(self, *args: Any) -> None:
        return None


class InertInCopies:
    """Base of the hooks featurehooks puts on a model it does not own: copies of the model get inert ones."""

    def __reduce__(self) -> tuple[type[_Inert], tuple[()]]:
        return (_Inert, ())


class _CopyInertTap(InertInCopies, _Tap):
    """The forward hook of one tapped module of a model the session does not own (``capture``)."""


class _ObserveBefore(InertInCopies):
    """Forward pre-hook of one observed module (or of the model itself): opens a forward if none is open."""

    def __init__(self, session: HookSession, path: str) -> None:
        self.session = session
        self.path = path

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.session._observe_before(self.path, sys._getframe(1), module, args, kwargs)


class _ObserveAfter(InertInCopies):
    """Forward hook of one observed module (or of the model itself): reports the call, ends its forward."""

    def __init__(self, session: HookSession, path: str) -> None:
        self.session = session
        self.path = path

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.session._observe_after(self.path, module, args, output)


class _ObserveClose(InertInCopies):
    """Forward hook of one observed module, also called after an exception: closes the forward it opened."""

    def __init__(self, session: HookSession, path: str) -> None:
        self.session = session
        self.path = path

    def __call__(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self.session._observe_close(self.path)


class _FollowStart(InertInCopies):
    """Forward pre-hook of a captured model: opens a forward (tracing the first one to plan clones)."""

    def __init__(self, session: HookSession, discard: Callable[[dict[str, Any]], None] | None) -> None:
        self.session = session
        self.discard = discard

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if tracing():
            return
        session = self.session
        if not session._prepared:
            session.prepare(_try_trace(module, args, kwargs, session.taps.sites), clone_all_untraced=True)
        stack = session._stack()
        while stack and _ended(stack[-1].frame):  # left open by a KeyboardInterrupt
            left = stack.pop()
            if self.discard is not None:
                self.discard(left.kept)
        stack.append(_Forward(False, sys._getframe(1)))


class _FollowFinish(InertInCopies):
    """Forward hook of a captured model: publishes the finished forward."""

    def __init__(self, session: HookSession, publish: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
        self.session = session
        self.publish = publish

    def __call__(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not tracing():
            forward = self.session._stack()[-1]
            forward.published = True
            self.publish(forward.store, forward.kept)


class _FollowPop(InertInCopies):
    """Forward hook of a captured model, also called after an exception: closes the forward."""

    def __init__(self, session: HookSession, discard: Callable[[dict[str, Any]], None] | None) -> None:
        self.session = session
        self.discard = discard

    def __call__(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not tracing():
            forward = self.session._stack().pop()
            if not forward.published and self.discard is not None:
                self.discard(forward.kept)


class HookSession:
    """Forward hooks on the modules of ``taps``; ``prepare``, then ``run`` (or ``follow``), then ``remove``.

    With ``observer``, nothing is stored: every call of every module in ``taps.paths`` goes to the
    observer, forwards are bracketed by hooks on ``model`` itself, and ``run``/``follow`` are unused.

    Args:
        model: the model whose submodules are hooked.
        taps: the validated request.
        detach: store detached outputs (no graph).
        stop_early: end the forward once every tap has fired.
        observer: report calls to this probe instead of storing outputs.
        keep: called with each tapped output as the module returned it; kept beside the store.
        owns_model: ``model`` is copied only together with this session (a FeatureExtractor's private
            copy), so copies of its taps feed the copied session; otherwise copies are inert.
    """

    def __init__(
        self,
        model: nn.Module,
        taps: Taps,
        *,
        detach: bool = True,
        stop_early: bool = False,
        observer: Observer | None = None,
        keep: Callable[[Any], Any] | None = None,
        owns_model: bool = False,
    ) -> None:
        self.taps = taps
        self._keep = keep
        self.detach = detach
        self.stop_early = stop_early
        self._model = model
        self._names = taps.names_by_site()
        self._order = taps.names
        self._clone: frozenset[Site] = frozenset()
        self._check_versions = True  # until a trace says which taps change in place
        self._prepared = False
        self._local = _ThreadForwards()
        self._handles: list[RemovableHandle] = []
        self._observer: Any = observer
        self._observed: frozenset[str] = frozenset()  # paths reported to the observer
        self._owns_model = owns_model
        self._tensor_handles: list[RemovableHandle] = []
        self._tensor_lock = threading.Lock()
        self._active = True
        try:
            if observer is None:
                tap = _Tap if owns_model else _CopyInertTap
                for path in taps.paths:
                    self._handles.append(model.get_submodule(path).register_forward_hook(tap(self, path)))
            else:
                self._observe(observer)
        except BaseException:
            self.remove()
            raise

    @property
    def active(self) -> bool:
        """Whether hooks are still registered (a plain flag: torch.compile cannot trace handles)."""
        return self._active

    def prepare(self, found: Trace | None, *, clone_all_untraced: bool = False) -> None:
        """Decide which taps are cloned: those the trace saw changed in place later in the forward.

        Without a trace, real forwards are checked instead (``run`` then repeats a forward whose
        taps were changed, cloning them from then on), or, where a forward cannot be repeated
        (``clone_all_untraced``), every tap is cloned. When the session owns the model (a private copy
        nobody else runs), in-place activations that change taps are first made out of place where that
        spares the clone (:func:`release_inplace`).
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

    def _stack(self) -> list[Any]:
        return self._local.stack

    def _collect(self, path: str, output: Any) -> None:
        """Store the output of one call of a tapped module into this thread's current forward."""
        stack = self._local.stack
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

    def run(self, model_forward: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """Call ``model_forward(*args)`` and return the collected outputs by output name, in request order.

        The raise of StopForward and its catch sit in this one frame, so ``torch.compile`` traces
        the whole call as one graph (an exception leaving a frame would make dynamo skip it).

        Raises:
            RuntimeError: a tap never fired (the model's forward skips that module call).
        """
        forward = _Forward(self._check_versions)
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

    def _raise_missing(self, forward: _Forward) -> None:
        missing = [name for name in self.taps.names if name not in forward.store]
        raise LayerNotRunError(f"requested layers never ran in the forward pass: {', '.join(missing)}")

    def follow(
        self,
        publish: Callable[[dict[str, Any], dict[str, Any]], None],
        discard: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Collect every forward of the hooked model that its caller runs (for ``capture``).

        Each completed forward hands its store, and what ``keep`` made of each output, to ``publish``;
        a forward that fails hands the latter to ``discard``. The first forward is traced on the
        meta device with its own arguments to learn which taps need a clone; a model that cannot be
        traced has every tap cloned. The model's own hooks for this are removed by ``remove``.
        """
        root = self._model
        self._handles += [
            root.register_forward_pre_hook(_FollowStart(self, discard), with_kwargs=True),
            root.register_forward_hook(_FollowFinish(self, publish)),
            root.register_forward_hook(_FollowPop(self, discard), always_call=True),  # also after an exception
        ]

    def _observe(self, observer: Observer) -> None:
        """Hook every module of ``taps.paths`` for ``observer``, and bracket forwards: each call of the model,
        and each call of a module on the way to a hooked one while no forward is open, is a forward of its own
        (so ``G.0`` and ``G.2`` run by one call of ``G`` are one forward, numbered as in a call of the model)."""
        paths = self.taps.paths
        for path in sorted({"", *paths, *(above for tapped in paths for above in _ancestors(tapped))}):
            module = self._model.get_submodule(path)
            self._handles += [
                module.register_forward_pre_hook(_ObserveBefore(self, path), with_kwargs=True),
                module.register_forward_hook(_ObserveAfter(self, path)),
                module.register_forward_hook(_ObserveClose(self, path), always_call=True),  # also after an exception
            ]
        self._observed = frozenset(self.taps.paths)

    def _observe_before(
        self, path: str, frame: FrameType, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if _trace.STATE.active:
            return
        stack = self._local.stack
        while stack and _ended(stack[-1].frame):  # left open by a KeyboardInterrupt
            stack.pop()
        if not stack or not path:  # the model itself opens a forward each call, a submodule when none is open
            self._prune_tensor_hooks()
            forward = _Observed(self._observer.start(args, kwargs), path, frame)
            stack.append(forward)
        else:
            forward = stack[-1]
            if path == forward.opener:
                forward.depth += 1
        if path in self._observed:
            call = forward.calls.get(path, 0)
            forward.calls[path] = call + 1
            forward.running.setdefault(path, []).append(call)
            if self._observer.wants_inputs:
                self._observer.before(forward.state, path, call, module, args, kwargs)

    def _observe_after(self, path: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        stack = self._local.stack
        if not stack or _trace.STATE.active:
            return
        forward: _Observed = stack[-1]
        if path in self._observed:
            running = forward.running.get(path)
            if running:  # numbered when it began (a module that calls itself ends its calls in reverse order)
                call = running.pop()
            else:  # its pre-hook never ran (a pre-hook put on before it raised)
                call = forward.calls.get(path, 0)
                forward.calls[path] = call + 1
            self._observer.after(forward.state, path, call, module, args, output)
        if path == forward.opener and not forward.depth:
            self._observer.end(forward.state, output)

    def _observe_close(self, path: str) -> None:
        stack = self._local.stack
        if not stack or _trace.STATE.active or stack[-1].opener != path:
            return
        forward: _Observed = stack[-1]
        if forward.depth:
            forward.depth -= 1
        else:
            stack.pop()

    def hold(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> None:
        """Register a backward hook on ``tensor`` that ``remove`` takes away again (for probes).

        Handles of tensors whose graph is gone are dropped when the next forward starts, so a long
        training loop does not pile them up.
        """
        handle = tensor.register_hook(hook)
        with self._tensor_lock:
            self._tensor_handles.append(handle)

    def _prune_tensor_hooks(self) -> None:
        with self._tensor_lock:
            self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]

    def remove(self) -> None:
        """Remove every hook, tensor hooks of probes included; safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with self._tensor_lock:
            for handle in self._tensor_handles:
                handle.remove()
            self._tensor_handles.clear()
        self._active = False

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_local"]  # per-thread forwards in progress belong to this process only
        del state["_tensor_lock"]
        state["_tensor_handles"] = []  # hooks on this process's tensors
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = _ThreadForwards()
        self._tensor_lock = threading.Lock()


# In-place modules whose out-of-place form gives bitwise the same values and first and second order
# gradients (measured on torch 2.14: ELU, CELU and SELU differ in gradients, Mish in fp16 second order;
# dropout, in eval, changes no values).
_SAME_OUT_OF_PLACE = frozenset(
    {nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Threshold, nn.RReLU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid}
)


def _ancestors(path: str) -> Iterable[str]:
    """The paths of the modules that contain ``path``: ``"a.b.c"`` -> ``"a"``, ``"a.b"``."""
    parts = path.split(".")
    return (".".join(parts[:k]) for k in range(1, len(parts)))


def _switches(model: nn.Module, by: frozenset[str | None]) -> set[str]:
    """The modules to switch out of place so that nothing changes a site changed ``by`` these: all of them, or
    none where something else changes it too (a ``+=``, a functional op, a module not in ``_SAME_OUT_OF_PLACE``)."""
    paths = {path for path in by if path is not None}
    modules = [model.get_submodule(path) for path in paths]
    if len(paths) < len(by) or not all(type(m) in _SAME_OUT_OF_PLACE and m.inplace is True for m in modules):
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
    modules = [model.get_submodule(path) for path in sorted(paths)]
    for module in modules:
        module.inplace = False
    again = found.again(model, watch=sites, check_reads=paths)
    if not again.reread:
        return again
    for module in modules:
        module.inplace = True
    return found


def _try_trace(root: nn.Module, args: Iterable[Any], kwargs: dict[str, Any], sites: list[Site]) -> Trace | None:
    try:
        return trace(root, tuple(args), kwargs, watch=sites)
    except Exception:  # data-dependent Python control flow, ops without meta kernels, ...
        return None
