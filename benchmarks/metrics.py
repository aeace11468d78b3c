"""Question 4: are featurehooks' LPIPS, DISTS and FID at least as fast as their references, and leaner?

LPIPS (trunks AlexNet, VGG16, SqueezeNet 1.1) against ``lpips.LPIPS`` and DISTS against
``DISTS_pytorch.DISTS``, each contender on the same seeded torchvision checkpoint and the reference's
own calibrated weights, on the same [0, 1] images, in two groups:

- *metric*: per-image distances of a pair of batches under ``torch.no_grad()``;
- *loss step*: the mean distance of an input that requires grad to a target that does not, then
  ``torch.autograd.grad`` back to the input (what a training loop pays).

Next to ``featurehooks LPIPS`` (its own choice of forward, named in the *forward* column) run the
module forced to each way of computing the pair, so the choice is measured: in the metric group one
concatenated batch and two forwards; in the loss group one concatenated forward (a graph through both
halves) against its graph-free target forward; where the CPU or GPU runs bfloat16 natively, both metrics also
with ``precision="bf16"`` (opt-in: another number, its difference shown). Peak memory is taken for one call of
each contender apart from the timing (memory the call allocates).

FID: ``featurehooks fid A B`` against ``python -m pytorch_fid A B`` on the same two folders of PNGs and
the same seeded weights file, each call a fresh process as a user runs it (start-up, decoding, the
network, the distance), with the same batch size, decoding workers, device and threads (``--fid-defaults``: each
with its own default workers and threads, as a user runs it); images/s and the peak resident memory of the largest
process. ``--load`` times them again under background load (``_load.py``: two processes of multi-threaded torch
convolutions, or two busy pure-Python processes), one group per load, each row recording its load.

    python benchmarks/metrics.py                  # CPU, about 15 minutes on 2 cores
    python benchmarks/metrics.py --metrics fid    # one metric (lpips, dists, fid)
    python benchmarks/metrics.py --metrics fid --fid-defaults --load none,torch,python   # quiet and busy: ~1 hour
    python benchmarks/metrics.py --device cuda    # adds bf16 autocast + channels_last groups
    python benchmarks/metrics.py --quick          # seconds: checks the script, not speed
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from featurehooks.metrics.dists import DISTS
from featurehooks.metrics.lpips import LPIPS, LPIPS_NETS

import _harness as H
import _load as L
import _report as R
from _machine import reduced_precisions
from _weights import seeded_fid_weights, seeded_hub_weights, seeded_torch_home

FH = "featurehooks LPIPS"
FH_ONE = "featurehooks LPIPS, one concatenated forward"
FH_TWO = "featurehooks LPIPS, two forwards"
REF = "lpips.LPIPS"
FH_DISTS = "featurehooks DISTS"
FH_BF16 = "featurehooks LPIPS, precision='bf16'"
FH_DISTS_BF16 = "featurehooks DISTS, precision='bf16'"
REF_DISTS = "DISTS_pytorch.DISTS"
FH_FID = "featurehooks fid"
REF_FID = "python -m pytorch_fid"
METRIC = "metric (no grad)"
LOSS = "loss step (forward + grad to the input)"
MODES = (METRIC, LOSS)
FID = "FID of two folders (a fresh process each)"
NETS = tuple(LPIPS_NETS)
METRICS = ("lpips", "dists", "fid")
SHAPES = H.Shapes(quick="2x32", cpu="1x224,4x224", cuda="16x224,64x224")
# images per folder, their side, FID features, images per batch
FID_SETS = {"quick": (6, 64, 64, 4), "cpu": (100, 256, 2048, 50), "cuda": (1000, 256, 2048, 50)}

Distance = Callable[[Tensor, Tensor], Tensor]


class TwoForwards(LPIPS):
    """Always input and target in separate forwards (each with a graph only if its image requires grad)."""

    def _features(self, input: Tensor, target: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        with torch.set_grad_enabled(torch.is_grad_enabled() and input.requires_grad):
            first = self.extractor(input)
        with torch.set_grad_enabled(torch.is_grad_enabled() and target.requires_grad):
            second = self.extractor(target)
        return first, second


class OneForward(LPIPS):
    """Always one concatenated forward (in a loss step the graph then runs through both halves)."""

    def _features(self, input: Tensor, target: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        both = self.extractor(torch.cat([input, target.expand_as(input)]))
        halves = {name: value.chunk(2) for name, value in both.items()}
        return {k: v[0] for k, v in halves.items()}, {k: v[1] for k, v in halves.items()}


@dataclass
class Contenders:
    """One metric on one trunk: the modules, each one's per-image distance of [0, 1] images, and who runs when."""

    metric: str
    net: str
    modules: dict[str, nn.Module]
    distances: dict[str, Distance]
    ours: str
    reference: str
    loss_names: list[str]

    def names(self, mode: str) -> list[str]:
        return list(self.modules) if mode == METRIC else self.loss_names

    def close(self) -> None:
        for name, module in self.modules.items():
            if name != self.reference:
                module.extractor.close()


