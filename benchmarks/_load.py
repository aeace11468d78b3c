"""Background load for the benchmarks that ask how featurehooks fares on a busy machine (issue 39).

``background("torch")`` runs two other processes doing multi-threaded torch convolutions without pause, as other
PyTorch jobs on a shared node do; ``background("python")`` two busy pure-Python loops; ``background("none")``
nothing. The processes start (and are computing) before the block and are stopped after it, also on an exception
or Ctrl-C; each also exits by itself within a fraction of a second once the process that started it is gone (even
killed), so none is ever left behind. :meth:`Load.record` says what ran and how busy it kept the cores.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from _machine import loadavg

LOADS = ("none", "torch", "python")
PROCESSES = 2  # background processes per load
READY_S = 300.0  # the longest a load process may take to start computing (torch's import on a busy machine)
STOP_S = 10.0  # the longest a load process may take to exit on SIGTERM before it is killed
QUICK_NICENESS = 19  # the load of a quick run: the lowest priority
OPENMP_WAITS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # a load never inherits these: other jobs wait as OpenMP's default

# Each program takes the pid of the process that started it and stops once that process is gone (its parent
# changes), so a parent killed without cleanup leaves nothing running. "ready" says the work has begun.
PROGRAMS = {
    "torch": """
import os, sys
import torch
parent = int(sys.argv[1])
torch.set_num_threads(int(sys.argv[2]))
conv = torch.nn.Conv2d(64, 64, 3, padding=1)
x = torch.randn(8, 64, 56, 56)
with torch.no_grad():
    conv(x)
    print("ready", flush=True)
    while os.getppid() == parent:
        conv(x)
""",
    "python": """
import os, sys
parent = int(sys.argv[1])
print("ready", flush=True)
while os.getppid() == parent:
    total = 0
    for i in range(100_000):
        total += i * i
""",
}


NOTE = (
    "*load* (params): the background load a group ran under: none (quiet), torch (two processes of multi-threaded "
    "torch convolutions), python (two busy pure-Python processes), started before and stopped after the group; "
    "*load average* the 1/5/15-minute load average at the group's end; *load cores busy* the cores the load "
    "processes kept busy during it (their CPU seconds over the wall seconds)."
)
"""The results' note on what a row's load fields say."""
COLUMNS = [("load_average", "load average", ""), ("load_cores_busy", "load cores busy", ".2f")]
"""The results' table columns of a row's load fields (``Load.record``)."""


def parse_loads(text: str) -> list[str]:
    """``"none,torch"`` -> ``["none", "torch"]``; a clear error for any other name."""
    loads = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in loads if name not in LOADS]
    if unknown or not loads:
        raise SystemExit(f"--load takes a comma-separated subset of {', '.join(LOADS)}, not {text!r}")
    return list(dict.fromkeys(loads))


def load_option_help() -> str:
    """The ``--load`` help text the scripts share."""
    return (
        "background loads to measure under, comma-separated: none (quiet), torch (two processes running "
        "multi-threaded torch convolutions), python (two busy pure-Python processes)"
    )


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used so far (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


@dataclass
class Load:
    """The running background processes of one load (none for ``"none"``) and when they began to compute."""

    kind: str
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    cpu_at_start: float | None = 0.0

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def cpu_seconds(self) -> float | None:
        """CPU seconds the load processes have used so far, together (None where it cannot be read)."""
        used = [_cpu_seconds(pid) for pid in self.pids]
        return None if None in used else sum(u for u in used if u is not None)

    def record(self) -> dict[str, Any]:
        """What a result row records: the load, its processes, the load average now (1, 5, 15 minutes) and the
        cores the load kept busy since it began (its CPU seconds over the wall seconds; None where unknown)."""
        now, wall = self.cpu_seconds(), time.perf_counter() - self.started
        busy = None if now is None or self.cpu_at_start is None else (now - self.cpu_at_start) / max(wall, 1e-9)
        return {
            "load": self.kind,
            "load_processes": len(self.processes),
            "load_average": loadavg(),
            "load_cores_busy": None if busy is None else round(busy, 2),
        }


def _threads() -> int:
    """Threads of one torch load process: every core this process may run on (other jobs' torch default)."""
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _start(kind: str, log: IO[str], niceness: int) -> subprocess.Popen[str]:
    """One load process in a session of its own (Ctrl-C at the terminal reaches only the benchmark, which stops it),
    at ``niceness`` (0: as the benchmark's own), with GNU OpenMP's default waits whatever the benchmark's are."""
    env = {key: value for key, value in os.environ.items() if key not in OPENMP_WAITS}
    env.update(OMP_NUM_THREADS=str(_threads()), PYTHONWARNINGS="ignore")
    process = subprocess.Popen(
        [sys.executable, "-c", PROGRAMS[kind], str(os.getpid()), str(_threads())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        start_new_session=True,
    )
    if niceness:
        os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
    return process


def _wait_ready(processes: list[subprocess.Popen[str]], log: IO[str], timeout: float) -> None:
    """Wait until every process has printed "ready"; a clear error naming the load's own error if one exits."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for process in processes:
            assert process.stdout is not None
            selector.register(process.stdout, selectors.EVENT_READ, process)
        waiting = len(processes)
        while waiting:
            events = selector.select(max(deadline - time.monotonic(), 0.0))
            if not events:
                raise SystemExit(f"the background load did not start within {timeout:g} s")
            for key, _ in events:
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if line.strip() != "ready":
                    log.seek(0)
                    raise SystemExit(f"a background load process exited before it started:\n{log.read()[-2000:]}")
                selector.unregister(key.fileobj)
                waiting -= 1


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    """SIGTERM every process, then SIGKILL any still running after ``STOP_S``; reap them all."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@contextlib.contextmanager
def background(kind: str, *, quick: bool = False) -> Iterator[Load]:
    """Run ``PROCESSES`` load processes of ``kind`` (one of ``LOADS``) for the duration of the block.

    They are computing when the block starts and stopped (and reaped) when it ends, however it ends. ``quick``
    (a benchmark's ``--quick``: the script checked, not its speed) runs them at the lowest priority, so that they
    take no CPU from anything else running, such as the other tests of a suite.
    """
    if kind not in LOADS:
        raise SystemExit(f"unknown load {kind!r}: one of {', '.join(LOADS)}")
    if kind == "none":
        yield Load(kind)
        return
    started: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryFile("w+") as log:
        try:
            for _ in range(PROCESSES):
                started.append(_start(kind, log, QUICK_NICENESS if quick else 0))
            _wait_ready(started, log, READY_S)
            load = Load(kind, started)
            load.cpu_at_start = load.cpu_seconds()
            yield load
        finally:
            _stop(started)
