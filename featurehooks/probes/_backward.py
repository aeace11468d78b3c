"""The backward side of ``detect_nonfinite``: hooks that record whether each checked gradient is finite, and the
bookkeeping of every backward pass under way until it ends and is reported (docs/probes.md has the rules)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from torch import Tensor

from ._finite import FINITE, Flags, flag_of
from ._torch import at_backward_end, backward_id, tensor_version

__all__ = ["BACKWARDS_KEPT", "Backwards", "GradFlag", "NodeGradFlag", "PassingGradFlag", "Role"]

Role = tuple[int, str, int, str, bool]  # (forward id, module path, call, tensor label, is an output)
Events = list[tuple[list[Role], bool]]  # the roles of each checked gradient of a backward pass, and whether finite

# backward passes followed at once: one that raised never ends, and is let go when this many newer ones have begun
BACKWARDS_KEPT = 64


class GradFlag:
    """Tensor hook on one checked leaf tensor: records whether its gradient is finite, for every role it plays in
    the last forward that checked it (``forward``)."""

    __slots__ = ("backwards", "forward", "roles")

    def __init__(self, backwards: Backwards) -> None:
        self.backwards = backwards
        self.forward = -1
        self.roles: list[Role] = []

    def __call__(self, grad: Tensor) -> None:
        # a leaf's gradient goes on to be accumulated into ``.grad`` only: held, it would be copied there, not taken
        self.backwards.note(self, grad, keep=False)


class NodeGradFlag(GradFlag):
    """Pre-hook on the autograd node that made a checked tensor: the same for the gradient with respect to that
    tensor, the node's output ``output_nr`` (the tensor as it was when checked, whatever changed it in place since)."""

    __slots__ = ("output_nr",)

    def __init__(self, backwards: Backwards, output_nr: int) -> None:
        super().__init__(backwards)
        self.output_nr = output_nr

    def __call__(self, grad_outputs: tuple[Tensor | None, ...]) -> None:  # type: ignore[override]
        grad = grad_outputs[self.output_nr]
        if grad is not None:
            self.backwards.note(self, grad)


class PassingGradFlag(NodeGradFlag):
    """Post-hook on a node whose gradient with respect to its input is finite wherever the one with respect to its
    output is (``grad_passes_finite``): checks the latter and, found finite, hands the former on as known finite, so the
    hook it reaches next does not read it (the gradient with respect to a ReLU's input). ``passes``: whether this
    hook runs first among the node's post-hooks (another, run before, may have changed the former)."""

    __slots__ = ("passes",)

    def __init__(self, backwards: Backwards) -> None:
        super().__init__(backwards, 0)
        self.passes = True

    def __call__(  # type: ignore[override]
        self, grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
    ) -> None:
        grad = grad_outputs[0]
        if grad is not None:
            self.backwards.note(self, grad, passed=grad_inputs[0] if self.passes else None)


class _Backward:
    """One backward pass (a graph task): the roles and flags of its checked gradients, in the order they arrived,
    and the last gradient known finite (autograd hands a tensor on unchanged where a node passes it through)."""

    __slots__ = ("events", "finite", "flags", "version")

    def __init__(self) -> None:
        self.events: list[tuple[list[Role], int]] = []
        self.flags = Flags()
        self.finite: Tensor | None = None
        self.version = -1  # that tensor's version when found finite: changed in place since, it is read again


class Backwards:
    """The backward passes under way, by graph task: each checked gradient is noted as it arrives, and when its pass
    ends the flags are read and ``report`` gets the pass's events (while ``active`` says the hooks are on)."""

    def __init__(self, active: Callable[[], bool], report: Callable[[Events], None]) -> None:
        self._active = active
        self._report = report
        self._lock = threading.Lock()
        self._passes: dict[int, _Backward] = {}

    def __len__(self) -> int:
        """How many backward passes are followed (begun, not ended: running, or raised)."""
        return len(self._passes)

    def holding(self) -> list[bool]:
        """Whether each backward pass followed holds a gradient known finite, oldest first."""
        with self._lock:
            return [backward.finite is not None for backward in self._passes.values()]

    def note(self, hook: GradFlag, grad: Tensor, passed: Tensor | None = None, keep: bool = True) -> None:
        """Record whether ``grad`` is finite; ``passed``: a gradient that is wherever ``grad`` is (a node made it);
        ``keep``: whether a later checked gradient may be this one (or ``passed``)."""
        if not self._active() or not hook.roles or grad.numel() == 0:
            return
        task = backward_id()
        with self._lock:
            backward = self._passes.get(task)
            if backward is None:
                for other in self._passes.values():  # a backward pass that raised never ended: let go of its
                    other.finite = None  # gradient (one running in another thread just reads its next one)
                while len(self._passes) >= BACKWARDS_KEPT:  # and, when many have raised, of the oldest
                    del self._passes[next(iter(self._passes))]
                backward = self._passes[task] = _Backward()
                # check once, when this backward pass ends
                at_backward_end(functools.partial(self._end, task))
        # the tensor known finite is held until the next checked gradient: holding it, autograd never adds another
        # gradient into it in place; anything else changing it in place (a custom backward) bumps its version
        known = grad is backward.finite and tensor_version(grad) == backward.version
        kind = FINITE if known else flag_of(grad)
        kept = (grad if passed is None else passed) if keep and kind == FINITE else None
        backward.finite, backward.version = kept, -1 if kept is None else tensor_version(kept)
        with self._lock:
            backward.events.append((hook.roles, backward.flags.add(kind)))

    def clear(self) -> None:
        """Forget every backward pass under way."""
        with self._lock:
            self._passes.clear()

    def _end(self, task: int) -> None:
        with self._lock:
            backward = self._passes.pop(task, None)
        if backward is None or not self._active():
            return
        kinds = backward.flags.kinds()
        self._report([(roles, kinds[index] == FINITE) for roles, index in backward.events])
