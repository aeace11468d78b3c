"""Exceptions featurehooks raises on purpose: each names what was wrong and what would be right.

Every error featurehooks raises on purpose is a ``FeatureHooksError``; each also derives from the
built-in class a Python caller would expect (``ValueError``, ``TypeError``, ``LookupError``,
``FileNotFoundError``, ...), so ``except ValueError`` keeps working. The command line reports a
``FeatureHooksError`` in one line and exits 2 (bad input), or 1 for a ``RunFailedError``; any
other exception is a bug in featurehooks and keeps its traceback. ``NoSpaceError``, a full disk, is a failure of
the machine rather than of the input: an ``OSError`` only (exit 1).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from typing import Any


class FeatureHooksError(Exception):
    """Base class of every error featurehooks raises on purpose.

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> try:
        ...     fh.FeatureExtractor(torch.nn.Sequential(torch.nn.ReLU()), ["relu9"])
        ... except fh.FeatureHooksError as error:  # the user's input, not a bug: show the one line
        ...     message = f"{type(error).__name__}: {error}"
        >>> message
        "LayerNotFoundError: unknown layer 'relu9' for Sequential; did you mean '0'? ..."
    """


class InvalidValueError(FeatureHooksError, ValueError):
    """An argument, option or tensor shape that featurehooks does not accept.

    Examples:
        >>> import torch
        >>> from featurehooks.functional import gram_matrix
        >>> gram_matrix(torch.ones(3, 4))
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: features must have shape (B, C, H, W) or (B, C, N), got (3, 4)
        >>> from featurehooks.errors import InvalidValueError
        >>> issubclass(InvalidValueError, ValueError)  # ``except ValueError`` catches it too
        True
    """


class InvalidTypeError(FeatureHooksError, TypeError):
    """An argument of a type that featurehooks does not accept.

    Examples:
        >>> import featurehooks as fh
        >>> fh.load_backbone(3)
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidTypeError: backbone must be a model name or an nn.Module, not int
        >>> issubclass(fh.InvalidTypeError, TypeError)
        True
    """


class LayerNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A requested layer name is neither an alias nor a module path of the backbone.

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
        >>> fh.FeatureExtractor(net, ["2"])
        Traceback (most recent call last):
        ...
        featurehooks.errors.LayerNotFoundError: unknown layer '2' for Sequential; did you mean '1' or '0'? ...
    """


class BackboneNotFoundError(FeatureHooksError, LookupError, ValueError):
    """A backbone name is not in the registry (torchvision) or not known to timm.

    Examples:
        >>> import featurehooks as fh
        >>> fh.list_layers("vgg17")
        Traceback (most recent call last):
        ...
        featurehooks.errors.BackboneNotFoundError: unknown backbone 'vgg17'; did you mean 'vgg19', 'vgg16' or ...? ...
    """


class LayerNotRunError(FeatureHooksError, RuntimeError):
    """A requested layer did not run in a forward (a branch that this input or mode does not take).

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> class Branchy(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem, self.head = torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(4, 4, 3)
        ...
        ...     def forward(self, x):
        ...         x = self.stem(x)
        ...         return self.head(x) if x.shape[-1] >= 3 else x  # small images skip the head
        >>> ext = fh.FeatureExtractor(Branchy(), ["head"])
        >>> ext(torch.rand(1, 3, 2, 2))
        Traceback (most recent call last):
        ...
        featurehooks.errors.LayerNotRunError: requested layers never ran in the forward pass: head
    """


class TraceError(FeatureHooksError, RuntimeError):
    """A model could not run the shape-only forward on the meta device that describes its layers.

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> fh.list_layers(torch.nn.Linear(3, 2))  # it takes vectors, not images
        Traceback (most recent call last):
        ...
        featurehooks.errors.TraceError: cannot list the layers of Linear: a shape-only forward of a 224x224 image ...
    """


class WeightsUnavailableError(FeatureHooksError, LookupError):
    """Pretrained weights are neither cached nor downloadable, a weights name is unknown, or a file is unusable.

    Examples:
        >>> import featurehooks as fh
        >>> fh.load_backbone("vgg16", weights="IMAGENET9")
        Traceback (most recent call last):
        ...
        featurehooks.errors.WeightsUnavailableError: unknown weights 'IMAGENET9' for vgg16; choose one of ...
    """


