"""Question 2: is a training step with featurehooks' losses cheaper than with lpips and piq, in each memory format?

One *step* is what a training loop pays for the loss: the loss of an input that requires grad
against a target that does not, then ``torch.autograd.grad`` back to the input. Every contender
reads the same seeded VGG16 checkpoint (``$TORCH_HOME/hub/checkpoints/vgg16-397923af.pth``), takes
the same NCHW [0, 1] images, and reports its loss value (the tables show they compute the same thing,
up to each library's scale convention). Peak memory is measured for one step apart from the timing.

The floor of each group (every ratio's denominator) is a hand-written truncated VGG16 forward with
the same distance, in PyTorch's default memory format (NCHW). featurehooks' losses run with their
default ``memory_format="auto"`` (NCHW: a loss step builds a graph, and auto keeps the NCHW gradients
of the code a user ports) and with ``memory_format="contiguous"``; the *format* column says which one
ran. The channels-last loop shows what the opt-in ``memory_format="channels_last"`` could gain.

Content groups: the NCHW floor; the same loop over a channels-last copy of the features (images
converted before normalizing, as featurehooks does); the floor with one forward of the concatenated
input+target batch (what the issue proposed instead of two forwards: the backward then runs over
both halves); PerceptualLoss(relu3_3) auto and contiguous; piq ``ContentLoss(relu3_3)``;
``lpips.LPIPS(net="vgg")`` (which always runs its five layers). LPIPS groups: the like-for-like
baseline, featurehooks' ``featurehooks.LPIPS(net="vgg", calibrated=False)`` auto and contiguous vs
``lpips.LPIPS(net="vgg", lpips=False)``. Style groups: StyleLoss (auto, contiguous, and auto with a
fixed target from ``set_target``) vs piq ``StyleLoss`` on relu1_2, relu2_2, relu3_3, relu4_3 with raw
Grams (piq's convention). Third-party losses run NCHW, as users run them. In every group, featurehooks'
loss (auto and contiguous) also runs with ``precision='bf16'`` (and ``'fp16'``), its frozen VGG16 stored in that
dtype, wherever featurehooks runs it on the device (``check_device``), beside the float32 rows.

Shapes: CPU ``2x224,8x112`` (batch >= 2: the format targets are about batches); CUDA ``8x224,16x224``,
each also under bf16 autocast (images stay NCHW; every contender keeps its own memory format).

Targets: PerceptualLoss (auto) >= 1.3x faster than piq on the CPU at batch >= 2 (elsewhere: not
slower than piq), and not slower than lpips; its peak memory at most piq's and lpips'; in every group
featurehooks (auto) at most 3% slower than contiguous and than the NCHW floor;
the concatenated forward not faster than two (why PerceptualLoss keeps two); StyleLoss not slower
than piq; in each reduced precision auto at most 3% slower than contiguous; issue 23: on the CPU at batch >= 2,
PerceptualLoss ``precision='bf16'`` (auto) >= 1.5x faster than float32 (auto).

    python benchmarks/losses.py                  # CPU, ~10 min on 1 thread (2x224 and 8x112)
    python benchmarks/losses.py --device cuda    # adds bf16 autocast groups
    python benchmarks/losses.py --quick          # seconds: checks the script, not speed
    python benchmarks/losses.py --groups content --shapes 4x224 --threads 1 --clock cpu   # issue 23's bf16 target
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from featurehooks import LPIPS as FeatureHooksLPIPS
from featurehooks.losses import PerceptualLoss, StyleLoss

import _harness as H
import _report as R
from _machine import reduced_precisions
from _weights import load_seeded, seeded_hub_weights, seeded_torch_home

STYLE_LAYERS = ("relu1_2", "relu2_2", "relu3_3", "relu4_3")
VGG16_INDEX = {"relu1_2": 3, "relu2_2": 8, "relu3_3": 15, "relu4_3": 22, "relu5_3": 29}

FLOOR = "hand-written NCHW loop (floor)"
FLOOR_CL = "hand-written channels_last loop"
FLOOR_CAT = "floor, concatenated input+target batch (one forward)"
PL = "featurehooks PerceptualLoss (auto)"
PL_CONTIGUOUS = "PerceptualLoss contiguous"
PIQ = "piq ContentLoss"
LPIPS = "lpips.LPIPS (lin)"
LPIPS_FLOOR = "hand-written NCHW loop, relu1_2…relu5_3 + normalized MSE (floor)"
FH_LPIPS = "featurehooks LPIPS(vgg, calibrated=False) (auto)"
FH_LPIPS_CONTIGUOUS = "featurehooks LPIPS(vgg, calibrated=False) contiguous"
LPIPS_BASE = "lpips.LPIPS(lpips=False)"
STYLE_FLOOR = "hand-written NCHW loop + Gram MSE (floor)"
FH_STYLE = "featurehooks StyleLoss (auto)"
FH_STYLE_CONTIGUOUS = "StyleLoss contiguous"
FH_STYLE_FIXED = "featurehooks StyleLoss (auto), fixed target"
PIQ_STYLE = "piq StyleLoss"

# (auto, contiguous, NCHW floor): "auto" may be at most 3% slower than either, in every group
FORMAT_PAIRS = (
    (PL, PL_CONTIGUOUS, FLOOR),
    (FH_LPIPS, FH_LPIPS_CONTIGUOUS, LPIPS_FLOOR),
    (FH_STYLE, FH_STYLE_CONTIGUOUS, STYLE_FLOOR),
)
SPEEDUP = 1.3  # PerceptualLoss (auto) vs piq, CPU, batch >= 2
AUTO_SLACK = 1.03
SHAPES = H.Shapes(quick="2x32", cpu="2x224,8x112", cuda="8x224,16x224")


def _quiet() -> contextlib.AbstractContextManager:
    """lpips prints on construction; keep stdout for the report."""
    return contextlib.redirect_stdout(io.StringIO())


class Floor(nn.Module):
    """A hand-written truncated VGG16 loss: normalize, run ``features`` to the deepest tap, compare.

    ``channels_last``: convert the images to channels-last first (give it channels-last ``features``);
    ``concatenate``: one forward of ``cat([x, y])`` instead of two (the target half detached).
    """

    def __init__(
        self,
        features: nn.Sequential,
        layers: tuple[str, ...],
        mean: Tensor,
        std: Tensor,
        *,
        gram: bool = False,
        lpips: bool = False,
        channels_last: bool = False,
        concatenate: bool = False,
    ) -> None:
        super().__init__()
        self.features = features
        self.taps = {VGG16_INDEX[name] for name in layers}
        self.gram = gram
        self.lpips = lpips
        self.channels_last = channels_last
        self.concatenate = concatenate
        self.register_buffer("mean", mean.clone())
        self.register_buffer("std", std.clone())

    def feats(self, x: Tensor) -> list[Tensor]:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return H.truncated_forward(self.features, (x - self.mean) / self.std, self.taps)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        if self.concatenate:
            both = self.feats(torch.cat([x, y]))
            fx, fy = [f[: len(x)] for f in both], [f[len(x) :].detach() for f in both]
        else:
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


def featurehooks_losses(precision: str) -> dict[str, Callable[[], nn.Module]]:
    """featurehooks' losses of the three groups, auto and contiguous, computing in ``precision`` (rows named with it
    unless float32), each made when called."""
    made: dict[str, Callable[[], nn.Module]] = {
        PL: lambda: PerceptualLoss("vgg16", ["relu3_3"], precision=precision),
        PL_CONTIGUOUS: lambda: PerceptualLoss("vgg16", ["relu3_3"], memory_format="contiguous", precision=precision),
        FH_LPIPS: lambda: FeatureHooksLPIPS(net="vgg", calibrated=False, precision=precision),
        FH_LPIPS_CONTIGUOUS: lambda: FeatureHooksLPIPS(
            net="vgg", calibrated=False, memory_format="contiguous", precision=precision
        ),
        FH_STYLE: lambda: StyleLoss("vgg16", list(STYLE_LAYERS), gram_normalization="none", precision=precision),
        FH_STYLE_CONTIGUOUS: lambda: StyleLoss(
            "vgg16", list(STYLE_LAYERS), gram_normalization="none", memory_format="contiguous", precision=precision
        ),
    }
    return made if precision == "float32" else {R.with_precision(name, precision): m for name, m in made.items()}


def build(cfg: H.Settings, precisions: Sequence[str], names: Collection[str]) -> dict[str, nn.Module]:
    """The loss modules ``names`` (featurehooks' also in each of ``precisions``), on the device, all reading the one
    seeded VGG16 checkpoint; only those the chosen groups run are built."""
    import lpips
    import piq

    def lpips_vgg(**kwargs: Any) -> nn.Module:
        with _quiet():
            return lpips.LPIPS(net="vgg", verbose=False, **kwargs)

    seeded_hub_weights("vgg16")
    plain = load_seeded("vgg16")
    ours = featurehooks_losses("float32")
    for precision in precisions:
        ours.update(featurehooks_losses(precision))
    perceptual = ours.pop(PL)()  # its mean and std normalize the floors' images too
    mean, std = perceptual.extractor.mean, perceptual.extractor.std
    factories: dict[str, Callable[[], nn.Module]] = {
        FLOOR: lambda: Floor(plain.features, ("relu3_3",), mean, std),
        FLOOR_CL: lambda: Floor(
            copy.deepcopy(plain.features).to(memory_format=torch.channels_last),
            ("relu3_3",),
            mean,
            std,
            channels_last=True,
        ),
        FLOOR_CAT: lambda: Floor(plain.features, ("relu3_3",), mean, std, concatenate=True),
        LPIPS_FLOOR: lambda: Floor(plain.features, tuple(VGG16_INDEX), mean, std, lpips=True),
        PIQ: lambda: piq.ContentLoss(feature_extractor="vgg16", layers=("relu3_3",)),
        LPIPS: lambda: lpips_vgg(),
        LPIPS_BASE: lambda: lpips_vgg(lpips=False),
        STYLE_FLOOR: lambda: Floor(plain.features, STYLE_LAYERS, mean, std, gram=True),
        **ours,
        FH_STYLE_FIXED: lambda: StyleLoss("vgg16", list(STYLE_LAYERS), gram_normalization="none"),
        PIQ_STYLE: lambda: piq.StyleLoss(
            feature_extractor="vgg16", layers=STYLE_LAYERS, weights=[1.0] * len(STYLE_LAYERS)
        ),
    }
    modules = {PL: perceptual} | {name: make() for name, make in factories.items() if name in names}
    for module in modules.values():
        module.eval().requires_grad_(False).to(cfg.device)
    return modules


def release(modules: dict[str, nn.Module]) -> None:
    """Remove the hooks of featurehooks' losses (lpips and piq have none) and drop every module, freeing its memory."""
    for module in modules.values():
        extractor = getattr(module, "extractor", None)
        if extractor is not None:
            extractor.close()
    modules.clear()
    gc.collect()


def memory_format_of(name: str, module: nn.Module) -> str:
    """The memory format a contender's backbone runs in (featurehooks' ``auto``: the one it chose)."""
    extractor = getattr(module, "extractor", None)
    if extractor is not None and hasattr(extractor, "memory_format_in_use"):
        return extractor.memory_format_in_use
    return "channels_last" if getattr(module, "channels_last", False) else "contiguous"


def steps(
    modules: dict[str, nn.Module], names: list[str], x: Tensor, y: Tensor, precision: str, device: torch.device
) -> tuple[dict[str, Callable[[], Tensor]], dict[str, float]]:
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


def run_group(
    title: str,
    names: list[str],
    modules: dict[str, nn.Module],
    batch: int,
    size: int,
    precision: str,
    cfg: H.Settings,
    notes: dict[str, str],
) -> R.Group:
    # NCHW images under bf16 too: each contender converts them (or not) to its own memory format
    x = H.images(batch, size, cfg, precision, seed=1).contiguous()
    y = H.images(batch, size, cfg, precision, seed=2).contiguous()
    if FH_STYLE_FIXED in names:
        modules[FH_STYLE_FIXED].clear_target()
        modules[FH_STYLE_FIXED].set_target(y)
    fns, values = steps(modules, names, x, y, precision, cfg.device)
    timing = H.time_interleaved(fns, cfg, min_sample_s=0.02 if cfg.cuda else 0.0)
    peaks = {name: H.peak_memory(fn, cfg.device) for name, fn in fns.items()}
    extras = {
        name: {
            "format": memory_format_of(name, modules[name]),
            "loss": values[name],
            "peak_mib": peaks[name] / 2**20,
            "note": notes.get(name, ""),
        }
        for name in names
    }
    params = {"batch": batch, "size": size, "precision": precision}
    group = R.make_group(title, params, timing, names[0], extras)
    H.log(
        f"{title} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f} ({r.extra['peak_mib']:.0f} MiB)" for r in group.rows)
    )
    return group


