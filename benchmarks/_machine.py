"""The machine a benchmark ran on, for every results JSON and the *Machine* line of its Markdown: hardware, the
precisions featurehooks runs there, library versions, the commit of the library code the run imported."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

LIBRARIES = ("featurehooks", "torch", "torchvision", "timm", "lpips", "piq", "numpy", "matplotlib")
REDUCED = ("bf16", "fp16")  # featurehooks' precisions below float32: contenders where the device runs them


def reduced_precisions(device: torch.device) -> list[str]:
    """The precisions below float32 that featurehooks runs on ``device`` (``check_device`` refuses the others,
    which it would run slower than float32): each gets its contenders beside the float32 ones."""
    from featurehooks._precision import check_device
    from featurehooks.errors import InvalidValueError

    found = []
    for precision in REDUCED:
        with contextlib.suppress(InvalidValueError):
            check_device(precision, device)
            found.append(precision)
    return found


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine make timings noisy."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(v, 2) for v in os.getloadavg()]
    return None


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        pass
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - an optional library may be missing or broken
        return None
    return str(getattr(mod, "__version__", "unknown"))


_COMMIT_AT_START: list[str | None] = []


def record_commit() -> None:
    """Remember the commit the run starts from (the library code it imported): :func:`machine` reports that one."""
    _COMMIT_AT_START[:] = [_git_commit()]


def _git_commit() -> str | None:
    """The commit the run started from (``+dirty`` if featurehooks/ had uncommitted changes then)."""
    if _COMMIT_AT_START:
        return _COMMIT_AT_START[0]
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, cwd=here
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "../featurehooks"],
            capture_output=True,
            text=True,
            check=True,
            cwd=here,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head or None


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cpu_isa() -> str:
    """The vector instructions torch's CPU kernels use (``AVX2``, ``AVX512``, ...), and ``+BF16``/``+FP16`` for each
    precision featurehooks runs on this CPU: two EPYCs of one name differ there, and so do their timings."""
    native = "".join(f"+{precision.upper()}" for precision in reduced_precisions(torch.device("cpu")))
    return torch.backends.cpu.get_cpu_capability() + native


def machine(device: torch.device) -> dict[str, Any]:
    """Hardware, threads and library versions, for the JSON and the Markdown header."""
    info: dict[str, Any] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_isa": _cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "git_commit": _git_commit(),
        "load_average_at_end": loadavg(),
        "versions": {name: _version(name) for name in LIBRARIES},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = torch.backends.cudnn.version()
    return info


def machine_line(info: dict[str, Any]) -> str:
    isa = f"{info['cpu_isa']}, " if "cpu_isa" in info else ""  # results saved before it was recorded lack it
    hw = info.get("gpu") or f"{info['cpu']} ({isa}{info['cpu_count']} cores, {info['torch_threads']} torch threads)"
    v = info["versions"]
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", "torchvision", "timm", "lpips", "piq") if v.get(k))
    return f"{hw}; {libs}; featurehooks {v.get('featurehooks')} @ {info.get('git_commit')}; {info['date_utc']}"
