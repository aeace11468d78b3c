"""The hook session: the one place that registers, collects from, and removes forward hooks.

A session hooks the requested modules of one model. Each forward collects into a fresh dict;
with ``stop_early`` the hook of the last requested module to fire raises ``StopForward``, which
the caller catches, so nothing after the deepest tap runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only
from torch.utils.hooks import RemovableHandle


@contextmanager
def preserved_attributes(model: nn.Module) -> Iterator[None]:
    """Put back every module's plain attributes (train flags, caches a forward sets) when the block ends.

    A shape-only forward on meta tensors must leave no meta tensor behind in the caller's model.
    """
    saved = [(module, dict(module.__dict__)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for key in [key for key in module.__dict__ if key not in attributes]:
                del module.__dict__[key]
            module.__dict__.update(attributes)


class StopForward(BaseException):
    """Raised by the last hook to end a forward early; never escapes the session's ``run``.

    A BaseException, like KeyboardInterrupt, so a model's own ``except Exception:`` cannot swallow it.
    """


class RepeatedCallError(RuntimeError):
    """A hooked module ran more than once in one forward, so its outputs would overwrite each other."""


class _Tap:
    """The forward hook of one tapped module.

    An object rather than a closure, so that ``copy.deepcopy`` and pickling of a model that holds
    a session give hooks that feed the copied session, not the original one.
    """

    def __init__(self, session: HookSession, path: str) -> None:
        self.session = session
        self.path = path

    def __call__(self, _module: nn.Module, _args: Any, output: Any) -> None:
        self.session.collect(self.path, output)


class HookSession:
    """Forward hooks on ``taps`` (module path -> output names) of ``model``, removed by ``remove()``.

    Args:
        model: the model whose submodules are hooked.
        taps: module path -> the output names its output is stored under.
        detach: store detached outputs (no graph).
        stop_early: raise StopForward once every tapped module has fired.
    """

    def __init__(
        self, model: nn.Module, taps: Mapping[str, Sequence[str]], *, detach: bool, stop_early: bool
    ) -> None:
        self.taps = {path: tuple(names) for path, names in taps.items()}
        self.detach = detach
        self.stop_early = stop_early
        self.clone_paths: set[str] = set()
        self.track_versions = False
        self.last_mutated: set[str] = set()
        self._store: dict[str, Any] | None = None
        self._fired: dict[str, torch.Tensor | None] = {}
        self._versions: dict[str, int] = {}
        self._versions_at_stop: dict[str, int] = {}
        self.stop_point_only = False
        self._handles: list[RemovableHandle] = []
        self._active = True
        modules = dict(model.named_modules())
        try:
            for path in self.taps:
                self._handles.append(modules[path].register_forward_hook(_Tap(self, path)))
        except BaseException:
            self.remove()
            raise

    @property
    def active(self) -> bool:
        """Whether hooks are still registered (a plain flag: torch.compile cannot trace handles)."""
        return self._active

    def collect(self, path: str, output: Any) -> None:
        """Store the output of tapped module ``path``; raise StopForward once every tap has fired."""
        store = self._store
        if store is None:
            return
        if path in self._fired:
            raise RepeatedCallError(
                f"module {path!r} ran more than once in one forward, so its outputs would overwrite "
                "each other; tap a module that runs once (its parent block, or the layer that feeds it)"
            )
        is_tensor = isinstance(output, torch.Tensor)
        if self.detach:
            output = output.detach() if is_tensor else tree_map_only(torch.Tensor, torch.Tensor.detach, output)
        if path in self.clone_paths:
            output = output.clone() if is_tensor else tree_map_only(torch.Tensor, torch.Tensor.clone, output)
        self._fired[path] = output if is_tensor else None
        if self.track_versions and is_tensor and not output.is_inference():  # (inference tensors have no version)
            self._versions[path] = output._version
        for name in self.taps[path]:
            store[name] = output
        if len(self._fired) == len(self.taps):
            if self.stop_early:
                raise StopForward
            if self.track_versions:  # what an early exit would have returned, for a dry run without one
                fired = self._fired
                self._versions_at_stop = {p: fired[p]._version for p in self._versions}  # type: ignore[union-attr]

    def begin(self, store: dict[str, Any]) -> None:
        """Start collecting a new forward into ``store``; outputs of earlier forwards are forgotten."""
        self._store = store
        self._fired = {}
        self._versions = {}
        self._versions_at_stop = {}

    def mutated_paths(self) -> set[str]:
        """Tapped outputs changed in place after capture in the last forward (needs track_versions).

        Without early exit, changes made after the last tap fired still count unless
        ``stop_point_only``: a dry run without early exit then answers for a run with one.
        """
        if self.stop_point_only:
            return {path for path, version in self._versions.items() if self._versions_at_stop.get(path) != version}
        return {
            path
            for path, version in self._versions.items()
            if (tensor := self._fired.get(path)) is not None and tensor._version != version
        }

    def finish(self) -> None:
        """Check that every tap fired in the forward that just ended and note in-place changes.

        Raises:
            RuntimeError: a tapped module never ran (the model's forward skips it).
        """
        missing = [path for path in self.taps if path not in self._fired]
        if missing:
            raise RuntimeError(f"requested layers never ran in the forward pass: {', '.join(missing)}")
        self.last_mutated = self.mutated_paths() if self.track_versions else set()

    def reset(self) -> None:
        """Stop collecting; hooks stay registered but store nothing until the next ``begin``."""
        self._store = None
        self._fired = {}

    def run(self, forward: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """Call ``forward(*args)`` (the model) and return the collected outputs keyed by output name.

        The raise of StopForward and its catch sit in this one frame, so ``torch.compile`` traces
        the whole call as one graph (an exception leaving a frame would make dynamo skip it).
        """
        store: dict[str, Any] = {}
        self.begin(store)
        try:
            try:
                forward(*args)
            except StopForward:
                pass
            self.finish()
        finally:
            self.reset()
        return store

    def verify_on_meta(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
    ) -> bool:
        """Dry-run the whole forward on meta tensors (shapes only, no compute) with ``args``' shapes.

        A tapped module that runs twice raises RepeatedCallError now rather than mid-training, and
        taps changed in place before the forward would end (a conv before ``ReLU(inplace=True)``)
        are cloned from then on. Returns False when the model cannot run on the meta device; the
        session then keeps tracking versions so the caller can check real forwards instead.
        """
        stop_early = self.stop_early
        self.track_versions, self.stop_early, self.stop_point_only = True, False, stop_early
        try:
            with preserved_attributes(model), torch.inference_mode(False), torch.no_grad():  # versioned meta tensors
                state = {
                    name: torch.empty_like(tensor, device="meta")
                    for name, tensor in chain(model.named_parameters(), model.named_buffers())
                }
                meta = partial(tree_map_only, torch.Tensor, lambda t: torch.empty_like(t, device="meta"))
                forward = partial(
                    torch.func.functional_call, model, state, kwargs=meta(dict(kwargs or {})), strict=False
                )
                self.run(forward, meta(args))
        except RepeatedCallError:
            raise
        except Exception:  # data-dependent Python control flow, ops without meta kernels, ...
            return False
        finally:
            self.stop_early, self.stop_point_only = stop_early, False
        self.clone_paths |= self.last_mutated
        self.track_versions = False
        return True

    def clone_from_now_on(self, paths: set[str]) -> None:
        """Clone these taps in later forwards: they were found changed in place after capture."""
        warnings.warn(
            f"outputs of {', '.join(sorted(paths))} are changed in place later in the forward "
            "(an in-place activation or +=); they are cloned from now on",
            stacklevel=4,
        )
        self.clone_paths |= paths
        self.track_versions = False

    def remove(self) -> None:
        """Remove every hook; safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active = False
