"""What the tests of the benchmark scripts share: loading a script by path, and undoing what it sets globally."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (registered in ``sys.modules``: dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"_fh_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def restore_global_state() -> Iterator[None]:
    """The scripts seed torch, set threads and extend sys.path; leave the rest of the session as it was."""
    threads, rng, path = torch.get_num_threads(), torch.random.get_rng_state(), list(sys.path)
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)
    sys.path[:] = path