def lpips_contenders(net: str, cfg: H.Settings) -> Contenders:
    """featurehooks' LPIPS (and forced to each forward) and lpips.LPIPS, all reading one seeded checkpoint."""
    import lpips

    seeded_hub_weights(LPIPS_NETS[net].backbone)
    with contextlib.redirect_stdout(io.StringIO()):  # lpips prints on construction
        reference = lpips.LPIPS(net=net, version="0.1", verbose=False)
    modules: dict[str, nn.Module] = {
        FH: LPIPS(net, reduction="none"),
        FH_ONE: OneForward(net, reduction="none"),
        FH_TWO: TwoForwards(net, reduction="none"),
        **({FH_BF16: LPIPS(net, reduction="none", precision="bf16")} if bf16_runs(cfg.device) else {}),
        REF: reference,
    }
    distances: dict[str, Distance] = {name: module for name, module in modules.items() if name != REF}
    distances[REF] = lambda a, b: reference(a, b, normalize=True).flatten()  # [0, 1] -> lpips' [-1, 1]
    loss_names = [name for name in modules if name != FH_TWO]
    return Contenders("lpips", net, _ready(modules, cfg), distances, FH, REF, loss_names)


def dists_contenders(net: str, cfg: H.Settings) -> Contenders:
    """featurehooks' DISTS and DISTS_pytorch's, on one seeded VGG16 checkpoint and DISTS_pytorch's alpha/beta."""
    from DISTS_pytorch import DISTS as ReferenceDISTS

    seeded_hub_weights("vgg16")
    modules: dict[str, nn.Module] = {
        FH_DISTS: DISTS(reduction="none"),
        **({FH_DISTS_BF16: DISTS(reduction="none", precision="bf16")} if bf16_runs(cfg.device) else {}),
        REF_DISTS: ReferenceDISTS(),
    }
    reference = modules[REF_DISTS]

    def reference_distance(a: Tensor, b: Tensor) -> Tensor:
        # require_grad: features with a graph in a loss step (its default computes them under no_grad)
        return reference(a, b, require_grad=a.requires_grad).reshape(-1)

    distances: dict[str, Distance] = {name: module for name, module in modules.items() if name != REF_DISTS}
    distances[REF_DISTS] = reference_distance
    return Contenders("dists", net, _ready(modules, cfg), distances, FH_DISTS, REF_DISTS, list(modules))


def _ready(modules: dict[str, nn.Module], cfg: H.Settings) -> dict[str, nn.Module]:
    for module in modules.values():
        module.eval().to(cfg.device)
    return modules


def bf16_runs(device: torch.device) -> bool:
    """Whether ``precision="bf16"`` runs on the device (an opt-in contender where it does)."""
    return "bf16" in reduced_precisions(device)


def calls(
    found: Contenders, mode: str, x: Tensor, y: Tensor, precision: str, device: torch.device
) -> dict[str, Callable[[], Tensor]]:
    """Zero-argument calls: distances under no_grad (metric) or the gradient to the input (loss step)."""
    leaf = x.detach().clone().requires_grad_(True)
    fns: dict[str, Callable[[], Tensor]] = {}
    for name in found.names(mode):
        dist = found.distances[name]
        if mode == METRIC:

            def call(d: Distance = dist) -> Tensor:
                with torch.no_grad(), H.autocast(precision, device):
                    return d(x, y)
        else:

            def call(d: Distance = dist) -> Tensor:
                with H.autocast(precision, device):
                    loss = d(leaf, y).float().mean()
                (grad,) = torch.autograd.grad(loss, leaf)
                return grad

        fns[name] = call
    return fns


