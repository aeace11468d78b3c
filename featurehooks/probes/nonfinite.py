"""``detect_nonfinite``: name the module call where a NaN or an infinity starts, in forward or in backward.

Each checked module call records whether its inputs and outputs are finite (``_finite``), hooks on the autograd
nodes that made them do the same for their gradients (``_backward``); the error names the call whose output (or
input gradient) turned non-finite while what it received was finite. docs/probes.md has the rules and limits.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from .._hooks import Observer, ObserverSession, runs_as_defined
from .._taps import Selection, call_name
from ..errors import InvalidTypeError, NonFiniteError
from ..layers import select_modules
from ._backward import Backwards, Events, GradFlag, NodeGradFlag, PassingGradFlag, Role
from ._finite import FINITE, MINUS_INF, Flags, flag_of
from ._handle import ProbeHandle
from ._torch import grad_passes_finite, pytree_leaves, tensor_version

__all__ = ["INPUT", "OUTPUT", "NonFiniteDetector", "detect_nonfinite"]

INPUT = "<input>"
"""The ``path`` a ``NonFiniteError`` names for a NaN or inf in the model's input (forward).

Examples:
    >>> import torch
    >>> from featurehooks import NonFiniteError
    >>> from featurehooks.probes import INPUT, OUTPUT, detect_nonfinite
    >>> net = torch.nn.Linear(2, 1)
    >>> def origin(x, scale=1.0):
    ...     try:
    ...         with detect_nonfinite(net):
    ...             (net(x) * scale).sum().backward()
    ...     except NonFiniteError as error:
    ...         return error.path, error.phase
    >>> origin(torch.tensor([[float("nan"), 0.0]])) == (INPUT, "forward")
    True
    >>> origin(torch.ones(1, 2), scale=float("inf")) == (OUTPUT, "backward")  # the loss made it
    True
"""
OUTPUT = "<output>"
"""The ``path`` a ``NonFiniteError`` names for a NaN or inf gradient arriving at the model's output (backward):
the loss, or code after the model, made it. ``INPUT`` has an example of both.

Examples:
    >>> from featurehooks.probes import INPUT, OUTPUT
    >>> OUTPUT, INPUT
    ('<output>', '<input>')
"""

Entry = tuple[str, int]  # (tensor label, flag index) of one checked tensor of one call


class _Seen:
    """A tensor already checked in this forward, as long as it is alive and unchanged; ``roles``: what it is to
    the calls that saw it (None: its gradient is not checked)."""

    __slots__ = ("flag", "ref", "roles", "version")

    def __init__(self, tensor: Tensor, version: int | None, flag: int, roles: list[Role] | None) -> None:
        self.ref = weakref.ref(tensor)
        self.version = version
        self.flag = flag
        self.roles = roles


class _Call:
    """One checked module call, or the forward itself: the flags of its tensors and the call it ran inside."""

    __slots__ = ("call", "inputs", "main", "outputs", "parent", "path")

    def __init__(self, path: str, call: int, inputs: list[Entry], main: int, parent: _Call | None) -> None:
        self.path = path
        self.call = call
        self.inputs = inputs
        self.main = main  # how many of ``inputs`` come from its first argument
        self.outputs: list[Entry] = []
        self.parent = parent


class _Forward:
    """One forward: the flags of every checked tensor and the calls that saw them."""

    __slots__ = ("calls", "flags", "grads", "id", "root", "running", "seen")

    def __init__(self, forward_id: int) -> None:
        self.id = forward_id
        self.flags = Flags()
        self.seen: dict[int, _Seen] = {}
        # what made each checked tensor whose gradient is checked (its node and output, or the leaf itself), with
        # its roles: hooked when the forward is over, in one go, not one at a time between the model's kernels
        self.grads: list[tuple[Any, int, list[Role]]] = []
        self.root = _Call("", 0, [], 0, None)  # the forward itself: the model's arguments and output
        self.running: list[_Call] = []  # checked calls begun and not yet ended, innermost last
        self.calls: list[_Call] = []  # in the order calls finished


_PLAIN = (Tensor, int, float, bool, str, type(None))  # leaves of a pytree


def _leaves(value: Any) -> Sequence[Any]:
    """A value's pytree leaves; a tensor, or a plain tuple or list of leaves, without walking the pytree (a call's
    usual arguments and outputs: this runs for every module call)."""
    if isinstance(value, Tensor):
        return (value,)
    if type(value) in (tuple, list) and all(isinstance(item, _PLAIN) for item in value):
        return value  # type: ignore[no-any-return]
    return pytree_leaves(value)


def _float_leaves(value: Any) -> list[Tensor]:
    return [
        t
        for t in _leaves(value)
        if isinstance(t, Tensor) and t.is_floating_point() and (t.is_nested or t.layout == torch.strided) and t.numel()
    ]


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Tensor], int]:
    """The floating tensors among a call's arguments, and how many of them, first, come from its first argument."""
    values = (*args, *kwargs.values())
    main = _float_leaves(values[:1])
    return main + (_float_leaves(values[1:]) if len(values) > 1 else []), len(main)


