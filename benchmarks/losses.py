"""Question 2: is a training step with featurehooks' losses cheaper than with lpips and piq?

One *step* is what a training loop pays for the loss: the loss of an input that requires grad
against a target that does not, then ``torch.autograd.grad`` back to the input. Every contender
reads the same seeded VGG16 checkpoint (``$TORCH_HOME/hub/checkpoints/vgg16-397923af.pth``), takes
the same [0, 1] images, and reports its loss value (the tables show they compute the same thing,
up to each library's scale convention). Peak memory is measured for one step apart from the timing.

Content groups: PerceptualLoss(relu3_3) vs piq ``ContentLoss(relu3_3)`` vs ``lpips.LPIPS(net="vgg")``
(which always runs its five layers), plus the like-for-like LPIPS baseline: featurehooks'
``featurehooks.LPIPS(net="vgg", calibrated=False)`` vs ``lpips.LPIPS(net="vgg", lpips=False)``.
Style group: StyleLoss vs piq ``StyleLoss`` on relu1_2, relu2_2, relu3_3, relu4_3 with raw Grams
(piq's convention), with a per-call target and with a fixed target (``set_target``).
The floor of each group is a hand-written truncated VGG16 forward with the same distance.

    python benchmarks/losses.py                  # CPU, a few minutes on 2 cores
    python benchmarks/losses.py --device cuda    # adds bf16 autocast + channels_last groups
    python benchmarks/losses.py --quick          # seconds: checks the script, not speed
"""

from __future__ import annotations

import contextlib
import gc
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

from featurehooks import LPIPS as FeatureHooksLPIPS  # noqa: E402
from featurehooks.losses import PerceptualLoss, StyleLoss  # noqa: E402

STYLE_LAYERS = ("relu1_2", "relu2_2", "relu3_3", "relu4_3")
VGG16_INDEX = {"relu1_2": 3, "relu2_2": 8, "relu3_3": 15, "relu4_3": 22, "relu5_3": 29}
CHANNELS = {"relu1_2": 64, "relu2_2": 128, "relu3_3": 256, "relu4_3": 512, "relu5_3": 512}

FLOOR = "bare truncated VGG16 + MSE"
PL = "featurehooks PerceptualLoss"
PIQ = "piq ContentLoss"
LPIPS = "lpips.LPIPS (lin)"
FH_LPIPS = "featurehooks LPIPS(vgg, calibrated=False)"
LPIPS_BASE = "lpips.LPIPS(lpips=False)"
LPIPS_FLOOR = "bare VGG16 relu1_2…relu5_3 + normalized MSE"
STYLE_FLOOR = "bare truncated VGG16 + Gram MSE"
FH_STYLE = "featurehooks StyleLoss"
FH_STYLE_FIXED = "featurehooks StyleLoss, fixed target"
PIQ_STYLE = "piq StyleLoss"


def _quiet() -> contextlib.AbstractContextManager:
    """lpips prints on construction; keep stdout for the report."""
    return contextlib.redirect_stdout(io.StringIO())


class Floor(nn.Module):
    """A hand-written truncated VGG16 loss: normalize, run ``features`` to the deepest tap, compare."""

    def __init__(self, features: nn.Sequential, layers: tuple[str, ...], mean: Tensor, std: Tensor, *,
                 gram: bool = False, lpips: bool = False) -> None:
        super().__init__()
        self.features = features
        self.taps = {VGG16_INDEX[name] for name in layers}
        self.gram = gram
        self.lpips = lpips
        self.register_buffer("mean", mean.clone())
        self.register_buffer("std", std.clone())

    def feats(self, x: Tensor) -> list[Tensor]:
        x = (x - self.mean) / self.std
        out = []
        for i in range(max(self.taps) + 1):
            x = self.features[i](x)
            if i in self.taps:
                out.append(x)
        return out

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        fx = self.feats(x)
        with torch.no_grad():
            fy = self.feats(y)
        total = x.new_zeros((), dtype=torch.float32)
        for a, b in zip(fx, fy):
            if self.gram:
                with torch.autocast(x.device.type, enabled=False):
                    a, b = a.float().flatten(2), b.float().flatten(2)
                    total = total + (a @ a.transpose(1, 2) - b @ b.transpose(1, 2)).pow(2).mean()
            elif self.lpips:  # unit-normalize over channels, sum over channels, mean over positions
                a = a.float() / torch.sqrt(a.float().pow(2).sum(1, keepdim=True) + 1e-10)
                b = b.float() / torch.sqrt(b.float().pow(2).sum(1, keepdim=True) + 1e-10)
                total = total + (a - b).pow(2).sum(1).mean()
            else:
                total = total + (a.float() - b.float()).pow(2).mean()
        return total


