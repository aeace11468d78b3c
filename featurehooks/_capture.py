"""capture: named intermediate outputs (and their gradients) of your own module for the duration of a ``with`` block.

Unlike ``FeatureExtractor``, it neither copies, freezes nor switches the module to eval: the hooks go on the
model you pass (through the engine's ``TapSession``) and are removed when the block ends.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from ._tap_session import TapSession
from .errors import InvalidTypeError, InvalidValueError
from .layers import LayerIndex, LayerSpec

__all__ = ["CapturedFeatures", "CapturedGrads", "Mode", "capture", "refuse_torchscript"]

Mode = Literal["detach", "grad"]


def check_mode(mode: str) -> None:
    if mode not in ("detach", "grad"):
        raise InvalidValueError(f"mode must be 'detach' or 'grad', not {mode!r}")


def refuse_torchscript(module: nn.Module, paths: Iterable[str], who: str) -> None:
    """Refuse a TorchScript module (``torch.jit.trace``/``script``), or a tap inside one: forward hooks never fire
    inside TorchScript, so its layers would silently give nothing. ``who`` (``"capture"``, ``"FeatureExtractor"``)
    names the caller in the error."""
    verb = "capture" if who == "capture" else "pass"
    eager = f"{verb} the eager module (the nn.Module before torch.jit.trace/script)"
    if isinstance(module, torch.jit.ScriptModule):
        raise InvalidTypeError(
            f"{who}: the module is a TorchScript module (torch.jit.trace/script), and hooks do not fire inside "
            f"TorchScript, so none of its layers can be captured; {eager}"
        )
    for path in paths:
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            inner = ".".join(parts[:depth])
            if isinstance(module.get_submodule(inner), torch.jit.ScriptModule):
                raise InvalidTypeError(
                    f"{who}: {inner!r} is a TorchScript module (torch.jit.trace/script), and hooks do not fire "
                    f"inside TorchScript, so {path!r} would capture nothing; tap a layer outside it, or {eager}"
                )


@contextmanager
def capture(
    module: nn.Module, layers: LayerSpec, *, mode: Mode = "grad", grads: bool = False
) -> Iterator[CapturedFeatures]:
    """Collect named intermediate outputs of your own module for the duration of a ``with`` block.

    Unlike FeatureExtractor, the module is neither copied, frozen nor switched to eval: use it on a
    model you are training, such as a GAN discriminator. Each forward of ``module`` inside the block
    refills the yielded mapping (request order); the hooks are removed when the block ends, also on error.

    With ``grads=True``, ``feats.grads`` holds, after a backward, the gradient of what was
    differentiated with respect to each captured output, under the same names (Grad-CAM, saliency,
    gradient norms per layer). It is the gradient with respect to the output as the module returned
    it: when the model later changes that tensor in place (an in-place ReLU after a convolution,
    ``out += identity``), the captured value is a copy taken before the change, and its gradient is
    the one with respect to that earlier value, i.e. what flows back into the module. See
    ``CapturedFeatures.grads`` for the details.

    Args:
        module: the model to tap.
        layers: module paths (or a dict ``{"module.path": "output_name"}``).
        mode: ``"grad"`` keeps the graph; ``"detach"`` stores detached outputs.
        grads: also collect the gradients of the captured outputs (needs ``mode="grad"``).

    Raises:
        InvalidValueError: ``grads=True`` with ``mode="detach"`` (a detached output has no gradient).
        InvalidTypeError: ``module``, or a requested layer's module or one above it, is TorchScript
            (``torch.jit.trace``/``script``), where hooks do not fire: capture the eager module.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks import capture
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 3))
        >>> with capture(net, ["0", "2"], grads=True) as feats:
        ...     net(torch.rand(1, 3, 16, 16)).sum().backward()
        >>> list(feats), tuple(feats.grads["0"].shape)
        (['0', '2'], (1, 8, 14, 14))
    """
    check_mode(mode)
    if not isinstance(grads, bool):
        raise InvalidTypeError(f"grads must be True or False, not {grads!r}")
    if grads and mode == "detach":
        raise InvalidValueError(
            "grads=True needs mode='grad': detached outputs are not part of the graph, so no gradient reaches them"
        )
    refuse_torchscript(module, (), "capture")
    taps = LayerIndex(module, type(module).__name__).taps(layers)
    refuse_torchscript(module, taps.paths, "capture")
    # With grads, the session hands each output, as the module returned it, to _GradSlots (before any clone
    # of a tap changed in place later: a hook on a clone would never fire, the model does not use it).
    session = TapSession(module, taps, detach=mode == "detach", stop_early=False, keep=_GradSlots if grads else None)
    features = CapturedFeatures(taps.names, grads=grads)
    try:
        session.follow(
            lambda store, kept: features.publish(store, kept if grads else None),
            discard=lambda kept: _release(kept.values()),  # a failed forward: nobody will read its gradients
        )
        yield features
    finally:
        session.remove()
        features._release_hooks()


class _GradSlots:
    """The gradients of one captured output: a slot per tensor leaf, filled by a tensor hook in backward.

    The hooks hold only the slots (no tensor of the forward). On a tensor computed in the forward
    they live as long as its graph does. On a leaf tensor (an input or a parameter that a module
    passes through) a hook would live as long as the tensor, so those are removed by ``release``:
    when a newer forward of the thread is published, when the forward fails, or when the block ends.
    """

    __slots__ = ("leaf_handles", "spec", "values")

    def __init__(self, output: Any) -> None:
        leaves, self.spec = tree_flatten(output)
        self.values: list[Any] = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        self.leaf_handles: list[RemovableHandle] = []
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor) and leaf.requires_grad:
                handle = leaf.register_hook(self._setter(index))  # type: ignore[no-untyped-call]
                if leaf.grad_fn is None:
                    self.leaf_handles.append(handle)

    def _setter(self, index: int) -> Callable[[Tensor], None]:
        values = self.values

        def keep(grad: Tensor) -> None:
            values[index] = grad  # the latest backward through this tensor wins

        return keep

    def value(self) -> Any:
        return tree_unflatten(self.values, self.spec)

    def release(self) -> None:
        """Remove the hooks on leaf tensors (the others go with their graph)."""
        for handle in self.leaf_handles:
            handle.remove()
        self.leaf_handles.clear()


def _release(slots: Iterable[_GradSlots]) -> None:
    for one in slots:
        one.release()


class _LiveMapping(Mapping[str, Any]):
    """A read-only mapping whose names are those of the dictionary ``_current()`` returns at each access."""

    @abstractmethod
    def _current(self) -> Mapping[str, Any]:
        """What the calling thread reads now."""

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._current())})"


class CapturedFeatures(_LiveMapping):
    """The outputs of the latest completed forward inside a ``capture`` block, in request order.

    Forwards in several threads each publish their own outputs: a thread reads those of its own
    latest forward. A thread that ran none reads those of the one thread that did; when several
    did (``nn.DataParallel`` replicas), reading is an error rather than an arbitrary pick.
    The mapping stays readable after the block.

    Examples:
        >>> import torch
        >>> from featurehooks import CapturedFeatures, capture
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
        >>> with capture(net, {"1": "act"}) as feats:
        ...     _ = net(torch.rand(1, 3, 8, 8))
        ...     first = feats["act"]
        ...     _ = net(torch.rand(1, 3, 8, 8))  # feats now holds this forward's outputs
        >>> isinstance(feats, CapturedFeatures), feats["act"] is first, feats["act"].shape
        (True, False, torch.Size([1, 8, 6, 6]))
    """

    def __init__(self, names: list[str], *, grads: bool = False) -> None:
        self._names = names
        self._by_thread: dict[int, tuple[dict[str, Any], dict[str, _GradSlots]]] = {}
        self._with_grads = grads

    def publish(self, store: Mapping[str, Any], grads: Mapping[str, _GradSlots] | None = None) -> None:
        """Make ``store`` (one completed forward) and its gradient slots what this thread reads from now on."""
        outputs = {name: store[name] for name in self._names if name in store}
        slots = {name: grads[name] for name in outputs if name in grads} if grads is not None else {}
        thread = threading.get_ident()
        previous = self._by_thread.get(thread)
        self._by_thread[thread] = (outputs, slots)
        if previous is not None:
            _release(one for one in previous[1].values() if one not in slots.values())
        if grads is not None:
            _release(one for one in grads.values() if one not in slots.values())

    def _release_hooks(self) -> None:
        """Remove the gradient hooks left on leaf tensors (the end of the block)."""
        for _, slots in list(self._by_thread.values()):
            _release(slots.values())

    def _published(self) -> tuple[dict[str, Any], dict[str, _GradSlots]]:
        mine = self._by_thread.get(threading.get_ident())
        if mine is not None:
            return mine
        published = list(self._by_thread.values())
        if len(published) > 1:
            raise RuntimeError(
                f"forwards in {len(published)} other threads were captured (e.g. nn.DataParallel replicas); "
                "read the features in the thread that ran the forward"
            )
        return published[0] if published else ({}, {})

    def _current(self) -> dict[str, Any]:
        return self._published()[0]

    @property
    def grads(self) -> CapturedGrads:
        """Gradients of the captured outputs of the same forward, by the same names (``capture(..., grads=True)``).

        Each value has the structure of the captured output, its tensor leaves replaced by their
        gradients: for a tensor output, the gradient tensor of the same shape. A leaf is ``None``
        until a backward reaches it, and stays ``None`` when none does (the loss does not depend on
        it, it does not require grad, the forward ran under ``torch.no_grad()``). Non-tensor leaves
        are kept as they are.

        - It is the gradient with respect to the output as the module returned it. When the model
          changes that tensor in place later (an in-place ReLU, ``out += identity``), the feature
          you read is a copy taken before the change, and its gradient is the one with respect to
          that value: the gradient that flows back into the module, e.g. ``grad_after * (x > 0)``
          through an in-place ReLU. (A tensor hook registered when the module returns gives
          exactly this; the gradient with respect to the changed tensor would be the one of
          another value.)
        - Limitation: if the output is a *view* of another tensor and is changed in place later,
          PyTorch routes the gradient around it, and its gradient stays ``None``.
        - A backward fills the gradients of the forward it goes through: after a second forward,
          the mapping shows the second forward's outputs and gradients, even if you backpropagate
          a loss of the first. The latest backward through a tensor replaces an earlier one (no
          accumulation as in ``.grad``). A backward after the block still fills them, except for
          outputs that are leaf tensors (an input or a parameter a module passes through): hooks
          on those would outlive the graph, so they are removed when the block ends.
        - Forward hooks run in the order they were put on a module, each on the output the previous
          one returned, and gradient modifiers (``featurehooks.probes.scale_grad`` ...) stack like
          layers after it: a block opened before a modifier was put on reads the gradient after the
          modifier changed it (what enters the module), a block opened after reads it as it arrives
          from downstream.

        Raises:
            InvalidValueError: the block was opened without ``grads=True``.
        """
        if not self._with_grads:
            raise InvalidValueError(
                "this capture block collects no gradients: open it with capture(module, layers, grads=True)"
            )
        return CapturedGrads(self)  # a view made per access: a stored one would be a reference cycle

    def __getitem__(self, name: str) -> Any:
        return self._current()[name]


class CapturedGrads(_LiveMapping):
    """``CapturedFeatures.grads``: the gradients of the captured outputs, by name, per thread as the features."""

    def __init__(self, features: CapturedFeatures) -> None:
        self._features = features

    def _current(self) -> dict[str, _GradSlots]:
        return self._features._published()[1]

    def __getitem__(self, name: str) -> Any:
        return self._current()[name].value()