# Elementwise modules whose output is finite wherever their one input is, each at most as large as its input or
# bounded (exactly these types: a subclass may compute anything else). Dropout scales by 1 / (1 - p) in training,
# which can overflow: only in eval mode, where it returns its input.
_KEEPS_FINITE = frozenset(
    {nn.ReLU, nn.ReLU6, nn.Sigmoid, nn.Tanh, nn.Hardsigmoid, nn.SiLU, nn.GELU, nn.Mish, nn.Softsign, nn.Identity}
)
_KEEPS_FINITE_IN_EVAL = frozenset(
    {nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout}
)


def _keeps_finite(module: nn.Module) -> bool:
    """Whether ``module`` maps finite values to finite values (its output then needs no check of its own)."""
    if type(module) is nn.LeakyReLU:
        return abs(module.negative_slope) <= 1  # False for NaN
    return type(module) in _KEEPS_FINITE or (type(module) in _KEEPS_FINITE_IN_EVAL and not module.training)


def _labels(kind: str, count: int) -> list[str]:
    return [kind] if count == 1 else [f"{kind}[{k}]" for k in range(count)]


def _ending(forward: _Forward, path: str, call: int) -> _Call:
    """The record of the call ending now, taken off the running calls with any left above it (calls that raised)."""
    running = forward.running
    for k in range(len(running) - 1, -1, -1):
        if running[k].path == path and running[k].call == call:
            record = running[k]
            del running[k:]
            return record
    return _Call(path, call, [], 0, running[-1] if running else forward.root)  # its pre-hook never ran


def _masks(forward: _Forward, kinds: list[int]) -> set[int]:
    """The flags of masks: -inf is their only non-finite value, and they are passed as a later argument, never
    as a first one (nor returned by the model)."""
    first = {flag for _label, flag in forward.root.outputs}
    later: set[int] = set()
    for record in (forward.root, *forward.calls):
        for k, (_label, flag) in enumerate(record.inputs):
            (first if k < record.main else later).add(flag)
    return {flag for flag in later - first if kinds[flag] == MINUS_INF}


def _leading(forward: _Forward, nonfinite: Callable[[int], bool]) -> set[_Call]:
    """The calls whose non-finite output leads on to the model's output (which is non-finite).

    It leads on when the model returns it, when a module that received it later returned a non-finite output
    that leads on, or, where no checked module received it later, when the call it was made in leads on (that
    call's code used it). Calls are visited from the last to finish, so every answer needed is already known.
    """
    calls = forward.calls
    final = {flag for _label, flag in forward.root.outputs}
    receivers: dict[int, list[int]] = {}  # flag -> finish indices of the calls that received it
    for k, record in enumerate(calls):
        for _label, flag in record.inputs:
            if nonfinite(flag):
                receivers.setdefault(flag, []).append(k)
    leading = {forward.root}
    for k in range(len(calls) - 1, -1, -1):
        flags = [flag for _label, flag in calls[k].outputs if nonfinite(flag)]
        later = [calls[j] for flag in flags for j in receivers.get(flag, ()) if j > k]
        if (
            any(flag in final for flag in flags)
            or any(record in leading for record in later)
            or (flags and not later and calls[k].parent in leading)
        ):
            leading.add(calls[k])
    return leading