class MissingDependencyError(FeatureHooksError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    Examples:
        >>> from featurehooks.errors import MissingDependencyError
        >>> try:  # what a model name such as "timm/resnet50" raises without timm installed
        ...     raise MissingDependencyError("timm models need timm: pip install 'featurehooks[timm]'")
        ... except ImportError as error:  # it is an ImportError
        ...     print(error)
        timm models need timm: pip install 'featurehooks[timm]'
    """


class InputNotFoundError(FeatureHooksError, FileNotFoundError):
    """An input file, folder or glob pattern names nothing that exists.

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> ext = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> fh.dump_features(ext, "no/such/folder", "out")
        Traceback (most recent call last):
        ...
        featurehooks.errors.InputNotFoundError: no such file or folder: no/such/folder
        >>> issubclass(fh.InputNotFoundError, FileNotFoundError)
        True
    """


class OutputExistsError(FeatureHooksError, FileExistsError):
    """The output folder already holds a dump, and neither resuming nor overwriting it was asked for.

    Examples:
        >>> import tempfile, torch
        >>> import featurehooks as fh
        >>> ext = fh.FeatureExtractor(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), ["0"])
        >>> images, out = torch.rand(2, 3, 8, 8), tempfile.mkdtemp()
        >>> fh.dump_features(ext, images, out, progress=False).num_rows
        2
        >>> fh.dump_features(ext, images, out, progress=False)
        Traceback (most recent call last):
        ...
        featurehooks.errors.OutputExistsError: ... already holds a complete dump (2 rows); pass overwrite=True ...
    """


class RunFailedError(FeatureHooksError, RuntimeError):
    """The work itself failed (another rank, uncommitted chunks), not the input: finish it with resume.

    Examples:
        >>> from featurehooks.errors import FeatureHooksError, RunFailedError
        >>> issubclass(RunFailedError, FeatureHooksError), issubclass(RunFailedError, RuntimeError)
        (True, True)
        >>> # ``featurehooks extract`` reports it in one line and exits 1 (bad input exits 2)
    """


class NonFiniteError(FeatureHooksError, FloatingPointError):
    """A NaN or infinity appeared: raised by ``detect_nonfinite`` naming the module call where it started.

    ``path``, ``call`` (index of the module's call in the forward), ``phase`` (``"forward"`` or
    ``"backward"``) and ``tensor`` (which tensor: ``"output"``, ``"input"``, ``"grad_input"``, ...) say where.

    Examples:
        >>> import torch
        >>> import featurehooks as fh
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> with torch.no_grad():
        ...     net[0].bias[0] = float("inf")
        >>> try:
        ...     with fh.detect_nonfinite(net):
        ...         net(torch.ones(1, 2))
        ... except fh.NonFiniteError as error:
        ...     found = (error.path, error.call, error.phase, error.tensor)
        >>> found
        ('0', 0, 'forward', 'output')
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


class CorruptDumpError(FeatureHooksError, ValueError):
    """``manifest.json`` or the journal of a dump is inconsistent: edited by hand, or left by another dump.

    Examples:
        >>> import pathlib, tempfile
        >>> import featurehooks as fh
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (out / "manifest.json").write_text("[1, 2]")
        >>> fh.read_manifest(out)
        Traceback (most recent call last):
        ...
        featurehooks.errors.CorruptDumpError: .../manifest.json is not a featurehooks dump manifest; ...
    """


class DumpLockedError(FeatureHooksError, OSError):
    """Another process is writing a dump into the same folder (its pid and host are in the message).

    Examples:
        >>> from featurehooks import DumpLockedError, FeatureHooksError
        >>> issubclass(DumpLockedError, FeatureHooksError), issubclass(DumpLockedError, OSError)
        (True, True)
        >>> # two ``dump_features`` into one folder at once: the second raises it, and wrote nothing
    """


class NoSpaceError(OSError):
    """The output's filesystem has no room for what a dump must write (``errno.ENOSPC``).

    A failure of the machine, not of the input, hence not a ``FeatureHooksError`` (the CLI exits 1, not 2).
    Nothing is left half-written: free space and run the dump again (``resume=True`` finishes a started one).

    Examples:
        >>> import errno
        >>> from featurehooks import FeatureHooksError, NoSpaceError
        >>> issubclass(NoSpaceError, OSError), issubclass(NoSpaceError, FeatureHooksError)
        (True, False)
        >>> NoSpaceError(errno.ENOSPC, "no space left for layer4.npy").errno == errno.ENOSPC
        True
    """


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
