"""The timing harness shared by the benchmark scripts.

Every script answers one question by timing *contenders* (zero-argument callables that do the same
work in different ways) side by side in one process:

- warm-up calls first (which also check that contenders agree on their outputs),
- then interleaved repetitions ``A B C A B C ...`` (the order rotates each round, so no contender
  always runs right after the same neighbour), with ``torch.cuda.synchronize()`` around each sample
  on a GPU,
- medians and quartiles per contender, and ratios of medians taken from the same run.

Results go to ``benchmarks/results/<name>.json`` (with the machine and library versions),
``<name>.md`` (a Markdown table) and ``<name>.png`` (a bar chart of the ratios).

Weights: contenders must run the same weights. :func:`seeded_torch_home` points ``TORCH_HOME`` at a
folder (a fresh temporary one unless given) and :func:`seeded_hub_weights` writes seeded random
torchvision weights where ``weights="DEFAULT"``, lpips and piq look for them, with the recipe of
``tests/conftest.py``. Your own ``~/.cache/torch`` is never written to.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

CLOCKS = {
    "wall": "wall time (time.perf_counter)",
    "cpu": "process CPU time (time.process_time; the wall-clock ratio is in the *wall ratio* column)",
}
RESULTS = Path(__file__).resolve().parent / "results"
# extra_columns (row.extra key, header, format) that several scripts show
FORMAT_COLUMN = ("format", "format", "")  # the memory format a contender's backbone ran in
ABS_DIFF_COLUMN = ("max_abs_diff", "max abs diff", ".1e")  # its outputs against the reference's
REL_DIFF_COLUMN = ("max_rel_diff", "max rel diff", ".1e")
SEED = 0
LIBRARIES = ("featurehooks", "torch", "torchvision", "timm", "lpips", "piq", "numpy", "matplotlib")


# --------------------------------------------------------------------------------------------------
# command line and environment


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
    _COMMIT_AT_START[:] = [_git_commit()]  # the library code this run imported
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


@contextlib.contextmanager
def seeded_torch_home(path: str | None) -> Iterator[Path]:
    """Point TORCH_HOME (and HF_HOME) at ``path``, or at a temporary folder removed afterwards."""
    saved = {k: os.environ.get(k) for k in ("TORCH_HOME", "HF_HOME", "HF_HUB_OFFLINE")}
    with contextlib.ExitStack() as stack:
        home = Path(path) if path else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fh_bench_")))
        os.environ["TORCH_HOME"] = str(home)
        os.environ["HF_HOME"] = str(home / "huggingface")
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            yield home
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def seeded_hub_weights(name: str) -> Path:
    """Seeded random weights of torchvision model ``name`` where its DEFAULT weights are cached.

    Same recipe as ``tests/conftest.py`` (seed 0, ``get_model(name, weights=None)``), so lpips, piq,
    torchvision and featurehooks all read one identical file.
    """
    import torchvision.models as tvm

    from featurehooks.backbones._files import hub_checkpoint_path
    from featurehooks.backbones.torchvision_models import resolve_weights

    weights = resolve_weights(name, "DEFAULT")
    path = hub_checkpoint_path(weights.url)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        state = torch.random.get_rng_state()
        torch.manual_seed(SEED)
        model = tvm.get_model(name, weights=None, num_classes=len(weights.meta["categories"]))
        torch.random.set_rng_state(state)
        tmp = path.with_suffix(".partial")
        torch.save(model.state_dict(), tmp)
        tmp.replace(path)
    return path


def seeded_fid_weights() -> Path:
    """Seeded FID Inception weights where pytorch-fid and featurehooks both read them.

    Same recipe as ``tests/conftest.py`` (He-normal convolutions after seed 0, so pool3 features stay of order
    one, as a trained network's are; torchvision's init makes them about 1e8, where pytorch-fid's sqrtm fails).
    """
    from featurehooks.backbones.fid_inception import FIDInceptionV3, fid_weights_path

    path = Path(fid_weights_path())
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = FIDInceptionV3(init_weights=False)
            for layer in model.modules():
                if isinstance(layer, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        torch.save(model.state_dict(), path.with_suffix(".partial"))
        path.with_suffix(".partial").replace(path)
    return path


def load_seeded(name: str) -> torch.nn.Module:
    """A plain torchvision model (no hooks) with the seeded cached weights, frozen and in eval mode (built on the
    meta device, then given the file's tensors: a random init of VGG16 alone takes a second)."""
    import torchvision.models as tvm

    path = seeded_hub_weights(name)
    with torch.device("meta"):
        model = tvm.get_model(name, weights=None)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), assign=True)
    return model.eval().requires_grad_(False)


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


