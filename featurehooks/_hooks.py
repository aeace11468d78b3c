"""The hook engine: every hook featurehooks puts on a model that a user runs is registered and removed here.

- ``Hooks`` owns the handles of one owner's hooks, module and tensor hooks alike, and removes them all at
  once (``remove``, safe twice). Gradient modifiers (``probes.modifiers``) hold their hooks in one.
- ``HookSession``, a ``Hooks`` over one model, keeps the forwards in progress on a per-thread stack, so
  threads, ``nn.DataParallel`` replicas and nested forwards never see each other's, and brackets forwards
  with hooks on chosen modules: a pre-hook opens one (each call of the model itself, and each call of a
  bracketed submodule while none is open), a forward hook finishes it, and one that also runs after an
  exception closes it. A KeyboardInterrupt skips the hooks that close a forward (torch runs ``always_call``
  hooks only for ``Exception``); a forward left open that way is recognised by its finished opening frame
  and dropped when the next one opens.
- ``TapSession`` stores what the requested taps output. A tap is one call of one module
  (``layer1.0.relu`` and ``layer1.0.relu_1`` are two taps on one module). ``FeatureExtractor`` calls
  ``run``, where with ``stop_early`` the hook of the last tap to fire raises ``StopForward``, caught in
  ``run``, so nothing after the deepest tap runs; ``capture`` calls ``follow``, which brackets every
  forward of the model its caller runs.
- ``ObserverSession`` reports every call of the modules a probe selected (``watch``,
  ``detect_nonfinite``) to an ``Observer``, bracketing each call of the model and each top-level call
  of a submodule (a container whose own ``forward`` never runs, such as a Lightning-style module calling
  ``self.G`` and ``self.D``, or an ``nn.ModuleDict``). The tensor hooks a probe puts on outputs for the
  backward pass are held by the session, so ``remove`` takes them away too.

Copies: the hooks of a session on a model it does not own (probes, ``capture``), and those of gradient
modifiers (``InertInCopies``), become inert in a copy of the model (``copy.deepcopy``, pickling,
``torch.save``): a copy made while they run (an EMA or target network, a checkpoint) neither feeds them nor
carries their state. The taps of a ``FeatureExtractor``, whose private model is copied together with its
session, feed the copied session instead.

Two kinds of hook live elsewhere, on purpose: the meta trace (``_trace``) hooks its own throwaway meta copy of
a model, and ``capture(..., grads=True)`` puts tensor hooks on captured outputs that live as long as the graph
of their forward, so that a backward after the block still fills them (``_capture._GradSlots`` removes the
ones on leaf tensors itself).
"""

from __future__ import annotations

import sys
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.hooks import RemovableHandle

from . import _trace
from ._taps import Selection, Site, Taps, call_name
from ._trace import Trace, trace
from .errors import LayerNotRunError

__all__ = [
    "ClosedOnExit",
    "HookSession",
    "Hooks",
    "InertInCopies",
    "Observer",
    "ObserverSession",
    "StopForward",
    "TapSession",
    "release_inplace",
    "runs_as_defined",
]

K = TypeVar("K")  # what a tap session keeps of each tapped output (capture's gradient slots)
T = TypeVar("T")  # an observer's state of one forward
F = TypeVar("F", bound="_Bracket")  # a session's record of one forward in progress
S = TypeVar("S", bound="HookSession[Any]")


class StopForward(BaseException):
    """Raised by the last hook to end a forward early; never escapes the session's ``run``.

    A BaseException, like KeyboardInterrupt, so a model's own ``except Exception:`` cannot swallow it.
    """


class _Inert:
    """What a hook becomes in a copy of the model (``copy.deepcopy``, pickling): nothing.

    A probe watches the model it was given; a copy made while it runs (an EMA model, a checkpoint)
    must neither feed it nor copy it (with its locks and device sums).
    """

    def __call__(self, *args: object) -> None:
        return None


class ClosedOnExit(ABC):
    """A hook owner as a context manager: ``with`` gives the owner itself and closes it on the way out."""

    @abstractmethod
    def close(self) -> None:
        """Remove the owner's hooks; safe to call twice."""

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_Owner = TypeVar("_Owner", bound=ClosedOnExit)


class InertInCopies:
    """Base of the hooks featurehooks puts on a model it does not own: copies of the model get inert ones."""

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return (_Inert, ())


