"""Test helper shared by the dump fault and distributed tests: turn a finished dump into a killed one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

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