# --------------------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    """One contender in one group: its timing summary and its ratio to the group's baseline."""

    name: str
    median_ms: float
    p25_ms: float
    p75_ms: float
    ratio: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Group:
    """Contenders timed together (one case, mode, batch and precision), with their baseline."""

    case: str
    params: dict[str, Any]
    baseline: str
    rounds: int
    calls_per_sample: int
    rows: list[Row]

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def has(self, name: str) -> bool:
        return any(r.name == name for r in self.rows)

    @property
    def label(self) -> str:
        """``case: k=v, ...``: the group a target was checked in."""
        return f"{self.case}: {format_params(self.params)}"


def make_group(
    case: str, params: dict[str, Any], timing: Timing, baseline: str, extras: dict[str, dict] | None = None
) -> Group:
    """Summarize ``timing`` as rows with ratios to ``baseline`` (ratio > 1: slower than the baseline)."""
    base = timing.median(baseline)
    other = "wall" if timing.clock == "cpu" else "cpu"
    other_base = statistics.median(timing.other[baseline]) if timing.other else None
    rows = []
    for name in timing.samples:
        q1, q3 = timing.quartiles(name)
        median = timing.median(name)
        extra = dict((extras or {}).get(name, {}))
        if other_base:
            other_median = statistics.median(timing.other[name])
            extra[f"{other}_median_ms"] = other_median * 1e3
            extra[f"{other}_ratio"] = other_median / other_base
        rows.append(Row(name, median * 1e3, q1 * 1e3, q3 * 1e3, median / base, extra))
    return Group(case, params, baseline, timing.rounds, timing.calls_per_sample, rows)


def ratio(group: Group, a: str, b: str) -> float:
    """median(a) / median(b) within one group (same run, same rounds)."""
    return group.row(a).median_ms / group.row(b).median_ms


@dataclass
class Target:
    """A claim checked against ratios measured in this run."""

    claim: str
    group: str
    measured: float
    limit: float
    kind: str  # "<=": measured must not exceed limit; ">=": must reach it
    unit: str = "x"  # "x" for ratios, "" for counts

    @property
    def met(self) -> bool:
        return self.measured <= self.limit if self.kind == "<=" else self.measured >= self.limit


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


def format_params(params: dict[str, Any]) -> str:
    """``k=v, k=v``: a group's parameters in table headings, chart legends and target labels."""
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return str(value)


def summary(groups: Sequence[Group]) -> list[str]:
    """Per case, one line per group and one column per contender: the ratios at a glance."""
    cases: dict[str, list[Group]] = {}
    for g in groups:
        cases.setdefault(g.case, []).append(g)
    lines = []
    for case, gs in cases.items():
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        lines += [
            f"**{case}**: ratio to *{gs[0].baseline}* (lower is faster)",
            "",
            "| " + " | ".join(["params", *names]) + " |",
            "|---|" + "---:|" * len(names),
        ]
        for g in gs:
            ratios = {r.name: f"{r.ratio:.2f}" for r in g.rows}
            lines.append(f"| {format_params(g.params)} | " + " | ".join(ratios.get(n, "–") for n in names) + " |")
        lines.append("")
    return lines


