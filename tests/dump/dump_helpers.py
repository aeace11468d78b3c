"""Test helpers shared by the dump tests: turn a finished dump into a killed one, with garbage where it never wrote."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from featurehooks.dump.store import DumpStore


def mark_unfinished(out: Path, committed: Sequence[tuple[int, int, int]]) -> DumpStore:
    """Make the complete dump in ``out`` look like a run killed after the ``(chunk, start, stop)`` commits.

    The manifest says "running", the index is gone and the journal holds only ``committed``. The
    returned store has its arrays open, so a test can scribble over uncommitted rows; close them after.
    """
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "index.csv").unlink()
    store = DumpStore(out)
    store.reset_journal()
    store.open_arrays(manifest["layers"])
    store.open_journal(0)
    for chunk, start, stop in committed:
        store.commit(chunk, start, stop, [])
    store.close_journal()
    return store


def scribble(store: DumpStore, start: int, stop: int, value: float) -> None:
    """Write ``value`` into rows ``start:stop`` of every layer through the open arrays of ``store`` (as
    ``mark_unfinished`` returns it): the garbage of rows a killed run never committed, which a resume must redo."""
    manifest = store.read_manifest()
    assert manifest is not None
    shapes = manifest.settings.shapes
    store.write_rows(start, {layer: np.full((stop - start, *shape[1:]), value) for layer, shape in shapes.items()})