class NonFiniteDetector(Observer[_Forward], ProbeHandle):
    """The hooks of ``detect_nonfinite``: a context manager, and a handle with ``close()``.

    Examples:
        >>> import torch
        >>> from featurehooks.probes import NonFiniteDetector, detect_nonfinite
        >>> net = torch.nn.Linear(2, 2)
        >>> detector = detect_nonfinite(net)  # checks every forward and backward until closed
        >>> isinstance(detector, NonFiniteDetector)
        True
        >>> _ = net(torch.ones(1, 2))  # finite: nothing is raised
        >>> detector.close()
    """

    wants_inputs = True

    def __init__(self, model: nn.Module, layers: str | Sequence[str] | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidTypeError(f"detect_nonfinite needs an nn.Module, got {type(model).__name__}")
        if layers is None:  # every submodule; none at all still checks the model's own input and output
            selection = Selection.every(_submodules(model))
        else:
            selection = select_modules(model, layers, default=_submodules, what="check")
        modules = dict(model.named_modules())
        self._types = {path: type(module).__name__ for path, module in modules.items()}
        self._leaf = {path: next(module.children(), None) is None for path, module in modules.items()}
        self._label = type(model).__name__
        self._ids = itertools.count()
        self._backwards = Backwards(lambda: self.active, self._raise_backward)  # graph task -> its gradients
        self._hooked: MutableMapping[Tensor, GradFlag] = WeakIdKeyDictionary()  # leaf tensor -> its hook
        self._selection = selection
        self._session = ObserverSession(model, selection, self)

    # forward -------------------------------------------------------------------------------------

    def _check(
        self,
        forward: _Forward,
        path: str,
        call: int,
        kind: str,
        tensors: list[Tensor],
        is_output: bool,
        known: int | None = None,
    ) -> list[Entry]:
        """Record device flags for ``tensors`` (``known``: their kind, without reading them); hook their gradients."""
        entries = []
        for label, tensor in zip(_labels(kind, len(tensors)), tensors):
            seen = self._seen(forward, tensor, known)
            entries.append((label, seen.flag))
            if seen.roles is not None:
                seen.roles.append((forward.id, path, call, label, is_output))
        return entries

    def _seen(self, forward: _Forward, tensor: Tensor, known: int | None = None) -> _Seen:
        """This tensor's flag, checked once per version (a module's input is mostly the last one's output)."""
        version = None if tensor.is_inference() else tensor_version(tensor)
        seen = forward.seen.get(id(tensor))
        if seen is not None and version is not None and seen.version == version and seen.ref() is tensor:
            return seen
        flag = forward.flags.add(flag_of(tensor) if known is None else known)
        roles: list[Role] | None = None
        if tensor.requires_grad and torch.is_grad_enabled():
            roles = []
            node = tensor.grad_fn
            forward.grads.append((tensor, 0, roles) if node is None else (node, tensor.output_nr, roles))
        seen = forward.seen[id(tensor)] = _Seen(tensor, version, flag, roles)
        return seen

    def _hook_grads(self, forward: _Forward) -> None:
        """Hook the gradients of the tensors checked in ``forward``, each answering for its roles in it.

        One hook per gradient: on the node that made the tensor (its output ``output_nr``), so a tensor changed in
        place later is still checked as it was; on a leaf (an image being optimized, fed to every step), the tensor
        itself. A gradient checked in several forwards (a leaf, or one tensor fed to the model twice) keeps its
        hook, answering for the last of them: registering one each forward would pile them up.
        """
        for maker, output_nr, roles in forward.grads:
            if isinstance(maker, Tensor):
                grad = self._hooked.get(maker)
                if grad is None:
                    grad = self._hooked[maker] = GradFlag(self._backwards)
                    self._session.hold(maker, grad)
            else:
                metadata = maker.metadata
                grad = metadata.get((self, output_nr))
                if grad is None and grad_passes_finite(maker):
                    grad = metadata[(self, output_nr)] = PassingGradFlag(self._backwards)
                    # a post-hook registered before this one (in the model's forward) runs first and may change
                    # the gradient the node made: then it is read where it arrives, as any other
                    grad.passes = self._session.hold_node_post(maker, grad)
                elif grad is None:
                    grad = metadata[(self, output_nr)] = NodeGradFlag(self._backwards, output_nr)
                    self._session.hold_node(maker, grad)
            if grad.forward != forward.id:
                grad.forward, grad.roles = forward.id, roles  # a new list: a backward under way keeps the one it took
            else:
                grad.roles = grad.roles + roles

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Forward:
        forward = _Forward(next(self._ids))
        tensors, forward.root.main = _arguments(args, kwargs)
        forward.root.inputs = self._check(forward, "", 0, "input", tensors, is_output=False)
        return forward

    def before(
        self, state: _Forward, path: str, call: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        tensors, main = _arguments(args, kwargs)
        inputs = self._check(state, path, call, "input", tensors, is_output=False)
        state.running.append(_Call(path, call, inputs, main, state.running[-1] if state.running else state.root))

    def after(
        self, state: _Forward, path: str, call: int, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        record = _ending(state, path, call)
        main = record.inputs[: record.main]
        # a module that keeps finite values finite, on inputs known finite already, with no other hook that could
        # change what it takes or returns: its output needs no reading
        known = (
            FINITE
            if main
            and _keeps_finite(module)
            and all(state.flags.finite_now(f) for _l, f in main)
            and runs_as_defined(module)
            else None
        )
        record.outputs = self._check(state, path, call, "output", _float_leaves(output), is_output=True, known=known)
        state.calls.append(record)

    def end(self, state: _Forward, output: Any) -> None:
        state.root.outputs = self._check(state, "", 0, "output", _float_leaves(output), is_output=True)
        kinds = state.flags.kinds()
        if any(kind != FINITE for kind in kinds):
            self._check_forward(state, kinds)

    def leave(self, state: _Forward) -> None:
        if self._session.active:
            self._hook_grads(state)

    def _check_forward(self, forward: _Forward, kinds: list[int]) -> None:
        """Raise at the origin of a NaN or inf in the model's input or output (the rules: docs/probes.md)."""
        root = forward.root
        masks = _masks(forward, kinds)

        def nonfinite(flag: int) -> bool:
            return kinds[flag] != FINITE and flag not in masks

        def bad(entries: list[Entry]) -> list[str]:
            return [label for label, flag in entries if nonfinite(flag)]

        def masked(entries: list[Entry]) -> str:
            labels = [label for label, flag in entries if flag in masks]
            return f" apart from -inf masks ({', '.join(labels)}; a row masked entirely gives NaN)" if labels else ""

        if bad(root.inputs):
            label = bad(root.inputs)[0]
            raise NonFiniteError(
                f"the {label} of {self._label} already holds NaN or inf before any module runs",
                path=INPUT,
                call=0,
                phase="forward",
                tensor=label,
            )
        if not bad(root.outputs):
            return
        leading = _leading(forward, nonfinite)
        for record in forward.calls:
            if record in leading and not bad(record.inputs):
                label = bad(record.outputs)[0]
                raise NonFiniteError(
                    f"NaN or inf first appears in the forward pass in the {label} of "
                    f"{self._where(record.path, record.call)}: its inputs were finite{masked(record.inputs)}",
                    path=record.path,
                    call=record.call,
                    phase="forward",
                    tensor=label,
                )
        label = bad(root.outputs)[0]
        raise NonFiniteError(
            f"NaN or inf first appears in the forward pass in the {label} of {self._label} itself: code of "
            "its own forward outside the checked modules made it from finite values",
            path="",
            call=0,
            phase="forward",
            tensor=label,
        )

    # backward ------------------------------------------------------------------------------------

    def _raise_backward(self, events: Events) -> None:
        seen_output: dict[tuple[int, str, int], bool] = {}  # module call -> whether its output gradient was finite
        first_bad: list[Role] | None = None
        for roles, ok in events:
            for forward_id, path, call, _label, is_output in roles:
                if is_output:
                    key = (forward_id, path, call)
                    seen_output[key] = seen_output.get(key, True) and ok
            if ok:
                continue
            first_bad = first_bad or roles
            blamed = [role for role in roles if not role[4] and seen_output.get(role[:3]) is True]
            if blamed:
                self._blame(blamed)
        if first_bad is None:
            return
        if any(path == "" and is_output for _f, path, _c, _l, is_output in first_bad):
            raise NonFiniteError(
                f"the gradient reaching the output of {self._label} is already NaN or inf: it comes from the loss "
                "or from code after the model",
                path=OUTPUT,
                call=0,
                phase="backward",
                tensor="grad_output",
            )
        _forward_id, path, call, label, is_output = next((r for r in first_bad if r[4]), first_bad[0])
        tensor = "grad_output" if is_output else f"grad_{label}"
        raise NonFiniteError(
            f"a NaN or inf gradient first reaches the {tensor} of {self._where(path, call)} in the backward pass; "
            "it was made by code outside the checked modules",
            path=path,
            call=call,
            phase="backward",
            tensor=tensor,
        )

    def _blame(self, blamed: list[Role]) -> None:
        leaves = [role for role in blamed if self._leaf.get(role[1], False)]
        _forward_id, path, call, label, _is_output = (leaves or blamed)[0]
        others = sorted({self._where(p, c) for _f, p, c, _l, _o in blamed} - {self._where(path, call)})
        shared = f"; the input is shared with {', '.join(others)}, which may have made it instead" if others else ""
        raise NonFiniteError(
            f"NaN or inf first appears in the backward pass in the gradient with respect to the {label} of "
            f"{self._where(path, call)}: the gradient with respect to its output was finite{shared}",
            path=path,
            call=call,
            phase="backward",
            tensor=f"grad_{label}",
        )

    def _where(self, path: str, call: int) -> str:
        if path == "":
            return f"{self._label} (the model's own forward)"
        return f"{call_name(path, call)!r} ({self._types.get(path, '?')})"

    # handle --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every hook, module and tensor hooks alike; safe to call twice."""
        self._session.remove()
        self._hooked.clear()
        self._backwards.clear()

    def __repr__(self) -> str:
        return f"NonFiniteDetector({len(self._selection)} modules, {'active' if self.active else 'closed'})"


def _submodules(model: nn.Module) -> list[str]:
    return [path for path, _ in model.named_modules() if path]


def detect_nonfinite(model: nn.Module, layers: str | Sequence[str] | None = None) -> NonFiniteDetector:
    """Raise ``NonFiniteError`` at the module call where a NaN or inf starts.

    A context manager over a model you train (neither copied nor frozen): each forward of the
    model inside the block is checked when it returns, and each backward pass when it ends, with
    one host sync each on a GPU (flags are gathered on the device meanwhile). A forward is reported when
    the model's input (``-inf`` masks aside) or output holds a NaN or inf, a backward pass when a
    checked gradient does: ``-inf`` masks and fills that never reach the output are no errors. The
    error's ``path``, ``call``, ``phase`` (``"forward"``/``"backward"``) and ``tensor``
    (``"output"``, ``"grad_input"``, ...) name the origin, not the modules the value then flowed
    through; docs/probes.md gives the rules and limits.

    Args:
        model: the model to check.
        layers: module paths, aliases or glob patterns over module paths; default: every submodule.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks import NonFiniteError
        >>> from featurehooks.probes import detect_nonfinite
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> with torch.no_grad():
        ...     net[1].weight[0, 0] = float("nan")
        >>> try:
        ...     with detect_nonfinite(net):
        ...         net(torch.randn(2, 4))
        ... except NonFiniteError as error:
        ...     found = (error.path, error.phase, error.tensor)
        >>> found
        ('1', 'forward', 'output')
    """
    return NonFiniteDetector(model, layers)
