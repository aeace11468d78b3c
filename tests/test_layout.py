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
    {"errors", "_atomic", "_version"},
    {"_taps", "_layout", "_copy", "_precision"},
    {"_trace", "_hooks", "_formats"},
    {"backbones", "layers"},
    {"extractor", "images", "functional"},
    {"losses", "probes", "viz"},
    {"stream"},
    {"dump", "metrics"},
    {"cli"},
]
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}
FACES = {"__init__", "__main__"}  # the package's public face imports every floor


def unit_of(module: str) -> str:
    """``featurehooks.metrics.lpips`` -> ``metrics``; ``featurehooks.errors`` -> ``errors``."""
    return module.split(".")[1]


def imports(path: Path) -> set[str]:
    """The featurehooks modules ``path`` imports anywhere in it (lazy imports in functions too), absolute names."""
    parts = ["featurehooks", *path.relative_to(PACKAGE).with_suffix("").parts]
    package = parts if path.name == "__init__.py" else parts[:-1]
    package = package[:-1] if path.name == "__init__.py" else package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("featurehooks.")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            if node.module:
                found.add(".".join([*base, node.module]))
            else:  # from . import a, b: each may be a module
                found |= {".".join([*base, alias.name]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("featurehooks."):
            found.add(node.module)
    return {name for name in found if name.count(".") >= 1}


def unit_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        unit = path.relative_to(PACKAGE).with_suffix("").parts[0]
        if unit in FACES:
            continue
        targets = {unit_of(name) for name in imports(path)} - {unit}
        graph.setdefault(unit, set()).update(targets)
    return graph


def test_every_unit_has_a_floor() -> None:
    assert set(unit_graph()) == set(FLOOR), "a new unit of featurehooks needs its floor here and in the README"


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