CONTENT = "Content loss relu3_3"
LPIPS_CASE = "LPIPS baseline, VGG16 relu1_2…relu5_3"
STYLE = "Style loss relu1_2…relu4_3 (raw Grams)"
GROUPS = {
    CONTENT: [FLOOR, FLOOR_CL, FLOOR_CAT, PL, PL_CONTIGUOUS, PIQ, LPIPS],
    LPIPS_CASE: [LPIPS_FLOOR, FH_LPIPS, FH_LPIPS_CONTIGUOUS, LPIPS_BASE],
    STYLE: [STYLE_FLOOR, FH_STYLE, FH_STYLE_CONTIGUOUS, FH_STYLE_FIXED, PIQ_STYLE],
}


def contenders(title: str, precisions: Sequence[str]) -> list[str]:
    """The rows of group ``title``: ``GROUPS[title]``, featurehooks' auto and contiguous loss in each of
    ``precisions`` right after its float32 contiguous row."""
    names = list(GROUPS[title])
    for auto, contiguous, _ in FORMAT_PAIRS:
        if contiguous in names:
            at = names.index(contiguous) + 1
            names[at:at] = [R.with_precision(name, p) for p in precisions for name in (auto, contiguous)]
    return names


NOTES = {
    FLOOR: "relu3_3 only (floor of the content groups)",
    FLOOR_CL: "the floor over a channels-last copy",
    FLOOR_CAT: "backward over input and target rows",
    LPIPS: "always all 5 layers + learned 1x1 convs",
    PIQ: "runs all of vgg16.features",
    FH_LPIPS: "5 layers, channel-normalized",
    FH_LPIPS_CONTIGUOUS: "5 layers, channel-normalized",
    LPIPS_FLOOR: "5 layers, channel-normalized",
    LPIPS_BASE: "5 layers, channel-normalized",
    FH_STYLE_FIXED: "target Grams computed once",
    STYLE_FLOOR: "up to relu4_3",
}


