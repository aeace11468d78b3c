"""The timing harness shared by the benchmark scripts: their shared options, the same work for every contender,
and the timing.

Every script answers one question by timing *contenders* (zero-argument callables that do the same
work in different ways) side by side in one process:

- warm-up calls first (which also check that contenders agree on their outputs),
- then interleaved repetitions ``A B C A B C ...`` (the order rotates each round, so no contender
  always runs right after the same neighbour), with ``torch.cuda.synchronize()`` around each sample
  on a GPU,
- medians and quartiles per contender, and ratios of medians taken from the same run.

The seeded weights every contender runs are in ``_weights.py``; the results (JSON, Markdown, charts) in
``_report.py``; the machine they record in ``_machine.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from _machine import record_commit

RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0


# --------------------------------------------------------------------------------------------------
# command line and settings


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark script shares."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (cuda adds bf16 autocast + channels_last runs)")
    p.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions: checks the script, not speed")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores; 1 if --quick)")
    p.add_argument("--budget", type=float, default=None, help="seconds of timed repetitions per table row group")
    p.add_argument("--min-reps", type=int, default=None, help="fewest interleaved rounds per group")
    p.add_argument("--max-reps", type=int, default=None, help="most interleaved rounds per group")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per contender before timing")
    p.add_argument("--torch-home", default=None, help="TORCH_HOME with (or for) seeded weights; default: a temp dir")
    p.add_argument("--out", default=str(RESULTS), help="folder for the .json, .md and .png results")
    p.add_argument("--tag", default="", help="suffix for the result file names (e.g. _cuda)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument(
        "--autocast",
        default=None,
        help="comma-separated autocast groups, fp32 (none) and bf16 (default: fp32 on the CPU, fp32,bf16 on cuda)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: time.perf_counter; cpu: time.process_time, which leaves out time the process waits "
        "for a core (for a shared CPU machine; use with --threads 1). Both are recorded.",
    )
    return p


@dataclass
class Settings:
    """Resolved run settings (defaults depend on --device and --quick)."""

    device: torch.device
    quick: bool
    budget: float
    min_reps: int
    max_reps: int
    warmup: int
    out: Path
    tag: str
    plot: bool
    command: str
    threads: int
    clock: str = "wall"
    autocasts: tuple[str, ...] = ("fp32",)  # the groups' autocast: fp32 (none), bf16

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def timing_config(self) -> dict[str, Any]:
        """The timing settings a results ``config`` records, so a reader sees how many rounds each number had."""
        return {"budget_s": self.budget, "min_reps": self.min_reps, "max_reps": self.max_reps, "warmup": self.warmup}


def settings(args: argparse.Namespace, *, budget: float, quick_budget: float = 0.0) -> Settings:
    """Apply the shared options: threads, seeds, device checks; fill defaults by device and mode."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was given but torch.cuda.is_available() is False")
    threads = args.threads or (1 if args.quick else None)  # one thread: robust next to a parallel test run
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(SEED)
    record_commit()  # the library code this run imported
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows stay fp32 for every contender alike
        torch.backends.cudnn.allow_tf32 = False
    if args.quick:
        defaults = {"budget": quick_budget, "min_reps": 2, "max_reps": 2, "warmup": 1}
    else:
        defaults = {"budget": budget, "min_reps": 5, "max_reps": 60 if device.type == "cuda" else 25, "warmup": 2}
    pick = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    return Settings(
        device=device,
        quick=args.quick,
        budget=pick["budget"],
        min_reps=pick["min_reps"],
        max_reps=pick["max_reps"],
        warmup=pick["warmup"],
        out=Path(args.out),
        tag=args.tag,
        plot=not args.no_plot,
        command=" ".join(["python", *[_rel(a) for a in sys.argv]]),
        threads=torch.get_num_threads(),
        clock="wall" if device.type == "cuda" else args.clock,
        autocasts=_autocasts(args.autocast, device),
    )


def _autocasts(given: str | None, device: torch.device) -> tuple[str, ...]:
    names = tuple(given.split(",")) if given else ("fp32", "bf16") if device.type == "cuda" else ("fp32",)
    unknown = set(names) - {"fp32", "bf16"}
    if unknown:
        raise SystemExit(f"--autocast takes fp32 and bf16, not {', '.join(sorted(unknown))}")
    return names


def _rel(arg: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(arg).resolve().relative_to(Path.cwd()))
    return arg


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x224,4x112"`` -> ``[(1, 224), (4, 112)]`` (batch, square image size)."""
    shapes = []
    for item in text.split(","):
        try:
            batch, size = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"bad shape {item!r}: write BATCHxSIZE, e.g. 4x224") from None
        shapes.append((batch, size))
    return shapes


@dataclass(frozen=True)
class Shapes:
    """A script's ``--shapes`` option: its default ``BATCHxSIZE`` lists with --quick, on the CPU and on CUDA."""

    quick: str
    cpu: str
    cuda: str

    def add_option(self, p: argparse.ArgumentParser) -> None:
        """Add ``--shapes``, its help naming the defaults."""
        p.add_argument("--shapes", default=None, help=f"BATCHxSIZE list; default {self.cpu} (CPU), {self.cuda} (cuda)")

    def parse(self, given: str | None, cfg: Settings) -> list[tuple[int, int]]:
        """The shapes given, or the default for the mode and device."""
        if given is None:
            given = self.quick if cfg.quick else (self.cuda if cfg.cuda else self.cpu)
        return parse_shapes(given)


