"""Copies of a user's model that take what its forward needs, and leave the data it merely references in place.

``copy.deepcopy`` copies every tensor a model can reach: a dataset or a trainer kept as an attribute costs
its full size again in each copy. The copies here copy the module structure and every object as deepcopy
does, but the data of tensors only where it is the model's own: parameters and buffers. Every other
tensor is shared with the original (the private copy of ``FeatureExtractor``, which
``.to()`` and ``.half()`` never touch beyond parameters and buffers either), or stood in for by an empty
meta tensor (the copy a meta trace runs on, which carries none of the model's hooks either).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["meta_copy", "private_copy"]

# The hook dicts a module call reads (``nn.Module._call_impl``): a meta copy gets them empty.
_CALL_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class _ReferencedTensors(TorchFunctionMode):
    """While a deepcopy runs in this thread: every plain tensor whose id is not in ``owned`` becomes
    ``replace(tensor)`` instead of a copy of its data. Parameters never get here (their ``__deepcopy__``
    does not dispatch): the caller copies them or puts them in the memo."""

    def __init__(self, owned: Collection[int], replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.owned = owned
        self.replace = replace

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.__deepcopy__ and id(args[0]) not in self.owned:
            return self.replace(args[0])  # deepcopy memoizes it, so each tensor is replaced once
        return func(*args, **(kwargs or {}))


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty meta tensor with the shape, strides and dtype of ``tensor``: no data."""
    return torch.empty_like(tensor, device="meta")


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters, buffers and other tensors are empty meta tensors (no data is copied).

    The trace runs on this copy, never on the caller's model: a forward in another thread at the same
    time sees neither meta weights nor trace hooks, and caches a forward fills stay in the copy.
    Tensors the model only references (a dataset, a trainer's state) become meta tensors too, as do
    cached results of a forward with grad, which ``copy.deepcopy`` cannot copy at all. The copy has no
    forward or backward hooks: the user's hooks are never handed meta tensors, nor copied (with what they hold).
    """
    memo: dict[int, Any] = {
        id(param): nn.Parameter(_meta_like(param), param.requires_grad) for param in model.parameters()
    }
    for module in model.modules():
        for name in _CALL_HOOKS:
            hooks = vars(module).get(name)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
    with _ReferencedTensors((), _meta_like):
        return copy.deepcopy(model, memo)


def private_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its own parameters and buffers, sharing every other tensor with the original.

    Freezing the copy, moving it with ``.to()`` and switching its modules never touch the caller's model,
    and a tensor the model merely references (a dataset kept as an attribute, a trainer's state, a cache
    of the last forward) costs no memory a second time.
    """
    buffers = {id(buffer) for buffer in model.buffers()}
    with _ReferencedTensors(buffers, lambda tensor: tensor):
        return copy.deepcopy(model)
