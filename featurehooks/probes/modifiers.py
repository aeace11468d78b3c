"""Gradient modifiers: scale, clip or reverse gradients in backward, leaving the forward values untouched.

A modifier acts either on a **module**, on the gradient flowing back through its output (as if an identity layer
whose backward makes the change were written into the forward right after the module), or on **parameters**, on
each backward's gradient before it accumulates into ``.grad``. Modifiers return removable handles, work as context
managers and stack like layers (the last one put on acts first in backward); docs/probes.md has the rules for
outputs with several tensors, in-place modules, lifetime, copies and the order among modifiers and probes.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> from featurehooks.probes import reverse_grad, scale_grad
    >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    >>> with reverse_grad(net[0]):             # a gradient reversal layer after net[0]
    ...     net(torch.ones(2, 4)).sum().backward()
    >>> with scale_grad(net.parameters(), 0.5) as handle:
    ...     pass
    >>> handle.active
    False

References:
    Ganin & Lempitsky, "Unsupervised Domain Adaptation by Backpropagation", ICML 2015 (gradient reversal).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
from torch import Tensor, nn

from .._hooks import Hooks, InertInCopies
from ..errors import InvalidTypeError, InvalidValueError
from ._torch import is_view, pytree_flatten, pytree_leaves, pytree_unflatten

__all__ = ["GradModifier", "GradTarget", "clip_grad", "reverse_grad", "scale_grad"]

GradTarget = Union[nn.Module, Tensor, Iterable[Tensor]]
"""What a gradient modifier acts on: a module (its output's gradient), one parameter, or an iterable of parameters.

Examples:
    >>> import torch
    >>> from featurehooks.probes import scale_grad
    >>> net = torch.nn.Linear(3, 1)
    >>> for target in (net, net.weight, net.parameters()):
    ...     with scale_grad(target, 0.5):
    ...         pass
"""


class GradModifier:
    """A gradient modifier in place: ``remove()`` it, or use it as a context manager.

    Returned by ``scale_grad``, ``clip_grad`` and ``reverse_grad``; not built directly.

    Examples:
        >>> import torch
        >>> from featurehooks.probes import scale_grad
        >>> lin = torch.nn.Linear(3, 1)
        >>> modifier = scale_grad(lin, 0.5)  # in place until removed
        >>> modifier
        GradModifier(scale_grad(Linear, factor=0.5), active)
        >>> modifier.remove()
        >>> modifier.active
        False
    """

    def __init__(self, description: str) -> None:
        self.description = description
        self._hooks = Hooks()  # the engine's handles: module and parameter hooks, removed together

    @property
    def active(self) -> bool:
        """Whether the modifier still changes gradients."""
        return self._hooks.active

    def remove(self) -> None:
        """Take the modifier away (its hooks too); it changes no gradient from now on. Safe to call twice."""
        self._hooks.remove()

    def __enter__(self) -> GradModifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"GradModifier({self.description}, {state})"


class _ChangeGrad(torch.autograd.Function):
    """Identity in forward (aliases, or copies where ``copy`` says so); ``change`` on each gradient in backward."""

    @staticmethod
    def forward(
        ctx: Any, change: Callable[[Tensor], Tensor], copy: tuple[bool, ...], *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.change = change
        ctx.set_materialize_grads(False)  # outputs nobody uses get None, not a tensor of zeros to change
        return tuple(t.clone() if copied else t.detach() for t, copied in zip(tensors, copy))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        return (None, None, *(None if grad is None else ctx.change(grad) for grad in grads))


def _check_factor(factor: object, what: str) -> float:
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise InvalidTypeError(f"{what} must be a real number, not {type(factor).__name__} ({factor!r})")
    value = float(factor)
    if not math.isfinite(value):
        raise InvalidValueError(f"{what} must be finite, not {value}")
    return value


def _parameters(target: Tensor | Iterable[Any]) -> list[Tensor]:
    """The distinct tensors of ``target`` that get a gradient; refuse anything that is not a leaf tensor."""
    items = [target] if isinstance(target, Tensor) else list(target)
    if not items:
        raise InvalidValueError("no parameters given (an empty iterable): pass a module or module.parameters()")
    found: dict[int, Tensor] = {}
    for index, item in enumerate(items):
        if not isinstance(item, Tensor):
            hint = (
                " (named_parameters() yields (name, parameter) pairs: pass parameters())"
                if isinstance(item, tuple)
                else ""
            )
            raise InvalidTypeError(
                f"expected an nn.Module or an iterable of parameters; item {index} is a {type(item).__name__}{hint}"
            )
        if not item.is_leaf:
            raise InvalidValueError(
                f"item {index} is a tensor computed from others, not a parameter; to modify the gradient of a "
                "module's output, pass the module"
            )
        if item.requires_grad:
            found.setdefault(id(item), item)
    if not found:
        raise InvalidValueError(f"none of the {len(items)} given tensors requires grad: nothing would be modified")
    return list(found.values())


class _OnOutput(InertInCopies):
    """The forward hook of a module modifier: passes the output's tensors through ``_ChangeGrad``.

    Inert in copies of the model (an EMA or target network, a pickled checkpoint), like every hook
    featurehooks puts on a model it does not own.
    """

    def __init__(self, modifier: GradModifier, change: Callable[[Tensor], Tensor]) -> None:
        self.modifier = modifier
        self.change = change

    def __call__(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not self.modifier.active:
            return None
        leaves, spec = pytree_flatten(output)
        picked = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        if not picked:  # no graph (torch.no_grad, a meta trace) or no floating tensor
            return None
        inputs = {id(t) for t in pytree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        tensors = [leaves[i] for i in picked]
        copy = tuple(t.is_leaf or is_view(t) or id(t) in inputs for t in tensors)
        for i, passed in zip(picked, _ChangeGrad.apply(self.change, copy, *tensors)):
            leaves[i] = passed
        return pytree_unflatten(leaves, spec)


def _install(target: GradTarget, transform: Callable[[Tensor], Tensor], description: str) -> GradModifier:
    """Put ``transform`` on the gradients of ``target`` and return its handle."""
    if not isinstance(target, (nn.Module, Tensor, Iterable)) or isinstance(target, (str, bytes)):
        raise InvalidTypeError(
            f"expected an nn.Module, a parameter or an iterable of parameters, not {type(target).__name__}"
        )
    if isinstance(target, nn.Module) and type(target).forward is nn.Module.forward:
        raise InvalidValueError(
            f"{type(target).__name__} has no forward of its own, so it has no output to modify; pass the modules "
            "it holds, or its .parameters()"
        )
    modifier = GradModifier(description)

    # After remove() they pass gradients through untouched (graphs recorded earlier may still run).
    def change(grad: Tensor) -> Tensor:
        return transform(grad) if modifier.active else grad

    try:
        if isinstance(target, nn.Module):
            modifier._hooks.adopt(target.register_forward_hook(_OnOutput(modifier, change), with_kwargs=True))
        else:
            for parameter in _parameters(target):
                modifier._hooks.hold(parameter, change)
    except BaseException:
        modifier.remove()
        raise
    return modifier


def _describe(target: GradTarget) -> str:
    return type(target).__name__ if isinstance(target, nn.Module) else "parameters"


def scale_grad(target: GradTarget, factor: float) -> GradModifier:
    """Multiply gradients by ``factor``: those flowing back through a module's output, or those of parameters.

    With parameters, ``.grad`` grows by exactly ``factor * grad`` per backward (per-layer learning
    rates without optimizer groups); with a module, everything before its output gets gradients
    as if the loss were scaled for that branch alone. docs/probes.md has the rules for lifetime and order.

    Args:
        target: an ``nn.Module``, one parameter, or an iterable of parameters (``module.parameters()``;
            those with ``requires_grad=False`` are skipped).
        factor: finite real number (0 stops the gradient, negative values flip it).

    Returns:
        A ``GradModifier``: ``remove()`` it, or use it in a ``with`` block.

    Raises:
        InvalidTypeError: ``factor`` not a real number, or ``target`` not a module or parameters.
        InvalidValueError: ``factor`` not finite, no parameter given, or none requires grad.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks.probes import scale_grad
        >>> lin = nn.Linear(3, 1)
        >>> with scale_grad(lin.parameters(), 0.5):
        ...     lin(torch.ones(1, 3)).sum().backward()
        >>> lin.bias.grad
        tensor([0.5000])
    """
    value = _check_factor(factor, "factor")
    return _install(target, lambda grad: grad * value, f"scale_grad({_describe(target)}, factor={value})")


def clip_grad(target: GradTarget, value: float) -> GradModifier:
    """Clamp gradients elementwise to ``[-value, value]``: those through a module's output, or those of parameters.

    Unlike ``torch.nn.utils.clip_grad_value_``, which clips the accumulated ``.grad`` once after
    backward, this clips each backward's gradient where it flows: at a module's output before it
    enters the module, or a parameter's before it is accumulated. NaN stays NaN (as with ``clamp``).

    Args:
        target: an ``nn.Module``, one parameter, or an iterable of parameters.
        value: the largest absolute value a gradient element keeps; finite and > 0.

    Returns:
        A ``GradModifier``: ``remove()`` it, or use it in a ``with`` block.

    Raises:
        InvalidTypeError: ``value`` not a real number, or ``target`` not a module or parameters.
        InvalidValueError: ``value`` not finite or not > 0, no parameter given, or none requires grad.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks.probes import clip_grad
        >>> lin = nn.Linear(3, 1)
        >>> with clip_grad(lin.bias, 0.25):
        ...     lin(torch.ones(1, 3)).sum().backward()
        >>> lin.bias.grad
        tensor([0.2500])
    """
    bound = _check_factor(value, "value")
    if bound <= 0:
        raise InvalidValueError(f"value must be > 0 (gradients are clamped to [-value, value]), not {bound}")
    return _install(target, lambda grad: grad.clamp(-bound, bound), f"clip_grad({_describe(target)}, value={bound})")


def reverse_grad(target: GradTarget, factor: float = 1.0) -> GradModifier:
    """Gradient reversal: multiply gradients by ``-factor`` (Ganin & Lempitsky 2015).

    On the feature extractor of a domain-adversarial network, the domain classifier after it
    learns to tell domains apart while the features before it learn to make them indistinguishable.
    ``factor`` is the paper's lambda, often ramped from 0 to 1 during training (remove the modifier
    and put a new one on to change it).

    Args:
        target: an ``nn.Module`` (usually the feature extractor whose output feeds the domain
            classifier), one parameter, or an iterable of parameters.
        factor: finite and >= 0; other signs are what ``scale_grad`` is for.

    Returns:
        A ``GradModifier``: ``remove()`` it, or use it in a ``with`` block.

    Raises:
        InvalidTypeError: ``factor`` not a real number, or ``target`` not a module or parameters.
        InvalidValueError: ``factor`` negative or not finite, no parameter given, or none requires grad.

    Examples:
        >>> import torch
        >>> from torch import nn
        >>> from featurehooks.probes import reverse_grad
        >>> features, domain = nn.Linear(4, 4), nn.Linear(4, 1)
        >>> with reverse_grad(features, factor=0.3):
        ...     domain(features(torch.ones(1, 4))).sum().backward()

    References:
        Ganin & Lempitsky, "Unsupervised Domain Adaptation by Backpropagation", ICML 2015.
    """
    scale = _check_factor(factor, "factor")
    if scale < 0:
        raise InvalidValueError(
            f"factor must be >= 0 (gradients are multiplied by -factor), not {scale}; use scale_grad for a "
            "factor of any sign"
        )
    negated = -scale
    return _install(target, lambda grad: grad * negated, f"reverse_grad({_describe(target)}, factor={scale})")
