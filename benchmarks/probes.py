"""Question 5: are the probes cheap enough to leave on during training?

One *step* is a training step of ResNet50 (random init, train mode): forward of a batch of seeded
images, cross-entropy, backward, SGD step. Contenders run the same step on identical copies of the
model (same initial weights, same batch, so their losses stay equal step after step when a probe
changes nothing), side by side in one run:

- no probes (the baseline);
- ``fh.probes.watch`` on the 16 bottleneck blocks (``layer[1-4].[0-9]``) with gradients, every statistic;
- the same with ``fused=True`` (each call's statistics in one pass compiled by TorchInductor; compiled before
  timing, on a throwaway copy of the model);
- ``fh.probes.detect_nonfinite`` on every module (forward and backward checks);
- hand-written hooks, the usual way: a forward hook per block that reads min, max, mean and std
  with ``.item()``, and a tensor hook on its output doing the same for the gradient;
- the least a finite check by hand can do: a forward hook on every module that sums its output once and reads
  the sum (``math.isfinite(out.sum().item())``), and a tensor hook doing the same for the output's gradient: the
  floor ``detect_nonfinite`` stands against (it also checks inputs, names the origin and keeps masks apart);
- ``torch.autograd.detect_anomaly()`` around the step.

Each image size (112 to 320 px by default) and precision is its own group: the probes' per-call work does not
shrink with the maps the way the step does. ``bf16`` runs the step's forward and loss under
``torch.autocast(dtype=torch.bfloat16)`` (how a model is trained in bf16; where the device computes bf16 natively),
so the probes see bfloat16 outputs and gradients. Targets: watch (either way) <= 1.05x and detect_nonfinite <= 1.05x
of the step without probes, at every size and precision.

A whole step's time moves by several percent from round to round on a shared machine, so after the timed rounds
three more steps time every call into the hooks of watch, detect_nonfinite and the hand-written finite check
(*hooks ms / step*): each one's own cost, which a ratio of whole steps cannot resolve to a percent.

    python benchmarks/probes.py --threads 1 --clock cpu     # about 30 minutes on a shared CPU machine
    python benchmarks/probes.py --precisions bf16 --shapes 8x224
    python benchmarks/probes.py --device cuda
    python benchmarks/probes.py --quick                     # seconds: checks the script, not speed
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from featurehooks.probes.nonfinite import NonFiniteDetector, detect_nonfinite
from featurehooks.probes.watch import Watch, WatchRow, watch

import _harness as H
import _report as R
from _machine import reduced_precisions

BASE = "no probes"
WATCH = "watch, 16 blocks + grads"
FUSED = "watch(fused=True), 16 blocks + grads"
NONFINITE = "detect_nonfinite, every module"
HAND = "hand-written hooks with .item()"
HAND_FINITE = "hand-written finite check, every module"
ANOMALY = "torch.autograd.detect_anomaly"
BLOCKS = "layer[1-4].[0-9]"  # the 16 bottleneck blocks of ResNet50 (fnmatch: * would cross dots)
LR = 1e-3
HOOKS_STEPS = 3  # steps timed inside the probes' hooks, after the interleaved rounds
SHAPES = H.Shapes(quick="2x32", cpu="8x112,8x160,8x224,8x320", cuda="32x112,32x160,32x224,32x320")


def resnet50() -> nn.Module:
    import torchvision.models as tvm

    torch.manual_seed(H.SEED)
    return tvm.resnet50(weights=None)


class HandWritten:
    """The usual per-layer statistics: forward hooks and tensor hooks that read each number with ``.item()``."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        self.stats: dict[str, dict[str, float]] = {}
        self.handles = [model.get_submodule(path).register_forward_hook(self._forward(path)) for path in paths]

    @staticmethod
    def _read(t: Tensor) -> dict[str, float]:
        t = t.detach()
        return {"min": t.min().item(), "max": t.max().item(), "mean": t.mean().item(), "std": t.std().item()}

    def _forward(self, path: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Tensor) -> None:
            self.stats[path] = self._read(output)
            if output.requires_grad:
                output.register_hook(lambda grad: self.stats.__setitem__(f"{path}.grad", self._read(grad)))

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class HandFinite:
    """The least a finite check by hand does: one sum per module output and per gradient, read at once."""

    def __init__(self, model: nn.Module) -> None:
        self.finite = True
        self.handles = [
            module.register_forward_hook(lambda module, args, output: self.forward_hook(module, args, output))
            for path, module in model.named_modules()
            if path
        ]

    def check(self, t: Tensor) -> None:
        self.finite = self.finite and math.isfinite(t.detach().sum().item())

    def forward_hook(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.is_floating_point():
            self.check(output)
            if output.requires_grad:
                output.register_hook(self.check)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class Step:
    """One SGD training step on its own copy of the model, inside ``context`` (a probe or nothing)."""

    def __init__(
        self, model: nn.Module, x: Tensor, y: Tensor, precision: str, wrap: Callable[[], Any] | None = None
    ) -> None:
        self.model = model
        self.x, self.y = x, y
        self.precision = precision
        self.optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        self.wrap = wrap
        self.losses: list[float] = []

    def __call__(self) -> Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if self.wrap is None:
            loss = self._loss_and_backward()
        else:
            with self.wrap():
                loss = self._loss_and_backward()
        self.optimizer.step()
        return loss

    def _loss_and_backward(self) -> Tensor:
        with H.autocast(self.precision, self.x.device):
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.losses.append(float(loss.detach()))  # after backward, like a training loop's logging
        return loss


def _anomaly() -> Any:
    return torch.autograd.detect_anomaly(check_nan=True)


def precisions(given: str | None, cfg: H.Settings) -> list[str]:
    """The precisions asked for; by default fp32, and bf16 where the device computes it natively (not --quick)."""
    if given is not None:
        return given.split(",")
    return ["fp32", "bf16"] if "bf16" in reduced_precisions(cfg.device) and not cfg.quick else ["fp32"]


def run(cfg: H.Settings, batch: int, size: int, precision: str) -> tuple[R.Group, dict[str, Any]]:
    base = resnet50().to(cfg.device).train()
    x = H.images(batch, size, cfg, "fp32")
    y = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(H.SEED)).to(cfg.device)
    models = {name: copy.deepcopy(base) for name in (WATCH, FUSED, NONFINITE, HAND_FINITE, HAND, ANOMALY)}
    blocks = [path for path, _ in base.named_modules() if path.count(".") == 1 and path.startswith("layer")]
    with watch(throwaway := copy.deepcopy(base), BLOCKS, grads=True, fused=True):
        Step(throwaway, x, y, precision)()  # compiles the fused kernel for this step's dtypes, outside the timing
    watcher = watch(models[WATCH], BLOCKS, grads=True)
    fused = watch(models[FUSED], BLOCKS, grads=True, fused=True)
    sentinel = detect_nonfinite(models[NONFINITE])
    hand_finite = HandFinite(models[HAND_FINITE])
    hand = HandWritten(models[HAND], blocks)
    steps = {
        BASE: Step(base, x, y, precision),
        WATCH: Step(models[WATCH], x, y, precision),
        FUSED: Step(models[FUSED], x, y, precision),
        NONFINITE: Step(models[NONFINITE], x, y, precision),
        HAND_FINITE: Step(models[HAND_FINITE], x, y, precision),
        HAND: Step(models[HAND], x, y, precision),
        ANOMALY: Step(models[ANOMALY], x, y, precision, _anomaly),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # anomaly mode warns on every entry
            timing = H.time_interleaved(dict(steps), cfg)
        rows = watcher.summary()
        fused_rows = fused.summary()
        reference = steps[BASE].losses
        extras: dict[str, dict[str, Any]] = {
            name: {
                "steps": len(step.losses),
                "max_abs_diff": max(abs(a - b) for a, b in zip(step.losses, reference)),
                "last_loss": step.losses[-1],
            }
            for name, step in steps.items()
        }
        entries = {  # where each probe's hooks enter its code (methods looked up on the instance at every call)
            WATCH: [*_session_hooks(watcher), (watcher, "_add")],
            FUSED: [*_session_hooks(fused), (fused, "_add")],
            NONFINITE: [*_session_hooks(sentinel), (sentinel._backwards, "note"), (sentinel._backwards, "_end")],
            HAND_FINITE: [(hand_finite, "forward_hook"), (hand_finite, "check")],
        }
        for name, methods in entries.items():  # after the losses are compared: more steps
            extras[name]["hooks_ms"] = hooks_ms(methods, steps[name], cfg)
    finally:
        watcher.close()
        fused.close()
        sentinel.close()
        hand_finite.close()
        hand.close()
    facts = {
        "watched_layers": len({row.path for row in rows}),
        "watch_rows": len(rows),
        "fused_max_rel_diff": _largest_difference(fused_rows, rows),
        "hand_written_layers": len(blocks),
    }
    params = {"mode": "train step", "batch": batch, "size": size, "precision": precision}
    title = f"ResNet50 training step, batch {batch}, {size}x{size}" + (", bf16 autocast" if precision == "bf16" else "")
    return R.make_group(title, params, timing, BASE, extras), facts


def _session_hooks(probe: Watch | NonFiniteDetector) -> list[tuple[object, str]]:
    """The module hooks of a featurehooks probe: a call of a watched module enters its session through these."""
    return [(probe._session, name) for name in ("_open", "_finish", "_close")]


def hooks_ms(methods: list[tuple[object, str]], step: Step, cfg: H.Settings) -> float:
    """Milliseconds a step spends inside a probe's hooks (``methods``: where they enter its code, each patched on its
    instance; time nested in another is counted once), on the run's clock, over a few more steps: the probe's own
    cost, without the noise of a whole step's time (on a GPU: the host's part). Taken after the timed rounds (the
    losses compared above are theirs); the methods are the class's again afterwards, also on an error."""
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    spent = 0.0
    depth = 0

    def timed(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal spent, depth
            if depth:
                return method(*args, **kwargs)
            depth += 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent += clock() - start
                depth -= 1

        return call

    for owner, name in methods:
        setattr(owner, name, timed(getattr(owner, name)))
    count = 1 if cfg.quick else HOOKS_STEPS
    try:
        for _ in range(count):
            step()
    finally:
        for owner, name in methods:
            delattr(owner, name)
    return spent / count * 1e3


def _largest_difference(fused: list[WatchRow], eager: list[WatchRow]) -> float:
    """The largest difference of fused from eager moments and extremes (same steps on identical copies), relative to
    each row's absolute maximum; counts and zero fractions must be equal: a fused run that lost values shows here."""
    exact = ("name", "kind", "calls", "count", "zeros")
    assert [[getattr(r, f) for f in exact] for r in fused] == [[getattr(r, f) for f in exact] for r in eager]
    return max(
        abs(getattr(a, stat) - getattr(b, stat)) / max(b.absmax, 1e-30)
        for a, b in zip(fused, eager)
        for stat in ("mean", "std", "min", "max")
    )


def targets(groups: list[R.Group]) -> list[R.Target]:
    return [
        R.Target(f"{name} / {BASE}", g.case, g.row(name).ratio, 1.05, "<=")
        for g in groups
        for name in (WATCH, FUSED, NONFINITE)
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    SHAPES.add_option(p)
    p.add_argument("--precisions", default=None, help="fp32,bf16 (default: both where bf16 is native; fp32 if --quick)")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=60.0)
    shapes = SHAPES.parse(args.shapes, cfg)
    wanted = precisions(args.precisions, cfg)
    groups, facts, differences = [], {}, []
    for precision in wanted:
        for batch, size in shapes:
            H.log(f"ResNet50 training step, batch {batch}, {size}x{size}, {precision}")
            group, facts = run(cfg, batch, size, precision)
            groups.append(group)
            differences.append(facts["fused_max_rel_diff"])
            H.log(", ".join(f"{row.name}={row.median_ms:.0f}ms ({row.ratio:.3f}x)" for row in group.rows))
    facts["fused_max_rel_diff"] = max(differences)
    notes = [
        f"watch(fused=True) against watch, same steps on identical copies: largest difference of a statistic "
        f"{facts['fused_max_rel_diff']:.1e} of its row's absolute maximum, over every group.",
        f"watch: {facts['watched_layers']} layers ({BLOCKS}), {facts['watch_rows']} rows (outputs and gradients), "
        "every statistic (count, mean, std, min, max, absmax, zeros, nonfinite) on the device, read once after "
        "the run.",
        f"hand-written: {facts['hand_written_layers']} forward hooks + one tensor hook per output, each reading "
        "min, max, mean and std with .item() (8 host reads per layer and step). On the CPU a host read is a plain "
        "memory read, so their cost here is their four reductions (fewer statistics than watch, and poisoned by "
        "any NaN); on a GPU every .item() also waits for the device to finish.",
        "detect_nonfinite: every module (forward: inputs and outputs; backward: gradients of inputs and outputs), "
        "one host read per forward and one per backward.",
        "hand-written finite check: a forward hook on every module summing its output and a tensor hook summing "
        "its gradient, each read with .item(): the floor of reading every output and gradient once, without "
        "inputs, origins or masks.",
        "hooks ms / step: time inside the probe's hooks (module hooks and gradient hooks, from where they enter its "
        "code), over 3 more steps after the timed rounds, on the run's clock (on a GPU the host's part only).",
        "max |Δ loss|: largest difference of a contender's per-step losses from those without probes (identical "
        "copies, same batch): 0 means the probe changed nothing in the computation.",
    ]
    config = {"shapes": shapes, "precisions": wanted, "lr": LR, **cfg.timing_config(), **facts}
    payload = R.save(
        "probes",
        "Probes during a ResNet50 training step: time / step without probes",
        cfg,
        groups,
        targets(groups),
        config,
        notes,
        extra_columns=[
            ("max_abs_diff", "max |Δ loss|", ".2g"),
            ("steps", "steps", "d"),
            ("hooks_ms", "hooks ms / step", ".1f"),
        ],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
