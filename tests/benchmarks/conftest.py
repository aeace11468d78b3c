"""What the tests of the benchmark scripts share: undoing what a script sets globally."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def restore_global_state() -> Iterator[None]:
    """The scripts seed torch, set threads and extend sys.path; leave the rest of the session as it was."""
    threads, rng, path = torch.get_num_threads(), torch.random.get_rng_state(), list(sys.path)
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)
    sys.path[:] = path
