"""Question: does ``memory_format="auto"`` ever run slower than NCHW, at any size, and does it pick the faster format?

``FeatureExtractor(..., memory_format="auto")`` (the default) runs a forward that builds a graph in NCHW, and one
without a graph ``channels_last`` on CPUs and CUDA devices when 2-D convolutions do at least half of the FLOPs up
to the deepest requested layer and each convolution weight is used at least ``MIN_REUSE`` times in one image's
forward, ``contiguous`` (NCHW) otherwise (``featurehooks/_formats.py``). This sweep is the evidence for that rule:
the claim is *no case slower than NCHW by more than 3% under auto*, at every size (``--sizes``).

For each model (a spread of torchvision families and three timm models), one deep layer or the last stage
(picked with ``featurehooks.list_layers``), three contenders on one seeded random init (``weights=None``
after ``torch.manual_seed(0)``; the first extractor is built by name, the others from a deep copy of its
backbone with the same mean/std):

- ``contiguous (NCHW)``: ``FeatureExtractor(..., memory_format="contiguous")``, the baseline of every ratio;
- ``channels_last``: ``memory_format="channels_last"``;
- ``auto``: ``memory_format="auto"``; the *format* column says what it chose, the *conv share* column
  the share of convolution FLOPs up to the requested layer, the *reuse* column how often each convolution weight
  is used in one image's forward (``FeatureExtractor.conv_work``): auto runs channels-last without a graph where
  the share is >= 0.5 and the reuse >= ``featurehooks._formats.MIN_REUSE``, and NCHW in a graph.

Modes: ``no-grad`` (``mode="detach"`` under ``torch.no_grad``) and ``grad`` (``mode="grad"``, forward,
then ``torch.autograd.grad`` of the summed feature means back to the input, as a loss would). Batches 1
and 8 at 224 px (fixed-size models at their size); with ``--device cuda`` also batch 64, and every group
in fp32 and under bf16 autocast. The images are NCHW [0, 1]; every extractor converts them itself.

Outputs: ``channels_last`` and ``auto`` are compared with ``contiguous`` (features in no-grad mode, input
gradients in grad mode): *max rel diff* = max|out - NCHW| / max|NCHW|, ~1e-6 at float32 rounding (the
kernels sum in another order; in grad mode a ReLU or max-pool near-tie can move a gradient entry).

Targets, in every group: ``auto / contiguous <= 1.03`` and ``auto / best of the two formats <= 1.03``.
Where ``auto`` chose contiguous, ``auto / contiguous`` compares two identical configurations: it is the
noise of the measurement.

    python benchmarks/memory_formats.py --threads 1 --clock cpu   # CPU, ~6 min of CPU time on a shared machine
    python benchmarks/memory_formats.py --models vgg16,resnet50,efficientnet_b0 --sizes 32,64,128,224 --tag _sizes
    python benchmarks/memory_formats.py --device cuda --tag _cuda # adds batch 64 and bf16 autocast groups
    python benchmarks/memory_formats.py --quick                   # seconds: checks the script, not speed
    python benchmarks/memory_formats.py --models resnet50,swin_t  # a subset (keys as in CASES)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import featurehooks as fh
from featurehooks._formats import MIN_REUSE, ConvWork

import _harness as H
import _report as R
from _weights import seeded_torch_home

CONTIGUOUS = "contiguous (NCHW)"
CHANNELS_LAST = "channels_last"
AUTO = "auto"
FORMATS = {CONTIGUOUS: "contiguous", CHANNELS_LAST: "channels_last", AUTO: "auto"}  # contender -> memory_format
SLACK = 1.03  # "auto" at most 3% slower than NCHW, and than the better of the two formats
MODES = {"no-grad": "detach", "grad": "grad"}  # benchmark mode -> FeatureExtractor mode


@dataclass(frozen=True)
class Case:
    """One backbone and the layer it is cut at; ``size``: the input size of a fixed-size model."""

    key: str
    backbone: str
    layer: str
    size: int | None = None


# One layer per model: the last stage where that is affordable, else a deep one (CPU time of the sweep).
CASES: tuple[Case, ...] = (
    Case("vgg16", "vgg16", "relu3_3"),
    Case("resnet18", "resnet18", "layer4"),
    Case("resnet50", "resnet50", "layer4"),
    Case("densenet121", "densenet121", "features.transition2"),
    Case("squeezenet1_1", "squeezenet1_1", "features.12"),
    Case("shufflenet_v2_x1_0", "shufflenet_v2_x1_0", "conv5"),
    Case("mnasnet0_5", "mnasnet0_5", "layers.16"),
    Case("mobilenet_v3_large", "mobilenet_v3_large", "features.16"),
    Case("efficientnet_b0", "efficientnet_b0", "features.8"),
    Case("efficientnet_v2_s", "efficientnet_v2_s", "features.4"),
    Case("regnet_y_400mf", "regnet_y_400mf", "trunk_output"),
    Case("convnext_tiny", "convnext_tiny", "features.3"),
    Case("swin_t", "swin_t", "features.3"),
    Case("maxvit_t", "maxvit_t", "blocks.1", size=224),  # conv share near the 0.5 threshold
    Case("timm-efficientnet_b0", "timm/efficientnet_b0", "conv_head"),
    Case("timm-vit_small", "timm/vit_small_patch16_224", "blocks.5", size=224),
)
# --quick: one model "auto" runs channels_last, one it runs contiguous
QUICK: tuple[Case, ...] = (
    Case("squeezenet1_1-quick", "squeezenet1_1", "features.5"),
    Case("timm-vit_tiny-quick", "timm/vit_tiny_patch16_224", "blocks.1", size=224),
)
ALL = {case.key: case for case in (*CASES, *QUICK)}


@dataclass
class Built:
    """The extractors of one case: contender -> benchmark mode -> extractor, all on one set of weights."""

    case: Case
    extractors: dict[str, dict[str, fh.FeatureExtractor]]
    work: ConvWork | None

    @property
    def conv_share(self) -> float | None:
        return self.work.share if self.work is not None else None

    def all(self) -> list[fh.FeatureExtractor]:
        return [ext for by_mode in self.extractors.values() for ext in by_mode.values()]

    def title(self) -> str:
        share = "unknown" if self.conv_share is None else f"{self.conv_share:.2f}"
        return f"{self.case.backbone} {self.case.layer} (conv share {share})"

    def close(self) -> None:
        for ext in self.all():
            ext.close()


def build(case: Case) -> Built:
    """Three memory formats x two modes; one seeded random init shared by all six extractors."""
    torch.manual_seed(H.SEED)
    first = fh.FeatureExtractor(case.backbone, [case.layer], weights=None, mode="detach", memory_format="contiguous")
    path = first.taps.paths[0]
    mean, std = first.mean.flatten().tolist(), first.std.flatten().tolist()
    extractors: dict[str, dict[str, fh.FeatureExtractor]] = {}
    for name, memory_format in FORMATS.items():
        extractors[name] = {}
        for mode, ext_mode in MODES.items():
            if (name, mode) == (CONTIGUOUS, "no-grad"):
                extractors[name][mode] = first
                continue
            # an nn.Module is deep-copied: the same weights everywhere, converted to each format separately
            extractors[name][mode] = fh.FeatureExtractor(
                first.backbone,
                {path: case.layer},
                weights=None,
                mode=ext_mode,
                mean=mean,
                std=std,
                memory_format=memory_format,
            )
    return Built(case, extractors, extractors[AUTO]["no-grad"].conv_work)


def _timed(ext: fh.FeatureExtractor, x: Tensor, mode: str, precision: str, device: torch.device) -> Callable[[], Any]:
    """A zero-argument call: the features (no-grad) or the input gradient of their summed means (grad)."""
    if mode == "no-grad":

        def call() -> Any:
            with torch.no_grad(), H.autocast(precision, device):
                return list(ext(x).values())

        return call
    leaf = x.detach().clone().requires_grad_(True)

    def call_grad() -> Any:
        with H.autocast(precision, device):
            out = ext(leaf)
            loss = sum(o.float().mean() for o in out.values())
        (grad,) = torch.autograd.grad(loss, leaf)
        return grad

    return call_grad


def _keeping_first(fn: Callable[[], Any], kept: dict[str, Any], name: str) -> Callable[[], Any]:
    """``fn``, storing its first result in ``kept[name]``: the warm-up call doubles as the output check."""

    def call() -> Any:
        out = fn()
        if name not in kept:
            kept[name] = out
        return out

    return call


def run_group(built: Built, batch: int, size: int, mode: str, precision: str, cfg: H.Settings) -> R.Group:
    # NCHW images under bf16 too: each extractor converts them to its own memory format
    x = H.images(batch, size, cfg, precision).contiguous()
    kept: dict[str, Any] = {}
    fns = {
        name: _keeping_first(_timed(by_mode[mode], x, mode, precision, cfg.device), kept, name)
        for name, by_mode in built.extractors.items()
    }
    timing = H.time_interleaved(fns, cfg, min_sample_s=0.02 if cfg.cuda else 0.0)
    reference = kept[CONTIGUOUS]
    extras = {
        name: {
            "format": by_mode[mode].memory_format_in_use,
            "conv_share": built.conv_share if name == AUTO else None,
            "reuse": built.work.reuse(size, size) if name == AUTO and built.work is not None else None,
            "max_abs_diff": H.max_abs_diff(kept[name], reference),
            "max_rel_diff": H.max_rel_diff(kept[name], reference),
        }
        for name, by_mode in built.extractors.items()
    }
    del kept, reference
    params = {
        "mode": mode,
        "batch": batch,
        "size": size,
        "precision": precision,
        "auto ran": by_mode_format(built, mode),
    }
    group = R.make_group(built.title(), params, timing, CONTIGUOUS, extras)
    H.log(
        f"{group.case} {params}: "
        + ", ".join(f"{r.name}={r.ratio:.3f}" for r in group.rows)
        + f"; auto/best={best_ratio(group):.3f}"
    )
    return group


def by_mode_format(built: Built, mode: str) -> str:
    """The format the latest forward of ``auto`` ran in, in ``mode``: the rule's decision for that group."""
    return built.extractors[AUTO][mode].memory_format_in_use


