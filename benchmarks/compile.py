"""Question 3: does ``torch.compile`` keep the hook-based path as fast as a compiled FX extractor?

Group 1 (no-grad extraction, VGG16 relu3_3): FeatureExtractor eager vs ``torch.compile(extractor)``
vs torchvision FX eager and compiled, with the bare truncated forward (eager and compiled) as floor.
Group 2 (loss step, forward + backward to the input): PerceptualLoss(relu3_3) eager vs
``torch.compile(loss)``, next to the hand-written floor of ``benchmarks/losses.py`` eager and compiled.

Hooks are registered once, at construction, before compiling (see DESIGN.md). For each compiled
contender the table reports how many graphs dynamo produced, its graph breaks (with the first
reason) and the seconds the first calls took (compilation included). Every module is warmed up
eagerly once before compiling, so the one-time input-range check is not part of the steady state.

    python benchmarks/compile.py                         # CPU, inductor; several minutes on 2 cores
    python benchmarks/compile.py --device cuda           # bf16 autocast + channels_last
    python benchmarks/compile.py --quick                 # backend "eager": checks tracing, in seconds
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import featurehooks as fh
from featurehooks.losses import PerceptualLoss

import _harness as H
import _report as R
import losses as L  # benchmarks/losses.py: the hand-written floor loss
from _weights import load_seeded, seeded_hub_weights, seeded_torch_home

EXTRACT = "Extraction VGG16 relu3_3, no-grad"
LOSS = "PerceptualLoss relu3_3 step (forward + backward)"


def counting_backend(backend: str, stats: dict[str, int]) -> Callable[..., Any]:
    """``backend`` wrapped to count the graphs it receives and the convolutions in them.

    Dynamo can give up on a whole frame and run it eagerly without reporting a graph break (it
    counts it as "unimplemented"); convolutions in the captured graphs show what was compiled.
    """
    from torch._dynamo import lookup_backend

    inner = lookup_backend(backend)

    def count(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        stats["graphs"] += 1
        for node in gm.graph.nodes:
            target = node.target
            if node.op == "call_module":
                target = type(gm.get_submodule(node.target)).__name__
            if node.op in ("call_function", "call_module", "call_method") and "conv" in str(target).lower():
                stats["convs"] += 1
        return inner(gm, example_inputs)

    return count


def compiled_call(
    name: str, fn: Callable[[], Any], stats: dict[str, int], extras: dict[str, dict[str, Any]], calls: int = 3
) -> None:
    """Call a freshly compiled contender ``calls`` times (compiles and recompiles happen here); record the cost."""
    from torch._dynamo.utils import counters

    counters.clear()
    stats.update(graphs=0, convs=0)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    frames = counters["frames"]
    extras[name] = {
        "first_calls_s": time.perf_counter() - start,
        "graphs": stats["graphs"],
        "convs_compiled": stats["convs"],
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames_skipped": int(frames.get("total", 0) - frames.get("ok", 0)),
        "break_reason": "; ".join(dict.fromkeys(r.splitlines()[0][:120] for r in reasons))[:240],
    }
    H.log(f"compiled {name}: {extras[name]}")


def run(cfg: H.Settings, backend: str, batch: int, size: int, precision: str) -> list[R.Group]:
    from torchvision.models.feature_extraction import create_feature_extractor

    seeded_hub_weights("vgg16")
    plain = load_seeded("vgg16").to(cfg.device)
    ext = fh.FeatureExtractor("vgg16", ["relu3_3"], mode="detach").to(cfg.device)
    pl = PerceptualLoss("vgg16", ["relu3_3"]).to(cfg.device)
    mean, std = ext.mean, ext.std
    fx = create_feature_extractor(plain, return_nodes={"features.15": "relu3_3"}).eval()
    floor_loss = L.Floor(plain.features, ("relu3_3",), mean, std).to(cfg.device)
    truncated = plain.features[:16]
    if precision == "bf16":
        for module in (plain, ext, pl, fx, floor_loss):
            module.to(memory_format=torch.channels_last)
    x = H.images(batch, size, cfg, precision, seed=1)
    y = H.images(batch, size, cfg, precision, seed=2)

    def no_grad(f: Callable[[Tensor], Any]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad(), H.autocast(precision, cfg.device):
                return f(x)

        return call

    leaf = x.detach().clone().requires_grad_(True)

    def step(f: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], Tensor]:
        def call() -> Tensor:
            with H.autocast(precision, cfg.device):
                loss = f(leaf, y)
            return torch.autograd.grad(loss, leaf)[0]

        return call

    def bare(t: Tensor) -> Tensor:
        return truncated((t - mean) / std)

    def fx_call(t: Tensor) -> Tensor:
        return fx((t - mean) / std)["relu3_3"]

    def ext_call(t: Tensor) -> Tensor:
        return ext(t)["relu3_3"]

    # eager warm-up first: the one-time input-range check and lazy init stay out of the compiled steady state
    for f in (bare, fx_call, ext_call):
        no_grad(f)()
    for f in (pl, floor_loss):
        step(f)()

    torch._dynamo.reset()
    stats = {"graphs": 0, "convs": 0}
    compile_kw: dict[str, Any] = {"backend": counting_backend(backend, stats)}
    extract = {
        "bare truncated forward (eager)": no_grad(bare),
        "FeatureExtractor (eager)": no_grad(ext_call),
        "torchvision FX (eager)": no_grad(fx_call),
    }
    loss_steps = {
        "hand-written floor (eager)": step(floor_loss),
        "PerceptualLoss (eager)": step(pl),
    }
    extras: dict[str, dict[str, Any]] = {}
    compiled_ext = torch.compile(ext, **compile_kw)  # the module, as a user would compile it
    compiled_extract = {  # the functions include the normalization, like the extractor does
        "bare truncated forward (compiled)": no_grad(torch.compile(bare, **compile_kw)),
        "FeatureExtractor (compiled)": no_grad(lambda t: compiled_ext(t)["relu3_3"]),
        "torchvision FX (compiled)": no_grad(torch.compile(fx_call, **compile_kw)),
    }
    compiled_steps = {
        "hand-written floor (compiled)": step(torch.compile(floor_loss, **compile_kw)),
        "PerceptualLoss (compiled)": step(torch.compile(pl, **compile_kw)),
    }
    for name, fn in {**compiled_extract, **compiled_steps}.items():
        compiled_call(name, fn, stats, extras)

    reference = extract["bare truncated forward (eager)"]()
    for name, fn in {**extract, **compiled_extract}.items():
        extras.setdefault(name, {})["max_abs_diff"] = H.max_abs_diff(fn(), reference)
    reference = loss_steps["hand-written floor (eager)"]()
    for name, fn in {**loss_steps, **compiled_steps}.items():
        extras.setdefault(name, {})["max_abs_diff"] = H.max_abs_diff(fn(), reference)

    params = {"batch": batch, "size": size, "precision": precision, "backend": backend}
    groups = []
    for title, fns, floor in (
        (EXTRACT, {**extract, **compiled_extract}, "bare truncated forward (eager)"),
        (LOSS, {**loss_steps, **compiled_steps}, "hand-written floor (eager)"),
    ):
        timing = H.time_interleaved(fns, cfg)
        group = R.make_group(title, params, timing, floor, extras)
        H.log(f"{title} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f}" for r in group.rows))
        groups.append(group)
    ext.close()
    pl.extractor.close()
    return groups


# (group, claim, contender, baseline): compiling must not cost more than 5% of the baseline's time
SPEED_TARGETS = (
    (EXTRACT, "FeatureExtractor compiled / FX compiled", "FeatureExtractor (compiled)", "torchvision FX (compiled)"),
    (EXTRACT, "FeatureExtractor compiled / eager", "FeatureExtractor (compiled)", "FeatureExtractor (eager)"),
    (LOSS, "PerceptualLoss compiled / eager", "PerceptualLoss (compiled)", "PerceptualLoss (eager)"),
)
# contender -> convolutions its compiled graphs must hold: relu3_3 needs 7; a loss runs them for input and target
CONVS = {"FeatureExtractor (compiled)": 7, "PerceptualLoss (compiled)": 14}


def targets(groups: list[R.Group]) -> list[R.Target]:
    """Per group: compiled no slower than eager and FX, no graph break in the loss, every convolution compiled."""
    found = []
    for g in groups:
        label = R.format_params(g.params)
        for case, claim, contender, baseline in SPEED_TARGETS:
            if g.case == case:
                found.append(R.Target(claim, label, R.ratio(g, contender, baseline), 1.05, "<="))
        if g.case == LOSS:
            row = g.row("PerceptualLoss (compiled)").extra
            breaks = float(row["graph_breaks"] + row["frames_skipped"])
            claim = "PerceptualLoss compiled: graph breaks + frames run eagerly"
            found.append(R.Target(claim, label, breaks, 0, "<=", unit=""))
        for name, convs in CONVS.items():
            if g.has(name):
                compiled = float(g.row(name).extra["convs_compiled"])
                found.append(
                    R.Target(f"{name}: convolutions in compiled graphs", label, compiled, convs, ">=", unit="")
                )
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; eager with --quick)")
    p.add_argument("--shape", default=None, help="BATCHxSIZE; default 1x224 (CPU), 32x224 (cuda), 1x32 (quick)")
    p.add_argument("--precision", default=None, help="fp32 or bf16 (default: bf16 + channels_last on cuda)")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=20.0)
    backend = args.backend or ("eager" if cfg.quick else "inductor")
    shape = args.shape or ("1x32" if cfg.quick else ("32x224" if cfg.cuda else "1x224"))
    ((batch, size),) = H.parse_shapes(shape)
    precision = args.precision or ("bf16" if cfg.cuda else "fp32")
    with seeded_torch_home(args.torch_home):
        groups = run(cfg, backend, batch, size, precision)
    notes = [
        "ratio = median / median of the eager floor; compiled rows were called 3 times before timing "
        "(*first 3 calls s*: compilation included); *graphs* and *convs compiled* are counted by a wrapper "
        "around the backend (what was really compiled); *graph breaks* and *frames run eagerly* (frames dynamo "
        "gave up on, which it does not count as graph breaks) from dynamo's counters.",
    ]
    config = {"backend": backend, "shape": [batch, size], "precision": precision, "budget_s": cfg.budget}
    payload = R.save(
        "compile",
        "torch.compile: time / eager floor",
        cfg,
        groups,
        targets(groups),
        config,
        notes,
        extra_columns=[
            ("first_calls_s", "first 3 calls s", ".1f"),
            ("graphs", "graphs", "d"),
            ("convs_compiled", "convs compiled", "d"),
            ("graph_breaks", "graph breaks", "d"),
            ("frames_skipped", "frames run eagerly", "d"),
            R.ABS_DIFF_COLUMN,
            ("break_reason", "break reasons", ""),
        ],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