def build(cfg: H.Settings) -> dict[str, nn.Module]:
    """Every loss module, on the device, all reading the one seeded VGG16 checkpoint."""
    import lpips
    import piq

    H.seeded_hub_weights("vgg16")
    plain = H.load_seeded("vgg16")
    pl = PerceptualLoss("vgg16", ["relu3_3"])
    mean, std = pl.extractor.mean, pl.extractor.std
    with _quiet():
        lp = lpips.LPIPS(net="vgg", verbose=False)
        lp_base = lpips.LPIPS(net="vgg", lpips=False, verbose=False)
    modules: dict[str, nn.Module] = {
        FLOOR: Floor(plain.features, ("relu3_3",), mean, std),
        LPIPS_FLOOR: Floor(plain.features, tuple(VGG16_INDEX), mean, std, lpips=True),
        PL: pl,
        PIQ: piq.ContentLoss(feature_extractor="vgg16", layers=("relu3_3",)),
        LPIPS: lp,
        FH_LPIPS: FeatureHooksLPIPS(net="vgg", calibrated=False),
        LPIPS_BASE: lp_base,
        STYLE_FLOOR: Floor(plain.features, STYLE_LAYERS, mean, std, gram=True),
        FH_STYLE: StyleLoss("vgg16", list(STYLE_LAYERS), gram_normalization="none"),
        FH_STYLE_FIXED: StyleLoss("vgg16", list(STYLE_LAYERS), gram_normalization="none"),
        PIQ_STYLE: piq.StyleLoss(feature_extractor="vgg16", layers=STYLE_LAYERS, weights=[1.0] * len(STYLE_LAYERS)),
    }
    for module in modules.values():
        module.eval().requires_grad_(False).to(cfg.device)
    return modules


def steps(modules: dict[str, nn.Module], names: list[str], x: Tensor, y: Tensor, precision: str,
          device: torch.device) -> tuple[dict[str, Callable[[], Tensor]], dict[str, float]]:
    """One training step per contender (loss, then grad to the input) and each contender's loss value."""
    leaf = x.detach().clone().requires_grad_(True)
    losses: dict[str, Callable[[Tensor], Tensor]] = {}
    for name in names:
        module = modules[name]
        if name in (LPIPS, LPIPS_BASE):
            losses[name] = lambda a, m=module: m(a, y, normalize=True).mean()  # [0, 1] -> lpips' [-1, 1]
        elif name == FH_STYLE_FIXED:
            losses[name] = lambda a, m=module: m(a)
        else:
            losses[name] = lambda a, m=module: m(a, y)

    def step(loss_fn: Callable[[Tensor], Tensor]) -> Callable[[], Tensor]:
        def call() -> Tensor:
            with H.autocast(precision, device):
                loss = loss_fn(leaf)
            (grad,) = torch.autograd.grad(loss, leaf)
            return grad

        return call

    values = {}
    for name in names:
        with torch.no_grad(), H.autocast(precision, device):
            values[name] = float(losses[name](x))
    return {name: step(fn) for name, fn in losses.items()}, values


def run_group(title: str, names: list[str], modules: dict[str, nn.Module], batch: int, size: int,
              precision: str, cfg: H.Settings, notes: dict[str, str]) -> H.Group:
    x = H.images(batch, size, cfg, precision, seed=1)
    y = H.images(batch, size, cfg, precision, seed=2)
    if FH_STYLE_FIXED in names:
        modules[FH_STYLE_FIXED].clear_target()
        modules[FH_STYLE_FIXED].set_target(y)
    fns, values = steps(modules, names, x, y, precision, cfg.device)
    timing = H.time_interleaved(fns, cfg, min_sample_s=0.02 if cfg.cuda else 0.0)
    peaks = {name: H.peak_memory(fn, cfg.device) for name, fn in fns.items()}
    extras = {
        name: {"loss": values[name], "peak_mib": peaks[name] / 2**20, "note": notes.get(name, "")} for name in names
    }
    params = {"batch": batch, "size": size, "precision": precision}
    group = H.make_group(title, params, timing, names[0], extras)
    H.log(f"{title} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_mib']:.0f} MiB)"
                                           for r in group.rows))
    return group


