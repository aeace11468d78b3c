"""Question 4: is featurehooks' LPIPS at least as fast as lpips.LPIPS, and leaner, as a metric and as a loss?

For each trunk (AlexNet, VGG16, SqueezeNet 1.1) two groups, each contender on the same seeded
torchvision checkpoint and lpips' own calibrated heads, on the same [0, 1] images:

- *metric*: per-image distances of a pair of batches under ``torch.no_grad()``;
- *loss step*: the mean distance of an input that requires grad to a target that does not, then
  ``torch.autograd.grad`` back to the input (what a training loop pays).

Next to ``featurehooks LPIPS`` (its own choice of forward, named in the *forward* column) and
``lpips.LPIPS`` run the module forced to each way of computing the pair, so the choice is measured:
in the metric group one concatenated batch and two forwards; in the loss group one concatenated
forward (a graph through both halves) against its graph-free target forward. Peak memory is taken
for one call of each contender apart from the timing.

    python benchmarks/metrics.py                  # CPU, a few minutes on 2 cores
    python benchmarks/metrics.py --device cuda    # adds bf16 autocast + channels_last groups
    python benchmarks/metrics.py --quick          # seconds: checks the script, not speed
"""

from __future__ import annotations

import contextlib
import gc
import io
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from featurehooks.metrics.lpips import LPIPS, LPIPS_NETS

import _harness as H

FH = "featurehooks LPIPS"
FH_ONE = "featurehooks LPIPS, one concatenated forward"
FH_TWO = "featurehooks LPIPS, two forwards"
REF = "lpips.LPIPS"
METRIC = "metric (no grad)"
LOSS = "loss step (forward + grad to the input)"
NETS = tuple(LPIPS_NETS)
SHAPES = H.Shapes(quick="2x32", cpu="1x224,4x224", cuda="16x224,64x224")


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


def build(net: str, cfg: H.Settings) -> dict[str, nn.Module]:
    """The contenders of one trunk, on the device, all reading its one seeded checkpoint."""
    import lpips

    H.seeded_hub_weights(LPIPS_NETS[net].backbone)
    with contextlib.redirect_stdout(io.StringIO()):  # lpips prints on construction
        reference = lpips.LPIPS(net=net, version="0.1", verbose=False)
    modules: dict[str, nn.Module] = {
        FH: LPIPS(net, reduction="none"),
        FH_ONE: OneForward(net, reduction="none"),
        FH_TWO: TwoForwards(net, reduction="none"),
        REF: reference,
    }
    for module in modules.values():
        module.eval().to(cfg.device)
    return modules


def distance_fn(name: str, module: nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """Per-image distances ``(B,)`` of [0, 1] images, whichever library."""
    if name == REF:
        return lambda a, b: module(a, b, normalize=True).flatten()  # [0, 1] -> lpips' [-1, 1]
    return lambda a, b: module(a, b)


def contenders(
    modules: dict[str, nn.Module], mode: str, x: Tensor, y: Tensor, precision: str, device: torch.device
) -> dict[str, Callable[[], Tensor]]:
    """Zero-argument calls: distances under no_grad (metric) or the gradient to the input (loss step)."""
    names = [FH, FH_ONE, FH_TWO, REF] if mode == METRIC else [FH, FH_ONE, REF]
    leaf = x.detach().clone().requires_grad_(True)
    fns: dict[str, Callable[[], Tensor]] = {}
    for name in names:
        dist = distance_fn(name, modules[name])
        if mode == METRIC:

            def call(d: Callable[[Tensor, Tensor], Tensor] = dist) -> Tensor:
                with torch.no_grad(), H.autocast(precision, device):
                    return d(x, y)
        else:

            def call(d: Callable[[Tensor, Tensor], Tensor] = dist) -> Tensor:
                with H.autocast(precision, device):
                    loss = d(leaf, y).float().mean()
                (grad,) = torch.autograd.grad(loss, leaf)
                return grad

        fns[name] = call
    return fns


def run_group(
    net: str, modules: dict[str, nn.Module], mode: str, batch: int, size: int, precision: str, cfg: H.Settings
) -> H.Group:
    x = H.images(batch, size, cfg, precision, seed=1)
    y = H.images(batch, size, cfg, precision, seed=2)
    fns = contenders(modules, mode, x, y, precision, cfg.device)
    outputs = {name: fn().float() for name, fn in fns.items()}  # also the first warm-up call
    reference = outputs[REF]
    scale = 1.0 if mode == METRIC else float(reference.abs().max())  # gradients: relative to their size
    with torch.no_grad(), H.autocast(precision, cfg.device):
        value = float(distance_fn(REF, modules[REF])(x, y).float().mean())
    extras: dict[str, dict[str, Any]] = {
        name: {"max_abs_diff": H.max_abs_diff(out, reference) / max(scale, 1e-30)} for name, out in outputs.items()
    }
    del outputs
    timing = H.time_interleaved(fns, cfg, min_sample_s=0.02 if cfg.cuda else 0.0)
    for name, fn in fns.items():
        gc.collect()
        extras[name]["peak_mib"] = H.peak_memory(fn, cfg.device) / 2**20
        extras[name]["lpips"] = value
    chosen = FH_ONE if mode == METRIC and modules[FH]._one_forward(x) else FH_TWO
    extras[FH]["forward"] = "one" if chosen == FH_ONE else "two"
    params = {"net": net, "batch": batch, "size": size, "precision": precision}
    group = H.make_group(mode, params, timing, REF, extras)
    H.log(
        f"{mode} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_mib']:.0f} MiB)" for r in group.rows)
    )
    return group


