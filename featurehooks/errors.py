"""Exceptions featurehooks raises on purpose: each names what was wrong and what would be right.

Every error featurehooks raises on purpose is a ``FeatureHooksError``; each also derives from the
built-in class a Python caller would expect (``ValueError``, ``TypeError``, ``LookupError``,
``FileNotFoundError``, ...), so ``except ValueError`` keeps working. The command line reports a
``FeatureHooksError`` in one line and exits 2 (bad input), or 1 for a ``RunFailedError``; any
other exception is a bug in featurehooks and keeps its traceback.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any


class FeatureHooksError(Exception):
    """Base class of every error featurehooks raises on purpose."""


class InvalidValueError(FeatureHooksError, ValueError):
    """An argument, option or tensor shape that featurehooks does not accept."""


class InvalidTypeError(FeatureHooksError, TypeError):
    """An argument of a type that featurehooks does not accept."""


class LayerNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A requested layer name is neither an alias nor a module path of the backbone."""


class BackboneNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A backbone name is not in the registry (torchvision) or not known to timm."""


class LayerNotRunError(FeatureHooksError, RuntimeError):
    """A requested layer did not run in a forward (a branch that this input or mode does not take)."""


class TraceError(FeatureHooksError, RuntimeError):
    """A model could not run the shape-only forward on the meta device that describes its layers."""


class WeightsUnavailableError(FeatureHooksError, LookupError):
    """Pretrained weights are neither cached nor downloadable, a weights name is unknown, or a file is unusable."""


class MissingDependencyError(FeatureHooksError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


class InputNotFoundError(FeatureHooksError, FileNotFoundError):
    """An input file, folder or glob pattern names nothing that exists."""


class OutputExistsError(FeatureHooksError, FileExistsError):
    """The output folder already holds a dump, and neither resuming nor overwriting it was asked for."""


class RunFailedError(FeatureHooksError, RuntimeError):
    """The work itself failed (another rank, uncommitted chunks), not the input: finish it with resume."""


class NonFiniteError(FeatureHooksError, FloatingPointError):
    """A NaN or infinity appeared: raised by ``detect_nonfinite`` naming the module call where it started.

    ``path``, ``call`` (index of the module's call in the forward), ``phase`` (``"forward"`` or
    ``"backward"``) and ``tensor`` (which tensor: ``"output"``, ``"input"``, ``"grad_input"``, ...) say where.
    """

    def __init__(self, message: str, *, path: str, call: int, phase: str, tensor: str) -> None:
        super().__init__(message)
        self.path = path
        self.call = call
        self.phase = phase
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Pickle with the keyword fields too (``multiprocessing`` sends errors back to the parent)."""
        rebuild = functools.partial(type(self), path=self.path, call=self.call, phase=self.phase, tensor=self.tensor)
        return (rebuild, (str(self),))


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Return the ``n`` candidates closest to ``name``, best first, for did-you-mean messages."""
    candidates = list(dict.fromkeys(candidates))
    found = difflib.get_close_matches(name, candidates, n=n, cutoff=0.0)
    return found


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """Format the closest candidates as ``did you mean 'a', 'b' or 'c'?``."""
    found = closest(name, candidates)
    if not found:
        return ""
    quoted = [repr(c) for c in found]
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"did you mean {listed}?"


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc``, for one-line messages that quote a lower-level error."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