def run_group(found: Contenders, mode: str, batch: int, size: int, precision: str, cfg: H.Settings) -> R.Group:
    x = H.images(batch, size, cfg, precision, seed=1)
    y = H.images(batch, size, cfg, precision, seed=2)
    fns = calls(found, mode, x, y, precision, cfg.device)
    outputs = {name: fn().float() for name, fn in fns.items()}  # also the first warm-up call
    reference = outputs[found.reference]
    scale = 1.0 if mode == METRIC else float(reference.abs().max())  # gradients: relative to their size
    with torch.no_grad(), H.autocast(precision, cfg.device):
        value = float(found.distances[found.reference](x, y).float().mean())
    extras: dict[str, dict[str, Any]] = {
        name: {"max_abs_diff": H.max_abs_diff(out, reference) / max(scale, 1e-30)} for name, out in outputs.items()
    }
    del outputs
    timing = H.time_interleaved(fns, cfg, min_sample_s=0.02 if cfg.cuda else 0.0)
    for name, fn in fns.items():
        gc.collect()
        extras[name]["peak_mib"] = H.peak_memory(fn, cfg.device) / 2**20
        extras[name]["distance"] = value
        extras[name]["images_per_s"] = batch / timing.median(name)
    if found.metric == "lpips":
        chosen = FH_ONE if mode == METRIC and found.modules[FH]._one_forward(x) else FH_TWO
        extras[FH]["forward"] = "one" if chosen == FH_ONE else "two"
    params = {"metric": found.metric, "net": found.net, "batch": batch, "size": size, "precision": precision}
    group = R.make_group(mode, params, timing, found.reference, extras)
    H.log(
        f"{mode} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_mib']:.0f} MiB)" for r in group.rows)
    )
    return group


# ------------------------------------------------------------------------------------------------ FID


