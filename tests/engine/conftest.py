"""What only the engine's tests share: a counter of the clones a forward makes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode


class Clones(TorchFunctionMode):
    """Counts the clones of real tensors made while it is on: around a forward of a model that clones nothing
    itself, one per tap the session clones (``with Clones() as clones: ...``, then ``clones.count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.clone and not args[0].is_meta:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_clones() -> Callable[[], Clones]:
    """A fresh ``Clones`` counter per ``with`` block."""
    return Clones
