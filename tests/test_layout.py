"""The package's layout as the README states it: each unit imports only units listed before it (its floor or
below), and no two units import each other, directly or around a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "featurehooks"

# README.md "Layout", bottom up: a unit may import its own floor and the floors before it
FLOORS = [
    {"errors", "_atomic", "_version", "_openmp"},
    {"_taps", "_layout", "_copy", "_precision", "_masks"},
    {"_trace", "_hooks", "_tap_session", "_formats", "_compute", "_inputs", "_outputs"},
    {"backbones", "layers", "_attention_kinds"},
    {"extractor", "_capture", "_intermediates", "images", "_decode", "functional", "attention"},
    {"losses", "probes", "viz"},
    {"_stream"},
    {"dump", "metrics"},
    {"cli"},
]
FACE = "__init__"  # the package's public face imports every floor: above them all
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units} | {FACE: len(FLOORS)}


def is_module(dotted: str) -> bool:
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit_of(name: str) -> str:
    """The unit a dotted import name lives in: ``featurehooks.metrics.lpips`` -> ``metrics``, ``featurehooks.errors``
    -> ``errors``, ``featurehooks.__version__`` (a name of the package, not a module) -> the face."""
    while "." in name and not is_module(name):
        name = name.rpartition(".")[0]
    return name.split(".")[1] if "." in name else FACE


def imports(path: Path) -> set[str]:
    """The featurehooks names ``path`` imports anywhere in it (lazy imports in functions too), absolute."""
    package = ["featurehooks", *path.relative_to(PACKAGE).parts[:-1]]  # the package of a module or __init__.py
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "featurehooks"}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "featurehooks"):
            assert node.level <= len(package), f"{path}:{node.lineno}: a relative import above featurehooks"
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            found |= {f"{module}.{alias.name}" for alias in node.names}  # a module, or a name in one
    return found


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = path.relative_to(PACKAGE).with_suffix("").parts[0]
        if unit in (FACE, "__main__"):  # the package's face and its entry point
            continue
        targets = {unit_of(name) for name in imports(path)} - {unit}
        graph.setdefault(unit, set()).update(targets)
    return graph


def test_every_unit_has_a_floor() -> None:
    assert set(unit_graph()) == set(FLOOR) - {FACE}, "a new unit of featurehooks needs its floor here and in the README"


def test_no_unit_imports_a_floor_above_its_own() -> None:
    upward = sorted(
        (unit, target) for unit, targets in unit_graph().items() for target in targets if FLOOR[target] > FLOOR[unit]
    )
    assert upward == []


def test_no_import_circle() -> None:
    graph = unit_graph()
    done: set[str] = set()

    def visit(unit: str, path: list[str]) -> None:
        if unit in path:
            pytest.fail(f"import circle: {' -> '.join([*path[path.index(unit) :], unit])}")
        if unit in done:
            return
        for target in sorted(graph.get(unit, ())):
            visit(target, [*path, unit])
        done.add(unit)

    for unit in sorted(graph):
        visit(unit, [])