def precisions(cfg: Settings) -> list[str]:
    """The groups' autocast (``--autocast``): ``fp32`` (none) everywhere by default, on CUDA also ``bf16``."""
    return list(cfg.autocasts)


# --------------------------------------------------------------------------------------------------
# the same work for every contender


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``"bf16"``, nothing for ``"fp32"``."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def images(batch: int, size: int, cfg: Settings, precision: str, *, seed: int = SEED) -> torch.Tensor:
    """Seeded images in [0, 1] on the device; channels_last under ``bf16``."""
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed)).to(cfg.device)
    return x.contiguous(memory_format=torch.channels_last) if precision == "bf16" else x


def truncated_forward(blocks: nn.Sequential | nn.ModuleList, x: Tensor, taps: Collection[int]) -> list[Tensor]:
    """Run ``blocks[0]``, ``blocks[1]``, ... up to the last index in ``taps``, keeping the outputs at ``taps``.

    The loop a user writes by hand over ``model.features`` (or a model's stages): the floor contenders run it.
    """
    out = []
    for i in range(max(taps) + 1):
        x = blocks[i](x)
        if i in taps:
            out.append(x)
    return out


def release_memory() -> None:
    """Collect garbage and hand cached CUDA blocks back, so the next case starts from a clean slate."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# timing


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call of every contender, from one interleaved run (``other``: the other clock)."""

    samples: dict[str, list[float]]
    rounds: int
    calls_per_sample: int
    clock: str = "wall"
    other: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def quartiles(self, name: str) -> tuple[float, float]:
        values = sorted(self.samples[name])
        if len(values) < 4:
            return values[0], values[-1]
        q = statistics.quantiles(values, n=4)
        return q[0], q[2]


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of ``fn`` (no warm-up: for calls that start a fresh process each time)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_interleaved(
    contenders: dict[str, Callable[[], Any]],
    cfg: Settings,
    *,
    budget: float | None = None,
    min_sample_s: float = 0.0,
) -> Timing:
    """Warm up, then time ``A B C A B C ...`` rounds until ``budget`` seconds (within min/max reps).

    On a GPU each sample is fenced by ``torch.cuda.synchronize()``; calls shorter than
    ``min_sample_s`` are repeated inside one sample (the same count for every contender).
    """
    names = list(contenders)
    warm: dict[str, float] = {}
    for name in names:
        for _ in range(max(cfg.warmup, 1)):
            sync(cfg.device)
            start = time.perf_counter()
            contenders[name]()
            sync(cfg.device)
            warm[name] = time.perf_counter() - start
    fastest = min(warm.values())
    inner = max(1, math.ceil(min_sample_s / max(fastest, 1e-6))) if min_sample_s else 1
    round_s = sum(warm.values()) * inner
    budget = cfg.budget if budget is None else budget
    reps = int(min(cfg.max_reps, max(cfg.min_reps, budget // max(round_s, 1e-9))))
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn = contenders[name]
            sync(cfg.device)
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(inner):
                fn()
            sync(cfg.device)
            wall[name].append((time.perf_counter() - start) / inner)
            cpu[name].append((time.process_time() - start_cpu) / inner)
    if cfg.clock == "cpu":
        return Timing(cpu, reps, inner, "cpu", wall)
    return Timing(wall, reps, inner, "wall", cpu)


def peak_memory(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated during one call of ``fn`` above what was allocated before it.

    CUDA: the caching allocator's peak. CPU: the running sum of the profiler's allocation events.
    """
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        sync(device)
        del result
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        current += event.nbytes()
        peak = max(peak, current)
    return int(peak)


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two tensors or equal-length sequences/dicts of tensors."""
    if isinstance(a, dict):
        a = list(a.values())
    if isinstance(b, dict):
        b = list(b.values())
    if isinstance(a, torch.Tensor):
        a = [a]
    if isinstance(b, torch.Tensor):
        b = [b]
    if len(a) != len(b):
        raise ValueError(f"contenders returned {len(a)} and {len(b)} outputs")
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise ValueError(f"contenders disagree on shape: {tuple(x.shape)} vs {tuple(y.shape)}")
        worst = max(worst, float((x.detach().float() - y.detach().float()).abs().max()))
    return worst


def max_rel_diff(a: Any, reference: Any) -> float:
    """Largest ``max|a - reference| / max|reference|`` over the outputs (0 where the reference is all zeros).

    Memory formats sum in another order: channels-last outputs differ from NCHW ones at float32 rounding,
    which is ~1e-6 of the values' scale whatever that scale is; this is the number to hold to a bound.
    """
    a, reference = (
        list(v.values()) if isinstance(v, dict) else [v] if isinstance(v, torch.Tensor) else list(v)
        for v in (a, reference)
    )
    if len(a) != len(reference):
        raise ValueError(f"contenders returned {len(a)} and {len(reference)} outputs")
    worst = 0.0
    for x, y in zip(a, reference):
        scale = float(y.detach().float().abs().max()) if y.numel() else 0.0
        if scale > 0:
            worst = max(worst, max_abs_diff(x, y) / scale)
    return worst


def log(message: str) -> None:
    """Progress to stderr (stdout stays free for the Markdown)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
