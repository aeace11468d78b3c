"""The hook engine: every hook featurehooks puts on a model that a user runs is registered and removed here
(the taps of an extractor or ``capture`` through ``_tap_session.TapSession``, built on ``HookSession``).

- ``Hooks`` owns the handles of one owner's hooks, module and tensor hooks alike, and removes them all at
  once (``remove``, safe twice). Gradient modifiers (``probes.modifiers``) hold their hooks in one.
- ``HookSession``, a ``Hooks`` over one model, keeps the forwards in progress on a per-thread stack, so
  threads, ``nn.DataParallel`` replicas and nested forwards never see each other's, and brackets forwards
  with hooks on chosen modules: a pre-hook opens one (each call of the model itself, and each call of a
  bracketed submodule while none is open), a forward hook finishes it, and one that also runs after an
  exception closes it. A KeyboardInterrupt skips the hooks that close a forward (torch runs ``always_call``
  hooks only for ``Exception``); a forward left open that way is recognised by its finished opening frame
  and dropped when the next one opens. ``Bracket`` is a session's record of one forward, ``SessionHook`` the
  base of its hooks.
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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _trace
from ._taps import Selection
from ._trace import StopForward

__all__ = [
    "Bracket",
    "ClosedOnExit",
    "HookSession",
    "Hooks",
    "InertInCopies",
    "Observer",
    "ObserverSession",
    "SessionHook",
    "StopForward",
    "runs_as_defined",
]

T = TypeVar("T")  # an observer's state of one forward
F = TypeVar("F", bound="Bracket")  # a session's record of one forward in progress
S = TypeVar("S", bound="HookSession[Any]")


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


class Bracket:
    """One forward in progress: the module call that opened it and its frame (None: opened by ``TapSession.run``).

    Sessions subclass it for what they keep of a forward (``_Observed`` here, ``_tap_session._Forward``).
    """

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


class SessionHook(InertInCopies, Generic[S]):
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


class _Open(SessionHook["HookSession[Any]"]):
    """Forward pre-hook of a bracketed module: opens a forward if none is open (or this is the model itself)."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.session._open(self.path, sys._getframe(1), module, args, kwargs)


class _Finish(SessionHook["HookSession[Any]"]):
    """Forward hook of a bracketed module: reports the call, finishes the forward it opened."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.session._finish(self.path, module, args, output)


class _Close(SessionHook["HookSession[Any]"]):
    """Forward hook of a bracketed module, also called after an exception: closes the forward it opened."""

    def __call__(self, _module: nn.Module, _args: tuple[Any, ...], _output: Any) -> None:
        self.session._close(self.path)


_OWN_HOOKS = (SessionHook, _Inert)  # featurehooks' forward hooks and pre-hooks: each returns None, changing nothing


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


class _Observed(Bracket, Generic[T]):
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


def _ancestors(path: str) -> Iterable[str]:
    """The paths of the modules that contain ``path``: ``"a.b.c"`` -> ``"a"``, ``"a.b"``."""
    parts = path.split(".")
    return (".".join(parts[:k]) for k in range(1, len(parts)))