def best_ratio(group: R.Group) -> float:
    """median(auto) / the smaller median of the two explicit formats."""
    best = min(group.row(CONTIGUOUS).median_ms, group.row(CHANNELS_LAST).median_ms)
    return group.row(AUTO).median_ms / best


def targets(groups: list[R.Group]) -> list[R.Target]:
    """Every group: auto at most 3% slower than NCHW, and than the better of the two formats."""
    found = []
    for g in groups:
        where = g.label
        found.append(R.Target(f"{AUTO} / {CONTIGUOUS}", where, R.ratio(g, AUTO, CONTIGUOUS), SLACK, "<="))
        found.append(R.Target(f"{AUTO} / best of {CONTIGUOUS} and {CHANNELS_LAST}", where, best_ratio(g), SLACK, "<="))
    return found


def overview(groups: list[R.Group]) -> list[str]:
    """One line per model: its conv share, auto's choice, the range of channels_last / NCHW, the worst auto."""
    by_case: dict[str, list[R.Group]] = {}
    for g in groups:
        by_case.setdefault(g.case, []).append(g)
    lines = []
    for case, gs in by_case.items():
        cl = [g.row(CHANNELS_LAST).ratio for g in gs]
        auto = [g.row(AUTO).ratio for g in gs]
        best = [best_ratio(g) for g in gs]
        lines.append(
            f"{case}: NCHW / channels_last {1 / max(cl):.2f}–{1 / min(cl):.2f} (channels_last faster "
            f"above 1); auto / NCHW at most {max(auto):.3f}, auto / best at most {max(best):.3f} "
            f"over {len(gs)} groups"
        )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated keys (default: every full-mode case, or the --quick ones): {', '.join(ALL)}",
    )
    p.add_argument("--modes", default="no-grad,grad", help="no-grad, grad or both")
    p.add_argument(
        "--batches", default=None, help="comma-separated batch sizes; default 1,8 (cuda: 1,8,64; quick: 1,2)"
    )
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated image sizes of models that take any size; default 224 (quick: 64); "
        "the size sweep: 32,64,128,224,384,512",
    )
    p.set_defaults(warmup=1)  # one untimed call per contender, whose output is also the one checked
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=1.0, quick_budget=0.0)
    if argv is not None:  # called from Python (tests): say what the command line would have been
        cfg.command = " ".join(["python", "benchmarks/memory_formats.py", *argv])
    keys = args.models.split(",") if args.models else [c.key for c in (QUICK if cfg.quick else CASES)]
    unknown = sorted(set(keys) - set(ALL))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {list(ALL)}")
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes: choose from {list(MODES)}, got {modes}")
    if args.batches is None:
        args.batches = "1,2" if cfg.quick else ("1,8,64" if cfg.cuda else "1,8")
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else [64 if cfg.quick else 224]
    precisions = H.precisions(cfg)
    cases: dict[str, dict[str, Any]] = {}
    notes = [
        f"Ratios are medians over *{CONTIGUOUS}* (FeatureExtractor with memory_format='contiguous') in the same "
        f"interleaved run; *format* is what each backbone ran in (for *{AUTO}*: its choice), *conv share* the "
        "share of convolution FLOPs up to the requested layer and *reuse* how often each convolution weight is "
        "used in one image's forward, which auto decided by (channels_last without a graph at a share >= 0.5 and "
        f"a reuse >= {MIN_REUSE}; NCHW in a graph).",
        f"*{CHANNELS_LAST}* and *{AUTO}* return the same tensors as *{CONTIGUOUS}* (max rel diff = max|out - "
        "NCHW| / max|NCHW|): float32 rounding in no-grad mode; in grad mode (the input gradient) a ReLU or "
        "max-pool near-tie can go the other way and move a gradient entry.",
        "grad = forward + autograd.grad of the summed feature means to the input. Weights: seeded random init "
        "(seed 0), one per model, deep-copied into every contender.",
        f"Where auto chose contiguous, *{AUTO}* / *{CONTIGUOUS}* compares identical configurations: its spread "
        "is the noise of this run.",
    ]
    config = {
        "models": keys,
        "modes": modes,
        "batches": batches,
        "sizes": sizes,
        "precisions": precisions,
        **cfg.timing_config(),
        "cases": cases,
    }
    results = R.Results(
        "memory_formats",
        "Memory formats: time / FeatureExtractor contiguous (NCHW)",
        cfg,
        config,
        targets,
        notes,
        [
            R.FORMAT_COLUMN,
            ("conv_share", "conv share", ".2f"),
            ("reuse", "reuse", ".0f"),
            R.ABS_DIFF_COLUMN,
            R.REL_DIFF_COLUMN,
        ],
        overview,
    )
    with seeded_torch_home(args.torch_home):
        for key in keys:
            case = ALL[key]
            H.log(f"building {case.backbone} {case.layer}")
            start = time.process_time()
            built = build(case)
            try:
                for ext in built.all():
                    ext.to(cfg.device)
                work = None if built.work is None else dataclasses.asdict(built.work)
                cases[key] = {
                    "backbone": case.backbone,
                    "layer": case.layer,
                    "conv_share": built.conv_share,
                    "conv_work": work,
                    "title": built.title(),
                }
                for precision in precisions:
                    for side in [case.size] if case.size else sizes:
                        for batch in batches:
                            for mode in modes:
                                results.add(run_group(built, batch, side, mode, precision, cfg))
                cases[key]["cpu_s"] = round(time.process_time() - start, 1)  # build and groups, this process
            finally:
                built.close()
                del built
                H.release_memory()
    return results.finish()


if __name__ == "__main__":
    main()
