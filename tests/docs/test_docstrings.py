"""Every public name has a docstring with an example, and every example runs as written.

The public names are those in ``__all__`` of the modules the API reference documents (``PUBLIC_MODULES``,
the pages under docs/api/), and the exception classes of ``featurehooks.errors``, which has no ``__all__``.
``featurehooks._stream`` is private: it is the input pipeline that dumps, metrics and the CLI share, and
the names a user needs from it (``list_images``, ``IMAGE_SUFFIXES``) are ``featurehooks.dump``'s too.

An example runs in a fresh, empty namespace, as a reader who copies it would run it: it imports what it
uses. It runs offline (random weights: ``weights=None`` or a small ``nn.Module``). Constants and type
aliases carry their docstring as a string after the assignment (which Python drops and griffe, the
reference's reader, keeps), so their examples are read and parsed from the source by griffe.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

PUBLIC_MODULES = (
    "featurehooks",
    "featurehooks.losses",
    "featurehooks.functional",
    "featurehooks.metrics",
    "featurehooks.probes",
    "featurehooks.dump",
    "featurehooks.images",
    "featurehooks.layers",
    "featurehooks.backbones",
    "featurehooks.viz",
    "featurehooks.errors",
)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _exported(module: ModuleType) -> list[str]:
    """``__all__``, or for ``featurehooks.errors`` (no ``__all__``) the exception classes it defines."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__
    ]


def _has_own_doc(value: Any) -> bool:
    """Whether Python keeps the docstring on the object (functions, classes, modules), not only in the source."""
    return inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value)


def public_names() -> list[str]:
    """``module.name`` of each public object, once: a name exported by several modules keeps its first one."""
    names: list[str] = []
    seen: set[int] = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in _exported(module):
            value = getattr(module, name)
            if _has_own_doc(value):
                if id(value) in seen:
                    continue
                seen.add(id(value))
            names.append(f"{module_name}.{name}")
    return names


NAMES = public_names()


def _resolve(qualified: str) -> Any:
    module_name, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


_GRIFFE: dict[str, Any] = {}


def _source_docstring(qualified: str) -> tuple[str, str, int]:
    """The docstring griffe reads from the source after a constant's or type alias's assignment, its file and line."""
    import griffe

    if "package" not in _GRIFFE:
        _GRIFFE["package"] = griffe.load("featurehooks", resolve_aliases=True, resolve_external=False)
    found = _GRIFFE["package"][qualified.removeprefix("featurehooks.")]
    docstring = found.docstring
    if docstring is None:
        return "", str(found.filepath), found.lineno or 0
    return docstring.value, str(found.filepath), docstring.lineno or 0


def _doctests(qualified: str) -> list[doctest.DocTest]:
    value = _resolve(qualified)
    if _has_own_doc(value):
        # a class's methods count (their examples run too); a module's members are public names of their own
        finder = doctest.DocTestFinder(recurse=not inspect.ismodule(value))
        return [test for test in finder.find(value, qualified, globs={}) if test.examples]
    text, filename, lineno = _source_docstring(qualified)
    test = doctest.DocTestParser().get_doctest(text, {}, qualified, filename, lineno)
    return [test] if test.examples else []


@pytest.mark.parametrize("qualified", NAMES)
def test_public_name_has_an_example(qualified: str) -> None:
    value = _resolve(qualified)
    text = (inspect.getdoc(value) or "") if _has_own_doc(value) else _source_docstring(qualified)[0]
    assert text.strip(), f"{qualified} has no docstring"
    assert ">>>" in text, f"{qualified}'s docstring has no example (an Examples: section with >>> lines)"
    assert "+SKIP" not in text, f"{qualified}: an example that is skipped does not show that it runs"
    assert "\nExample:" not in f"\n{text}", f"{qualified}: write 'Examples:', the section griffe renders as code"


@pytest.mark.slow  # 110 examples, 13 of them build a VGG: about 35 s of CPU in all
@pytest.mark.parametrize("qualified", NAMES)
def test_examples_run(qualified: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what examples write with tempfile lands here
    tests = _doctests(qualified)
    assert tests, f"{qualified} has no example to run"
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in tests:
        runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()