def write_folders(root: Path, count: int, side: int) -> tuple[Path, Path]:
    """Two folders of ``count`` smooth random ``side``x``side`` RGB PNGs (another seed each)."""
    folders = root / "a", root / "b"
    for seed, folder in enumerate(folders):
        folder.mkdir(parents=True)
        generator = torch.Generator().manual_seed(H.SEED + seed)
        coarse = torch.rand(count, 3, max(side // 16, 2), max(side // 16, 2), generator=generator)
        pictures = torch.nn.functional.interpolate(coarse, size=(side, side), mode="bilinear", align_corners=False)
        pixels = (pictures * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        for i, array in enumerate(pixels):
            Image.fromarray(np.ascontiguousarray(array)).save(folder / f"{i:05d}.png")
    return folders


# Runs argv[2:] and writes its peak RSS (KiB) to argv[1]. A lean process between this one and the command: a
# child's ru_maxrss counts the memory of the process it was forked from (here, torch and the trunks: 1.8 GB).
MEASURED_RUN = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@dataclass
class Process:
    """One command run as a fresh process each call; keeps each call's peak RSS and the FID it printed."""

    command: list[str]
    env: dict[str, str]
    peaks_mib: list[float] = dataclasses.field(default_factory=list)
    fid: float | None = None

    def __call__(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            peak = Path(tmp) / "maxrss"
            done = subprocess.run(
                [sys.executable, "-c", MEASURED_RUN, str(peak), *self.command],
                env=self.env,
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise SystemExit(f"{' '.join(self.command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
            self.peaks_mib.append(int(peak.read_text()) / 1024)
        match = re.search(r"FID:\s+(\S+)", done.stdout)
        if not match:
            raise SystemExit(f"{' '.join(self.command)} printed no FID:\n{done.stdout[-2000:]}")
        self.fid = float(match.group(1))


def fid_commands(a: Path, b: Path, dims: int, batch: int, cfg: H.Settings, own_defaults: bool) -> dict[str, Process]:
    """The two command lines on the same folders, batch size and device; the same workers and threads, or with
    ``own_defaults`` neither (no ``--workers``/``--num-workers``, no thread variables: each tool chooses)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.threads), "PYTHONWARNINGS": "ignore"}
    same = [str(a), str(b), "--dims", str(dims), "--batch-size", str(batch), "--device", str(cfg.device)]
    ours, theirs = [*same, "-q"], list(same)
    if own_defaults:
        for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.pop(variable, None)
    else:
        workers = "0" if cfg.quick else str(min(4, os.cpu_count() or 1))
        ours, theirs = [*ours, "--workers", workers], [*theirs, "--num-workers", workers]
    return {
        FH_FID: Process([sys.executable, "-m", "featurehooks", "fid", *ours], env),
        REF_FID: Process([sys.executable, "-m", "pytorch_fid", *theirs], env),
    }


def write_fid_folders(root: Path, cfg: H.Settings) -> tuple[Path, Path]:
    """The two folders of PNGs every FID group reads, and the seeded weights file in the hub cache."""
    count, side, _, _ = fid_set(cfg)
    seeded_fid_weights()
    return write_folders(root, count, side)


def fid_set(cfg: H.Settings) -> tuple[int, int, int, int]:
    """Images per folder, their side, FID features and images per batch, by mode and device."""
    return FID_SETS["quick" if cfg.quick else cfg.device.type]


def run_fid(folders: tuple[Path, Path], cfg: H.Settings, load: str, own_defaults: bool) -> R.Group:
    """Both commands on ``folders``, timed under the background ``load`` (``_load.LOADS``): one group."""
    count, side, dims, batch = fid_set(cfg)
    processes = fid_commands(*folders, dims, batch, cfg, own_defaults)
    with L.background(load, quick=cfg.quick) as running:
        if cfg.quick:  # checks the script and that both print one FID: each command once
            timing = H.Timing({name: [H.timed(process)] for name, process in processes.items()}, 1, 1)
        else:
            timing = H.time_interleaved(dict(processes), dataclasses.replace(cfg, warmup=1), budget=0.0)
        during = running.record()
    reference = processes[REF_FID].fid
    extras = {
        name: {
            "peak_rss_mib": statistics.median(process.peaks_mib),
            "images_per_s": 2 * count / timing.median(name),
            "distance": process.fid,
            "max_abs_diff": abs(process.fid - reference) / max(abs(reference), 1e-30),
            **during,
        }
        for name, process in processes.items()
    }
    params = {"metric": "fid", "images": f"{count}+{count}", "size": side, "dims": dims, "batch": batch, "load": load}
    group = R.make_group(FID, params, timing, REF_FID, extras)
    H.log(
        f"{FID} {params}: "
        + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_rss_mib']:.0f} MiB)" for r in group.rows)
        + f"; load average {during['load_average']}, load cores busy {during['load_cores_busy']}"
    )
    return group


# ------------------------------------------------------------------------------------------------ report


def targets(groups: list[R.Group]) -> list[R.Target]:
    found = []
    for g in groups:
        label = R.format_params(g.params)
        if g.case == FID:
            rss = g.row(FH_FID).extra["peak_rss_mib"] / g.row(REF_FID).extra["peak_rss_mib"]
            found.append(
                R.Target(
                    "fid: pytorch_fid time / featurehooks time (faster)", label, R.ratio(g, REF_FID, FH_FID), 1.0, ">="
                )
            )
            found.append(R.Target("fid: featurehooks peak RSS / pytorch_fid peak RSS", label, rss, 1.0, "<="))
            continue
        ours, reference = (FH, REF) if g.params["metric"] == "lpips" else (FH_DISTS, REF_DISTS)
        short = "LPIPS" if ours == FH else "DISTS"
        peak = g.row(ours).extra["peak_mib"] / max(g.row(reference).extra["peak_mib"], 1e-9)
        # LPIPS promises a fifth less memory than lpips; DISTS no more than DISTS_pytorch
        peak_limit = 0.8 if ours == FH else 1.0
        if g.case == METRIC:
            found.append(
                R.Target(
                    f"metric: {reference} time / {short} time (no slower)",
                    label,
                    R.ratio(g, reference, ours),
                    1.0,
                    ">=",
                )
            )
            found.append(R.Target(f"metric: {short} peak / {reference} peak", label, peak, peak_limit, "<="))
            if ours == FH:
                chosen, other = (FH_ONE, FH_TWO) if g.row(FH).extra.get("forward") == "one" else (FH_TWO, FH_ONE)
                # two forwards trade a little time for memory: allowed up to 10% over one concatenated forward
                found.append(
                    R.Target(
                        f"metric: the forward LPIPS chose ({g.row(FH).extra.get('forward')}) / the other",
                        label,
                        R.ratio(g, chosen, other),
                        1.1,
                        "<=",
                    )
                )
        else:
            found.append(
                R.Target(
                    f"loss: {reference} time / {short} time (faster)", label, R.ratio(g, reference, ours), 1.0, ">="
                )
            )
            found.append(R.Target(f"loss: {short} peak / {reference} peak", label, peak, peak_limit, "<="))
            if ours == FH:
                found.append(
                    R.Target(
                        "loss: graph-free target forward / one concatenated forward",
                        label,
                        R.ratio(g, FH, FH_ONE),
                        1.0,
                        "<=",
                    )
                )
    return found


def pair_metrics(metrics: list[str], nets: list[str]) -> Iterator[tuple[str, Callable[[str, H.Settings], Contenders]]]:
    """(trunk, builder) of every LPIPS and DISTS contender set asked for."""
    if "lpips" in metrics:
        yield from ((net, lpips_contenders) for net in nets)
    if "dists" in metrics:
        yield "vgg", dists_contenders


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--metrics", default=",".join(METRICS), help="subset of lpips, dists, fid")
    p.add_argument("--nets", default=",".join(NETS), help="LPIPS trunks: subset of alex, vgg, squeeze")
    p.add_argument("--modes", default="metric,loss", help="LPIPS and DISTS groups: subset of metric, loss")
    p.add_argument("--load", default="none", help="FID groups: " + L.load_option_help())
    p.add_argument(
        "--fid-defaults",
        action="store_true",
        help="FID: each command with its own default decoding workers and threads (as a user runs it), "
        "not the same ones for both",
    )
    SHAPES.add_option(p)
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=10.0)
    shapes = SHAPES.parse(args.shapes, cfg)
    metrics, nets = args.metrics.split(","), args.nets.split(",")
    loads = L.parse_loads(args.load)
    modes = [{"metric": METRIC, "loss": LOSS}[m] for m in args.modes.split(",")]
    notes = [
        "ratio = median / median of the reference in the same group (lower is faster); every contender reads the "
        "same seeded weights: the trunk's torchvision checkpoint and lpips' v0.1 heads or DISTS_pytorch's "
        "alpha/beta; FID, one pt_inception-2015-12-05 file in the hub cache.",
        "max abs diff: metric, largest difference of the per-image distances from the reference's; loss step, of "
        "the input gradients, relative to the largest reference gradient; FID, of the printed FID, relative to "
        "pytorch_fid's (below 2049 images the covariance is singular, where pytorch_fid's sqrtm is inexact).",
        "peak MiB: memory allocated during one call above what was allocated before it "
        + ("(CUDA caching allocator peak)." if cfg.cuda else "(CPU: profiler allocation events).")
        + " peak RSS MiB (FID): the largest process's peak resident memory, median over the calls.",
        f"FID groups: {L.NOTE} "
        + (
            "Each command with its own default workers and threads."
            if args.fid_defaults
            else "Both commands with the same decoding workers and threads (OMP_NUM_THREADS)."
        ),
        "*precision='bf16'* rows (where the device runs bfloat16 natively): opt-in, the frozen trunk stored in "
        "bfloat16, distances reduced in float32; their max abs diff is what bf16 costs in accuracy.",
        f"*{FH_ONE}* and *{FH_TWO}* are the module forced to one way; *forward* says which way featurehooks "
        "LPIPS chose (metric: one concatenated batch on a GPU, two forwards on the CPU, for less memory; loss: "
        "always a graph-free target forward).",
    ]
    config = {
        "metrics": metrics,
        "nets": nets,
        "modes": modes,
        "shapes": shapes,
        "precisions": H.precisions(cfg),
        "fid_set": fid_set(cfg),
        "fid_loads": loads,
        "fid_own_defaults": args.fid_defaults,
        **cfg.timing_config(),
    }
    results = R.Results(
        "metrics",
        "LPIPS, DISTS and FID: time / the reference implementation",
        cfg,
        config,
        targets,
        notes,
        [
            ("images_per_s", "images/s", ".1f"),
            ("peak_mib", "peak MiB", ".1f"),
            ("peak_rss_mib", "peak RSS MiB", ".0f"),
            ("max_abs_diff", "max abs diff", ".2g"),
            ("distance", "distance", ".4g"),
            ("forward", "forward", ""),
            *L.COLUMNS,
        ],
    )
    with seeded_torch_home(args.torch_home) as home:
        for net, build in pair_metrics(metrics, nets):
            H.log(f"building {build.__name__.split('_')[0]} on {net!r}")
            found = build(net, cfg)
            try:
                for precision in H.precisions(cfg):
                    if precision == "bf16":
                        for module in found.modules.values():
                            module.to(memory_format=torch.channels_last)
                    for batch, size in shapes:
                        for mode in modes:
                            results.add(run_group(found, mode, batch, size, precision, cfg))
            finally:
                found.close()
                del found
                gc.collect()
        if "fid" in metrics:
            with tempfile.TemporaryDirectory(prefix="fh_fid_", dir=home) as root:
                folders = write_fid_folders(Path(root), cfg)
                for load in loads:
                    results.add(run_fid(folders, cfg, load, args.fid_defaults))
    return results.finish()


if __name__ == "__main__":
    main()
