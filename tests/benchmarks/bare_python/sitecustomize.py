"""Makes the test's interpreter look like the GPU machine's bare one (tests/benchmarks/test_run_gpu.py): the top-level
packages named in FH_HIDE (featurehooks, lpips, piq) import only from the folders on PYTHONPATH, never from the
interpreter's own site-packages, as if they were not installed. Python imports this module at start-up when its
folder is on PYTHONPATH."""

import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

_HIDDEN = frozenset(filter(None, os.environ.get("FH_HIDE", "").split(",")))
_ALLOWED = [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]


class _OnlyFromPythonPath:
    """A finder ahead of all others: a hidden package is looked up on PYTHONPATH's folders, or does not exist."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name not in _HIDDEN:
            return None
        spec = PathFinder.find_spec(name, _ALLOWED)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec


sys.meta_path.insert(0, _OnlyFromPythonPath)