def markdown(
    title: str,
    cfg: Settings,
    info: dict[str, Any],
    groups: Sequence[Group],
    targets: Sequence[Target],
    notes: Sequence[str] = (),
    extra_columns: Sequence[tuple[str, str, str]] = (),
) -> str:
    """A Markdown report: command, machine, target verdicts, then one table per group.

    ``extra_columns``: (row.extra key, column header, format spec) appended to every table.
    """
    if cfg.clock == "cpu":
        extra_columns = [("wall_ratio", "wall ratio", ".3f"), *extra_columns]
    lines = [
        f"## {title}",
        "",
        f"Command: `{cfg.command}`  ",
        f"Machine: {machine_line(info)}  ",
        f"Clock: {CLOCKS[cfg.clock]}; load average at the end: {info.get('load_average_at_end')}",
        "",
    ]
    if cfg.quick:
        lines += ["**Quick mode**: tiny sizes, two rounds; these numbers check the script, not speed.", ""]
    if targets:
        lines += ["| target | group | measured | limit | met |", "|---|---|---:|---:|:---:|"]
        for t in targets:
            measured = f"{t.measured:.3f}x" if t.unit == "x" else f"{t.measured:g}"
            lines.append(
                f"| {t.claim} | {t.group} | {measured} | {t.kind} {t.limit:g}{t.unit} | "
                f"{'yes' if t.met else '**no**'} |"
            )
        lines.append("")
    lines += summary(groups)
    lines += [f"- {n}" for n in notes]
    if notes:
        lines.append("")
    for g in groups:
        lines += [
            f"### {g.case} ({format_params(g.params)})",
            "",
            f"{g.rounds} interleaved rounds, {g.calls_per_sample} call(s) per sample; ratio = median / "
            f"median of *{g.baseline}*.",
            "",
        ]
        header = "| contender | median ms | IQR ms | ratio |" + "".join(f" {h} |" for _, h, _ in extra_columns)
        lines += [header, "|---|---:|---:|---:|" + "---:|" * len(extra_columns)]
        for r in g.rows:
            cells = "".join(f" {_cell(r.extra.get(k), spec)} |" for k, _, spec in extra_columns)
            lines.append(f"| {r.name} | {r.median_ms:.2f} | {r.p25_ms:.2f}–{r.p75_ms:.2f} | {r.ratio:.3f} |{cells}")
        lines.append("")
    return "\n".join(lines)