class Hooks:
    """The handles of one owner's hooks: registered by the owner, held here, removed together by ``remove``.

    Tensor hooks (``hold``) are pruned once their graph is gone (``prune``), so a long training loop does not
    pile up their handles.
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._tensor_lock = threading.Lock()
        self._active = True

    @property
    def active(self) -> bool:
        """Whether the hooks are still registered (a plain flag: torch.compile cannot trace handles)."""
        return self._active

    def adopt(self, handle: RemovableHandle) -> None:
        """Hold the handle of a module hook just registered: ``remove`` takes it away."""
        self._handles.append(handle)

    def hold(self, tensor: torch.Tensor, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """Register a backward hook on ``tensor`` that ``remove`` takes away again."""
        self._hold(tensor.register_hook(hook))  # type: ignore[no-untyped-call]  # untyped in torch's stubs

    def hold_node(
        self, node: torch.autograd.graph.Node, hook: Callable[[tuple[torch.Tensor | None, ...]], None]
    ) -> None:
        """Register a pre-hook on an autograd node (it sees the gradients with respect to the node's outputs, whatever
        became of the tensors since) that ``remove`` takes away again."""
        self._hold(node.register_prehook(hook))

    def hold_node_post(
        self,
        node: torch.autograd.graph.Node,
        hook: Callable[[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]], None],
    ) -> bool:
        """Register a post-hook on an autograd node (it sees the gradients the node made, with respect to its inputs,
        and the ones it took, with respect to its outputs) that ``remove`` takes away again; whether it runs first
        (post-hooks run in the order registered: one registered before may have changed what the node made)."""
        handle = node.register_hook(hook)
        self._hold(handle)
        hooks = handle.hooks_dict_ref()
        return hooks is not None and next(iter(hooks)) == handle.id

    def _hold(self, handle: RemovableHandle) -> None:
        with self._tensor_lock:
            self._tensor_handles.append(handle)

    def prune(self) -> None:
        """Drop the handles of tensor hooks whose tensor (and graph) is gone."""
        with self._tensor_lock:
            self._tensor_handles = [h for h in self._tensor_handles if h.hooks_dict_ref() is not None]

    def remove(self) -> None:
        """Remove every hook, module and tensor hooks alike; safe to call twice."""
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        with self._tensor_lock:
            for handle in self._tensor_handles:
                handle.remove()
            self._tensor_handles.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_tensor_lock"]
        state["_tensor_handles"] = []  # hooks on this process's tensors
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tensor_lock = threading.Lock()


class _Bracket:
    """One forward in progress: the module call that opened it and its frame (None: opened by ``TapSession.run``)."""

    __slots__ = ("depth", "frame", "opener")

    def __init__(self, opener: str, frame: FrameType | None) -> None:
        self.opener = opener  # path of the module whose call opened it ("" for the model itself)
        self.frame = frame
        self.depth = 0  # calls of the opener running inside its opening call (a module calling itself)


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


class _ThreadForwards(threading.local, Generic[F]):
    """Per thread: the stack of a session's forwards in progress (innermost last).

    Set in ``__init__`` (which runs once per thread), not as a class default: torch.compile guards on
    the instance dict, and a stack first created inside a compiled frame would fail that guard.
    """

    def __init__(self) -> None:
        self.stack: list[F] = []


class HookSession(Hooks, ABC, Generic[F]):
    """Hooks on one model with a per-thread stack of forwards in progress, bracketed by hooks (``_bracket``).

    Subclasses say what a forward is (``_begin``) and what happens as it runs: ``_entered``/``_returned``
    around each call of a bracketed module, ``_finished`` when the forward returns, ``_closed`` when it is
    taken off the stack (also after an exception), ``_left_open`` for one a KeyboardInterrupt left open.
    Calls made by a meta trace are not seen.

    Args:
        model: the model whose modules are hooked.
        owns_model: ``model`` is copied only together with this session (a FeatureExtractor's private
            copy), so copies of its hooks feed the copied session; otherwise copies are inert.
    """

    def __init__(self, model: nn.Module, *, owns_model: bool) -> None:
        super().__init__()
        self._model = model
        self._owns_model = owns_model
        self._local: _ThreadForwards[F] = _ThreadForwards()

    @property
    def owns_model(self) -> bool:
        """Whether the model is this session's own (copies of its hooks feed copies of the session)."""
        return self._owns_model

    def _stack(self) -> list[F]:
        return self._local.stack

    def _bracket(self, paths: Iterable[str]) -> None:
        """Bracket the calls of the modules at ``paths`` (``""``: the model itself)."""
        for path in paths:
            module = self._model.get_submodule(path)
            self.adopt(module.register_forward_pre_hook(_Open(self, path), with_kwargs=True))
            self.adopt(module.register_forward_hook(_Finish(self, path)))
            self.adopt(module.register_forward_hook(_Close(self, path), always_call=True))  # also after an exception

    def _open(
        self, path: str, frame: FrameType, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A bracketed module is called: the model itself opens a forward each call, a submodule when none is open."""
        if _trace.STATE.active:
            return
        stack = self._local.stack
        while stack and _ended(stack[-1].frame):  # left open by a KeyboardInterrupt
            self._left_open(stack.pop())
        if not stack or not path:
            forward = self._begin(path, frame, module, args, kwargs)
            stack.append(forward)
        else:
            forward = stack[-1]
            if path == forward.opener:
                forward.depth += 1
        self._entered(forward, path, module, args, kwargs)

    def _finish(self, path: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """A bracketed module returned; when it opened the forward, the forward is finished."""
        stack = self._local.stack
        if not stack or _trace.STATE.active:
            return
        forward = stack[-1]
        self._returned(forward, path, module, args, output)
        if path == forward.opener and not forward.depth:
            self._finished(forward, output)

    def _close(self, path: str) -> None:
        """A bracketed module's call is over, returned or raised: the forward it opened leaves the stack."""
        stack = self._local.stack
        if not stack or _trace.STATE.active or stack[-1].opener != path:
            return
        forward = stack[-1]
        if forward.depth:
            forward.depth -= 1
        else:
            stack.pop()
            self._closed(forward)

    @abstractmethod
    def _begin(
        self, path: str, frame: FrameType, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> F:
        """A new forward, opened by this call of the module at ``path``."""

    def _entered(self, forward: F, path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A bracketed module is about to run inside ``forward``."""

    def _returned(self, forward: F, path: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """A bracketed module returned ``output`` inside ``forward``."""

    def _finished(self, forward: F, output: Any) -> None:
        """``forward`` returned ``output`` (not called when it raised)."""

    def _closed(self, forward: F) -> None:
        """``forward`` left the stack, returned or raised."""

    def _left_open(self, forward: F) -> None:
        """``forward`` was left open by a KeyboardInterrupt and is dropped."""

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_local"]  # per-thread forwards in progress belong to this process only
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._local = _ThreadForwards()


class _Hook(InertInCopies, Generic[S]):
    """A hook of ``session`` on the module at ``path``: an object rather than a closure, so that a copy of a model
    the session owns (``copy.deepcopy``, pickling) gets hooks that feed the copied session; on any other model,
    copies are inert."""

    def __init__(self, session: S, path: str) -> None:
        self.session = session
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        if self.session.owns_model:
            return (type(self), (self.session, self.path))
        return super().__reduce__()


class _Open(_Hook["HookSession[Any]"]):
    """Forward pre-hook of a bracketed module: opens a forward if none is open (or this is the model itself)."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.session._open(self.path, sys._getframe(1), module, args, kwargs)


class _Finish(_Hook["HookSession[Any]"]):
    """Forward hook of a bracketed module: reports the call, finishes the forward it opened."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.session._finish(self.path, module, args, output)


class _Close(_Hook["HookSession[Any]"]):
    """Forward hook of a bracketed module, also called after an exception: closes the forward it opened."""

    def __call__(self, _module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        self.session._close(self.path)


class _Collect(_Hook["TapSession[Any]"]):
    """Forward hook of a tapped module: stores its output into the current forward."""

    def __call__(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        self.session._collect(self.path, output)


_OWN_HOOKS = (_Hook, _Inert)  # featurehooks' forward hooks and pre-hooks: each returns None, changing nothing


def runs_as_defined(module: nn.Module) -> bool:
    """Whether ``module`` returns what its class computes from the input its forward pre-hooks saw: no ``forward``
    set on the instance, no forward hook or pre-hook but featurehooks' own, and no global forward hook (another hook
    may scale, clamp or replace the input or the output)."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return (
        "forward" not in module.__dict__
        and not torch.nn.modules.module._global_forward_hooks
        and all(isinstance(hook, _OWN_HOOKS) for hook in hooks)
    )


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


class _Forward(_Bracket, Generic[K]):
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


class Observer(ABC, Generic[T]):
    """What a probe implements to see every selected call of the modules it observes (``ObserverSession``).

    The session calls these in the thread that runs the forward:

    - ``start(args, kwargs)`` when a forward begins (a call of the model itself, or of an observed
      module while no forward is open); its return value is that forward's ``state``, handed to the
      other calls (forwards nest and run in threads: keep per-forward data there, not on the observer);
    - ``before(state, path, call, module, args, kwargs)`` before each selected call, only when
      ``wants_inputs`` is true;
    - ``after(state, path, call, module, args, output)`` after each selected call;
    - ``end(state, output)`` when the forward returns; an exception raised here leaves the forward
      (the session still closes the forward). Not called when the forward itself raised;
    - ``leave(state)`` when the forward is taken off the stack, returned or raised (after ``end``), before any
      backward of it can run.

    ``call`` counts the runs of ``path`` in this forward from 0, in the order they begin, as taps
    name them (``path``, ``path_1``, ...). Calls in meta traces are not reported.
    """

    wants_inputs = False

    @abstractmethod
    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        """The state of a forward that begins with these arguments."""

    def before(
        self, state: T, path: str, call: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A selected call is about to run (only with ``wants_inputs``)."""

    def after(self, state: T, path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """A selected call returned ``output``."""

    def end(self, state: T, output: Any) -> None:
        """The forward returned ``output``."""

    def leave(self, state: T) -> None:
        """The forward is over, returned or raised."""


class _Observed(_Bracket, Generic[T]):
    """One forward seen by an observer: its state, calls per observed module, and the call indices of the calls
    in progress."""

    __slots__ = ("calls", "running", "state")

    def __init__(self, state: T, opener: str, frame: FrameType) -> None:
        super().__init__(opener, frame)
        self.state = state
        self.calls: dict[str, int] = {}
        self.running: dict[str, list[int]] = {}  # path -> indices of its calls begun and not yet ended


class ObserverSession(HookSession[_Observed[T]], Generic[T]):
    """Reports the ``selection``'s calls of ``model`` to ``observer``; nothing is stored (for probes).

    Forwards are bracketed on the model itself, the selected modules and every module on the way to one,
    so a call of a module on the way while no forward is open is a forward of its own (``G.0`` and ``G.2``
    run by one call of ``G`` are one forward, numbered as in a call of the model).
    """

    def __init__(self, model: nn.Module, selection: Selection, observer: Observer[T]) -> None:
        super().__init__(model, owns_model=False)
        self._selection = selection
        self._observer = observer
        paths = selection.paths
        try:
            self._bracket(sorted({"", *paths, *(above for path in paths for above in _ancestors(path))}))
        except BaseException:
            self.remove()
            raise

    def _begin(
        self, path: str, frame: FrameType, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Observed[T]:
        self.prune()
        return _Observed(self._observer.start(args, kwargs), path, frame)

    def _entered(
        self, forward: _Observed[T], path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if path not in self._selection.calls:
            return
        call = forward.calls.get(path, 0)
        forward.calls[path] = call + 1
        forward.running.setdefault(path, []).append(call)
        if self._observer.wants_inputs and self._selection.wants(path, call):
            self._observer.before(forward.state, path, call, module, args, kwargs)

    def _returned(
        self, forward: _Observed[T], path: str, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        if path not in self._selection.calls:
            return
        running = forward.running.get(path)
        if running:  # numbered when it began (a module that calls itself ends its calls in reverse order)
            call = running.pop()
        else:  # its pre-hook never ran (a pre-hook put on before it raised)
            call = forward.calls.get(path, 0)
            forward.calls[path] = call + 1
        if self._selection.wants(path, call):
            self._observer.after(forward.state, path, call, module, args, output)

    def _finished(self, forward: _Observed[T], output: Any) -> None:
        self._observer.end(forward.state, output)

    def _closed(self, forward: _Observed[T]) -> None:
        self._observer.leave(forward.state)


# In-place modules whose out-of-place form gives bitwise the same values and first and second order
# gradients (measured on torch 2.14: ELU, CELU and SELU differ in gradients, Mish in fp16 second order;
# dropout, in eval, changes no values).
_SAME_OUT_OF_PLACE = frozenset(
    {nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.Threshold, nn.RReLU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid}
)


class _InPlace(Protocol):
    """A module of ``_SAME_OUT_OF_PLACE``: it has an ``inplace`` flag."""

    inplace: bool


def _ancestors(path: str) -> Iterable[str]:
    """The paths of the modules that contain ``path``: ``"a.b.c"`` -> ``"a"``, ``"a.b"``."""
    parts = path.split(".")
    return (".".join(parts[:k]) for k in range(1, len(parts)))


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


def _try_trace(root: nn.Module, args: Iterable[Any], kwargs: dict[str, Any], sites: list[Site]) -> Trace | None:
    try:
        return trace(root, tuple(args), kwargs, watch=sites)
    except Exception:  # data-dependent Python control flow, ops without meta kernels, ...
        return None
