"""``benchmarks/_load.py``: the background load starts before its block and leaves no process behind, by pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, load_script


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie awaiting its reaper is not: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("kind", ["python", pytest.param("torch", marks=pytest.mark.slow)])
def test_load_runs_during_the_block_and_is_stopped_after(kind: str) -> None:
    load_module = load_script("benchmarks/_load.py")
    with load_module.background(kind) as load:
        pids = load.pids
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
        time.sleep(0.5)
        record = load.record()
    assert record["load"] == kind and record["load_processes"] == 2 and len(record["load_average"]) == 3
    assert record["load_cores_busy"] is None or record["load_cores_busy"] > 0.1  # they were computing
    assert not any(_running(pid) for pid in pids)  # stopped and reaped when the block ended


def test_load_is_stopped_when_the_block_raises() -> None:
    load_module = load_script("benchmarks/_load.py")
    pids: list[int] = []
    with pytest.raises(KeyboardInterrupt), load_module.background("python") as load:
        pids += load.pids
        raise KeyboardInterrupt  # Ctrl-C during a measurement
    assert len(pids) == 2 and not any(_running(pid) for pid in pids)


def test_load_outlives_no_killed_benchmark(tmp_path: Path) -> None:
    # a benchmark killed outright (no cleanup runs) leaves nothing behind: each load process watches its parent
    pids_file = tmp_path / "pids"
    program = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import _load\n"
        "with _load.background('python') as load:\n"
        "    open(sys.argv[2], 'w').write(' '.join(map(str, load.pids)))\n"
        "    time.sleep(60)\n"
    )
    benchmark = subprocess.Popen([sys.executable, "-c", program, str(REPO / "benchmarks"), str(pids_file)])
    try:
        deadline = time.monotonic() + 60
        while not pids_file.exists() or not pids_file.read_text():
            assert benchmark.poll() is None and time.monotonic() < deadline, "the load did not start"
            time.sleep(0.1)
        pids = [int(pid) for pid in pids_file.read_text().split()]
        assert len(pids) == 2 and all(_running(pid) for pid in pids)
    finally:
        benchmark.kill()
        benchmark.wait()
    assert _gone_within(pids, 10.0)


def test_no_load_starts_nothing() -> None:
    load_module = load_script("benchmarks/_load.py")
    with load_module.background("none") as load:
        record = load.record()
    assert load.pids == [] and record["load"] == "none" and record["load_processes"] == 0


def test_load_names_are_checked() -> None:
    load_module = load_script("benchmarks/_load.py")
    assert load_module.parse_loads("none, torch,python,torch") == ["none", "torch", "python"]
    with pytest.raises(SystemExit, match="--load takes a comma-separated subset of none, torch, python, not 'gpu'"):
        load_module.parse_loads("gpu")
    with pytest.raises(SystemExit, match="unknown load 'gpu'"), load_module.background("gpu"):
        pass


def test_load_runs_with_openmp_default_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the benchmark's own short spin waits (GOMP_SPINCOUNT) would make the other jobs lighter than they are
    load_module = load_script("benchmarks/_load.py")
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with load_module.background("python") as load:
        environments = [Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in load.pids]
    for environment in environments:
        names = {entry.split(b"=", 1)[0] for entry in environment}
        assert b"OMP_NUM_THREADS" in names and not names & {b"GOMP_SPINCOUNT", b"OMP_WAIT_POLICY"}