def chart(
    path: Path,
    title: str,
    groups: Sequence[Group],
    subtitle: str = "",
    xlabel: str = "time / baseline (lower is faster)",
) -> None:
    """One panel per case; per contender one bar per variant (mode, batch, size, precision); saved small."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases: dict[str, list[Group]] = {}
    for g in groups:
        cases.setdefault(g.case, []).append(g)
    variants = list(dict.fromkeys(format_params(g.params) for g in groups))
    colors = plt.get_cmap("tab10")
    heights = []
    for gs in cases.values():
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        heights.append(0.5 + len(names) * (0.12 * len(gs) + 0.12))
    fig, axes = plt.subplots(
        len(cases), 1, figsize=(8, sum(heights) + 1.2), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for ax, (case, gs) in zip(axes[:, 0], cases.items()):
        names = list(dict.fromkeys(r.name for g in gs for r in g.rows))
        bar = 0.8 / len(gs)
        for k, g in enumerate(gs):
            ratios = {r.name: r.ratio for r in g.rows}
            ys = [
                len(names) - 1 - i + (len(gs) - 1 - k - (len(gs) - 1) / 2) * bar
                for i, n in enumerate(names)
                if n in ratios
            ]
            vals = [ratios[n] for n in names if n in ratios]
            ax.barh(ys, vals, height=bar * 0.9, color=colors(variants.index(format_params(g.params)) % 10))
            for y, v in zip(ys, vals):
                ax.text(v, y, f" {v:.2f}", va="center", fontsize=5.5)
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names[::-1], fontsize=7)
        ax.axvline(1.0, color="black", lw=0.7)
        ax.set_title(case, fontsize=8, loc="left")
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlim(0, max(r.ratio for g in gs for r in g.rows) * 1.15)
    axes[-1, 0].set_xlabel(xlabel, fontsize=8)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(i % 10)) for i in range(len(variants))]
    fig.legend(handles, variants, loc="lower center", ncol=2, fontsize=6, frameon=False)
    fig.suptitle(title, fontsize=9)
    if subtitle:
        fig.text(0.5, 0.955, "\n".join(textwrap.wrap(subtitle, 140)), ha="center", va="top", fontsize=5.5)
    rows = (len(variants) + 1) // 2
    fig.tight_layout(rect=(0, 0.012 + 0.1 * rows / (sum(heights) + 1.2), 1, 0.94))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def save(
    name: str,
    title: str,
    cfg: Settings,
    groups: Sequence[Group],
    targets: Sequence[Target],
    config: dict[str, Any],
    notes: Sequence[str] = (),
    extra_columns: Sequence[tuple[str, str, str]] = (),
    partial: bool = False,
) -> dict[str, Any]:
    """Write ``<name><tag>.json``, ``.md`` and ``.png`` under ``cfg.out``; return the JSON payload.

    ``partial``: the run is still going (scripts save after every group, so a run cut short by a
    time limit keeps what it measured); no chart then.
    """
    info = machine(cfg.device)
    payload = {
        "benchmark": name,
        "title": title,
        "command": cfg.command,
        "quick": cfg.quick,
        "partial": partial,
        "machine": info,
        "config": config,
        "notes": list(notes),
        "clock": cfg.clock,
        "extra_columns": [list(c) for c in extra_columns],
        "targets": [{**t.__dict__, "met": t.met} for t in targets],
        "groups": [
            {
                "case": g.case,
                "params": g.params,
                "baseline": g.baseline,
                "rounds": g.rounds,
                "calls_per_sample": g.calls_per_sample,
                "rows": [
                    {
                        "name": r.name,
                        "median_ms": r.median_ms,
                        "p25_ms": r.p25_ms,
                        "p75_ms": r.p75_ms,
                        "ratio": r.ratio,
                        **r.extra,
                    }
                    for r in g.rows
                ],
            }
            for g in groups
        ],
    }
    cfg.out.mkdir(parents=True, exist_ok=True)
    stem = cfg.out / f"{name}{cfg.tag}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(title, cfg, info, groups, targets, notes, extra_columns)
    if partial:
        text = text.replace("\n\n", "\n\n**Partial results**: the run had not finished when this was written.\n\n", 1)
    stem.with_suffix(".md").write_text(text + "\n")
    if cfg.plot and groups and not partial:
        chart(stem.with_suffix(".png"), title, groups, subtitle=f"{machine_line(info)}; clock: {cfg.clock}")
    return payload


def publish(cfg: Settings, payload: dict[str, Any]) -> dict[str, Any]:
    """Print the Markdown report of the results :func:`save` just wrote (stdout carries the report, progress goes
    to stderr) and return their JSON ``payload``: every script's last step."""
    print((cfg.out / f"{payload['benchmark']}{cfg.tag}.md").read_text())
    return payload


def no_notes(groups: Sequence[Group]) -> list[str]:
    """No notes drawn from the groups (the default of :attr:`Results.overview`)."""
    return []


@dataclass
class Results:
    """The groups of a run that saves after every group, so that a run cut short by a time limit keeps them.

    ``targets`` and ``overview`` (notes after ``notes``) are recomputed from the groups at every save.
    """

    name: str
    title: str
    cfg: Settings
    config: dict[str, Any]
    targets: Callable[[list[Group]], list[Target]]
    notes: Sequence[str]
    extra_columns: Sequence[tuple[str, str, str]]
    overview: Callable[[list[Group]], list[str]] = no_notes
    groups: list[Group] = field(default_factory=list)

    def add(self, group: Group) -> None:
        """Keep ``group`` and save every group so far as partial results."""
        self.groups.append(group)
        self.write(partial=True)

    def finish(self) -> dict[str, Any]:
        """Save the complete results and print their report; return the JSON payload."""
        return publish(self.cfg, self.write(partial=False))

    def write(self, *, partial: bool) -> dict[str, Any]:
        """Save the groups so far (see :func:`save`)."""
        notes = [*self.notes, *self.overview(self.groups)]
        targets = self.targets(self.groups)
        return save(
            self.name, self.title, self.cfg, self.groups, targets, self.config, notes, self.extra_columns, partial
        )