def targets(groups: list[R.Group], device_type: str = "cpu") -> list[R.Target]:
    """The issues' loss targets, checked in every group where they apply (the 1.3x ones: CPU, batch >= 2)."""
    found = []
    for g in groups:
        where = g.label
        speedup = device_type == "cpu" and g.params["batch"] >= 2
        if g.case == CONTENT:
            pl = g.row(PL)
            for other in (PIQ, LPIPS):
                limit = SPEEDUP if speedup and other == PIQ else 1.0
                found.append(R.Target(f"{other} time / {PL} time", where, R.ratio(g, other, PL), limit, ">="))
                found.append(
                    R.Target(
                        f"{PL} peak / {other} peak",
                        where,
                        pl.extra["peak_mib"] / max(g.row(other).extra["peak_mib"], 1e-9),
                        1.0,
                        "<=",
                    )
                )
            found.append(
                R.Target(f"{FLOOR_CAT} / {FLOOR} (two forwards stay)", where, R.ratio(g, FLOOR_CAT, FLOOR), 1.0, ">=")
            )
        for auto, contiguous, floor in FORMAT_PAIRS:
            if g.has(auto) and g.has(contiguous):
                found.append(R.Target(f"{auto} / {contiguous}", where, R.ratio(g, auto, contiguous), AUTO_SLACK, "<="))
                found.append(R.Target(f"{auto} / {floor}", where, R.ratio(g, auto, floor), AUTO_SLACK, "<="))
                found += R.precision_targets(g, auto, contiguous, AUTO_SLACK, speedup and auto == PL)
        if g.case == STYLE:
            found.append(
                R.Target(f"{PIQ_STYLE} time / {FH_STYLE} time", where, R.ratio(g, PIQ_STYLE, FH_STYLE), 1.0, ">=")
            )
    return found


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--groups", default="content,lpips,style", help="subset of content, lpips, style")
    SHAPES.add_option(p)
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=15.0)
    shapes = SHAPES.parse(args.shapes, cfg)
    chosen = {"content": CONTENT, "lpips": LPIPS_CASE, "style": STYLE}
    wanted = [chosen[k] for k in args.groups.split(",")]
    reduced = reduced_precisions(cfg.device)
    notes = [
        "ratio = median / median of the group's first row (the hand-written NCHW floor); *loss* is each library's "
        "value for the same images (piq ContentLoss = 256 x PerceptualLoss on relu3_3; the LPIPS baselines agree).",
        "*format*: the memory format each backbone ran in (featurehooks' default memory_format='auto': the one it "
        "chose); piq and lpips run NCHW, as users run them; every contender gets the same NCHW images.",
        f"*{FLOOR_CAT}*: the floor with one forward of cat([input, target]), the target half detached; autograd "
        "then runs the backward over both halves.",
        "peak MiB: memory allocated during one step above what was allocated before it "
        + ("(CUDA caching allocator peak)." if cfg.cuda else "(CPU: profiler allocation events)."),
        "*, precision='bf16'* / *'fp16'* rows: featurehooks' loss with precision=..., its frozen VGG16 stored once in "
        "that dtype, the loss reduced in float32 (its *loss* shows what the precision changes), run wherever "
        f"featurehooks runs it on the device (here: {', '.join(reduced) or 'none'}). The group's *precision* is the "
        "autocast around every contender (fp32: none).",
    ]
    if "bf16" in cfg.autocasts:
        notes.append(
            "bf16 groups: autocast to bfloat16; the images stay NCHW and every contender keeps its own "
            "memory format (nothing is converted for the whole group)."
        )
    config = {
        "shapes": shapes,
        "groups": wanted,
        "precisions": H.precisions(cfg),
        "reduced_precisions": reduced,
        **cfg.timing_config(),
    }
    results = R.Results(
        "losses",
        "Loss step (loss + gradient to the input): time / hand-written NCHW floor",
        cfg,
        config,
        lambda groups: targets(groups, cfg.device.type),
        notes,
        [R.FORMAT_COLUMN, ("peak_mib", "peak MiB", ".0f"), ("loss", "loss", ".4g"), ("note", "note", "")],
    )
    with seeded_torch_home(args.torch_home):
        H.log("building losses")
        modules = build(cfg, reduced, {name for title in wanted for name in contenders(title, reduced)})
        try:
            for precision in H.precisions(cfg):
                for batch, size in shapes:
                    for title in wanted:
                        names = contenders(title, reduced)
                        results.add(run_group(title, names, modules, batch, size, precision, cfg, NOTES))
        finally:
            release(modules)
    return results.finish()


if __name__ == "__main__":
    main()