CONTENT = "Content loss relu3_3"
LPIPS_CASE = "LPIPS baseline, VGG16 relu1_2…relu5_3"
STYLE = "Style loss relu1_2…relu4_3 (raw Grams)"
GROUPS = {
    CONTENT: [FLOOR, PL, PIQ, LPIPS],
    LPIPS_CASE: [LPIPS_FLOOR, FH_LPIPS, LPIPS_BASE],
    STYLE: [STYLE_FLOOR, FH_STYLE, FH_STYLE_FIXED, PIQ_STYLE],
}
NOTES = {
    FLOOR: "relu3_3 only (floor of the content groups)",
    LPIPS: "always all 5 layers + learned 1x1 convs",
    PIQ: "runs all of vgg16.features",
    FH_LPIPS: "5 layers, channel-normalized",
    LPIPS_FLOOR: "5 layers, channel-normalized",
    LPIPS_BASE: "5 layers, channel-normalized",
    FH_STYLE_FIXED: "target Grams computed once",
    STYLE_FLOOR: "up to relu4_3",
}


def targets(groups: list[H.Group]) -> list[H.Target]:
    found = []
    for g in groups:
        label = ", ".join(f"{k}={v}" for k, v in g.params.items())
        if g.case == CONTENT:
            pl = g.row(PL)
            for other in (PIQ, LPIPS):
                found.append(H.Target(f"{other} time / PerceptualLoss time", label, H.ratio(g, other, PL), 1.0, ">="))
                found.append(H.Target(f"PerceptualLoss peak / {other} peak", label,
                                      pl.extra["peak_mib"] / max(g.row(other).extra["peak_mib"], 1e-9), 1.0, "<="))
        if g.case == STYLE:
            found.append(H.Target("piq StyleLoss time / StyleLoss time", label,
                                  H.ratio(g, PIQ_STYLE, FH_STYLE), 1.0, ">="))
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--groups", default="content,lpips,style", help="subset of content, lpips, style")
    p.add_argument("--shapes", default=None, help="BATCHxSIZE list; default 1x224,4x112 (CPU), 8x224,32x224 (cuda)")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=15.0)
    if args.shapes is None:
        args.shapes = "1x32" if cfg.quick else ("8x224,32x224" if cfg.cuda else "1x224,4x112")
    shapes = H.parse_shapes(args.shapes)
    chosen = {"content": CONTENT, "lpips": LPIPS_CASE, "style": STYLE}
    wanted = [chosen[k] for k in args.groups.split(",")]
    groups: list[H.Group] = []
    notes = [
        "ratio = median / median of the group's first row (the hand-written floor); *loss* is each library's "
        "value for the same images (piq ContentLoss = 256 x PerceptualLoss on relu3_3; the LPIPS baselines agree).",
        "peak MiB: memory allocated during one step above what was allocated before it "
        + ("(CUDA caching allocator peak)." if cfg.cuda else "(CPU: profiler allocation events)."),
    ]
    config = {"shapes": shapes, "groups": wanted, "precisions": H.precisions(cfg), "budget_s": cfg.budget,
              "min_reps": cfg.min_reps, "max_reps": cfg.max_reps, "warmup": cfg.warmup}

    def save(partial: bool) -> dict[str, Any]:
        return H.save("losses", "Loss step (loss + gradient to the input): time / hand-written floor", cfg, groups,
                      targets(groups), config, notes, partial=partial,
                      extra_columns=[("peak_mib", "peak MiB", ".0f"), ("loss", "loss", ".4g"), ("note", "note", "")])

    with H.seeded_torch_home(args.torch_home):
        H.log("building losses")
        modules = build(cfg)
        try:
            for precision in H.precisions(cfg):
                if precision == "bf16":
                    for module in modules.values():
                        module.to(memory_format=torch.channels_last)
                for batch, size in shapes:
                    for title in wanted:
                        groups.append(run_group(title, GROUPS[title], modules, batch, size, precision, cfg, NOTES))
                        save(partial=True)
        finally:
            for module in modules.values():
                extractor = getattr(module, "extractor", None)
                if extractor is not None:
                    extractor.close()
            del modules
            gc.collect()
    payload = save(partial=False)
    print((cfg.out / f"losses{cfg.tag}.md").read_text())
    return payload


if __name__ == "__main__":
    main()