def render(json_path: Path, *, plot: bool = True) -> None:
    """Rewrite the ``.md`` (and ``.png``) next to a results ``.json`` from its contents."""
    data = json.loads(Path(json_path).read_text())
    groups = [
        Group(
            g["case"],
            g["params"],
            g["baseline"],
            g["rounds"],
            g["calls_per_sample"],
            [
                Row(
                    r["name"],
                    r["median_ms"],
                    r["p25_ms"],
                    r["p75_ms"],
                    r["ratio"],
                    {k: v for k, v in r.items() if k not in ("name", "median_ms", "p25_ms", "p75_ms", "ratio")},
                )
                for r in g["rows"]
            ],
        )
        for g in data["groups"]
    ]
    targets = [
        Target(t["claim"], t["group"], t["measured"], t["limit"], t["kind"], t.get("unit", "x"))
        for t in data["targets"]
    ]
    clock = data.get("clock", "wall")
    cfg = Settings(
        torch.device(data["machine"]["device"]),
        data["quick"],
        0.0,
        0,
        0,
        0,
        Path(json_path).parent,
        "",
        plot,
        data["command"],
        data["machine"]["torch_threads"],
        clock,
    )
    text = markdown(
        data["title"],
        cfg,
        data["machine"],
        groups,
        targets,
        data["notes"],
        [tuple(c) for c in data.get("extra_columns", [])],
    )
    if data.get("partial"):
        text = text.replace("\n\n", "\n\n**Partial results**: the run had not finished when this was written.\n\n", 1)
    Path(json_path).with_suffix(".md").write_text(text + "\n")
    if plot and groups:
        chart(
            Path(json_path).with_suffix(".png"),
            data["title"],
            groups,
            subtitle=f"{machine_line(data['machine'])}; clock: {clock}",
        )


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


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``"bf16"``, nothing for ``"fp32"``."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


REDUCED = ("bf16", "fp16")  # featurehooks' precisions below float32: contenders where the device runs them
BF16_SPEEDUP = 1.5  # issue 23: precision="bf16" against float32 (extraction, the PerceptualLoss step, a dump)


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


def with_precision(name: str, precision: str) -> str:
    """The row of contender ``name`` run in ``precision``: ``FeatureExtractor (auto), precision='bf16'``."""
    return f"{name}, precision={precision!r}"


def precision_targets(g: Group, auto: str, contiguous: str, slack: float, speedup: bool) -> list[Target]:
    """In each reduced precision of the group: ``auto`` at most ``slack`` times ``contiguous``'s time; with
    ``speedup``, ``auto`` in bf16 at least ``BF16_SPEEDUP`` times faster than in float32."""
    found = []
    for precision in REDUCED:
        ours, theirs = with_precision(auto, precision), with_precision(contiguous, precision)
        if not g.has(ours):
            continue
        found.append(Target(f"{ours} / {theirs}", g.label, ratio(g, ours, theirs), slack, "<="))
        if precision == "bf16" and speedup:
            found.append(Target(f"{auto} / {ours} (bf16 speed-up)", g.label, ratio(g, auto, ours), BF16_SPEEDUP, ">="))
    return found


def images(batch: int, size: int, cfg: Settings, precision: str, *, seed: int = SEED) -> torch.Tensor:
    """Seeded images in [0, 1] on the device; channels_last under ``bf16``."""
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed)).to(cfg.device)
    return x.contiguous(memory_format=torch.channels_last) if precision == "bf16" else x


def loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other processes on the machine make timings noisy."""
    with contextlib.suppress(OSError, AttributeError):
        return [round(v, 2) for v in os.getloadavg()]
    return None


def log(message: str) -> None:
    """Progress to stderr (stdout stays free for the Markdown)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # python benchmarks/_harness.py results/*.json: re-render tables and charts
    for arg in sys.argv[1:]:
        render(Path(arg))