def targets(groups: list[H.Group]) -> list[H.Target]:
    found = []
    for g in groups:
        label = H.format_params(g.params)
        peak = g.row(FH).extra["peak_mib"] / max(g.row(REF).extra["peak_mib"], 1e-9)
        if g.case == METRIC:
            found.append(H.Target("metric: lpips time / LPIPS time (no slower)", label, H.ratio(g, REF, FH), 1.0, ">="))
            found.append(H.Target("metric: LPIPS peak / lpips peak", label, peak, 0.8, "<="))
            chosen, other = (FH_ONE, FH_TWO) if g.row(FH).extra.get("forward") == "one" else (FH_TWO, FH_ONE)
            # two forwards trade a little time for memory: allowed up to 10% over one concatenated forward
            found.append(
                H.Target(
                    f"metric: the forward LPIPS chose ({g.row(FH).extra.get('forward')}) / the other",
                    label,
                    H.ratio(g, chosen, other),
                    1.1,
                    "<=",
                )
            )
        else:
            found.append(H.Target("loss: lpips time / LPIPS time (faster)", label, H.ratio(g, REF, FH), 1.0, ">="))
            found.append(H.Target("loss: LPIPS peak / lpips peak", label, peak, 0.8, "<="))
            found.append(
                H.Target(
                    "loss: graph-free target forward / one concatenated forward",
                    label,
                    H.ratio(g, FH, FH_ONE),
                    1.0,
                    "<=",
                )
            )
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--nets", default=",".join(NETS), help="subset of alex, vgg, squeeze")
    p.add_argument("--modes", default="metric,loss", help="subset of metric, loss")
    SHAPES.add_option(p)
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=10.0)
    shapes = SHAPES.parse(args.shapes, cfg)
    nets = args.nets.split(",")
    modes = [{"metric": METRIC, "loss": LOSS}[m] for m in args.modes.split(",")]
    notes = [
        "ratio = median / median of lpips.LPIPS in the same group (lower is faster); every contender reads the "
        "same seeded trunk checkpoint and lpips' bundled v0.1 heads.",
        "max abs diff: metric, largest difference of the per-image distances from lpips'; loss step, of the "
        "input gradients, relative to the largest lpips gradient.",
        "peak MiB: memory allocated during one call above what was allocated before it "
        + ("(CUDA caching allocator peak)." if cfg.cuda else "(CPU: profiler allocation events)."),
        f"*{FH_ONE}* and *{FH_TWO}* are the module forced to one way; *forward* says which way featurehooks "
        "LPIPS chose (metric: one concatenated batch on a GPU, two forwards on the CPU, where they cost 0.66-0.8x "
        "the memory at about the same time; loss: always a graph-free target forward).",
    ]
    config = {"nets": nets, "modes": modes, "shapes": shapes, "precisions": H.precisions(cfg), **cfg.timing_config()}
    results = H.Results(
        "metrics",
        "LPIPS as a metric and as a loss step: time / lpips.LPIPS",
        cfg,
        config,
        targets,
        notes,
        [
            ("peak_mib", "peak MiB", ".1f"),
            ("max_abs_diff", "max abs diff", ".2g"),
            ("lpips", "LPIPS", ".4g"),
            ("forward", "forward", ""),
        ],
    )
    with H.seeded_torch_home(args.torch_home):
        for net in nets:
            H.log(f"building LPIPS({net!r})")
            modules = build(net, cfg)
            try:
                for precision in H.precisions(cfg):
                    if precision == "bf16":
                        for module in modules.values():
                            module.to(memory_format=torch.channels_last)
                    for batch, size in shapes:
                        for mode in modes:
                            results.add(run_group(net, modules, mode, batch, size, precision, cfg))
            finally:
                for name, module in modules.items():
                    if name != REF:
                        module.extractor.close()
                del modules
                gc.collect()
    return results.finish()


if __name__ == "__main__":
    main()
