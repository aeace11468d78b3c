"""Question 4: what does one hook cost per call, on a model so small that only the hooks show?

A tiny CNN (a 3->8 1x1 convolution, then 15 blocks of 1x1 conv + ReLU, on a 1x3x16x16 image) runs
in tens of microseconds, so every tap's dispatch, store and bookkeeping is visible:

- bare forward (the floor): the module called directly, no hooks;
- FeatureExtractor, 1 tap: the last block (early exit changes nothing: it is the last module);
- FeatureExtractor, 16 taps: every convolution;
- capture, 16 taps: the same taps on the caller's own module (``fh.capture``), forward inside the block.

The *µs per tap* column is (median - floor median) / taps: the per-call overhead of one hook.

    python benchmarks/hook_overhead.py --threads 1 --clock cpu     # seconds
    python benchmarks/hook_overhead.py --quick                     # checks the script
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import featurehooks as fh

import _harness as H
import _report as R

FLOOR = "bare forward"
ONE = "FeatureExtractor, 1 tap"
ALL = "FeatureExtractor, 16 taps"
CAPTURE = "capture, 16 taps"
CASE = "Tiny CNN, 16 1x1 convs, 1x3x16x16"


def tiny() -> nn.Sequential:
    """16 convolutions (each followed by an out-of-place ReLU, so no tap needs a clone)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 8, 1)]
    for _ in range(15):
        layers += [nn.ReLU(), nn.Conv2d(8, 8, 1)]
    return nn.Sequential(*layers).eval().requires_grad_(False)


def run(cfg: H.Settings) -> R.Group:
    model = tiny().to(cfg.device)
    watched = copy.deepcopy(model)  # the capture's hooks must not slow the floor down
    convs = [path for path, module in model.named_modules() if isinstance(module, nn.Conv2d)]
    one = fh.FeatureExtractor(model, [convs[-1]]).to(cfg.device)
    every = fh.FeatureExtractor(model, convs).to(cfg.device)
    x = torch.rand(1, 3, 16, 16, device=cfg.device)
    with torch.no_grad(), fh.capture(watched, convs, mode="detach") as captured:
        contenders: dict[str, Any] = {
            FLOOR: lambda: model(x),
            ONE: lambda: one(x),
            ALL: lambda: every(x),
            CAPTURE: lambda: (watched(x), captured[convs[-1]]),
        }
        timing = H.time_interleaved(contenders, cfg)
    floor_us = timing.median(FLOOR) * 1e6
    taps = {FLOOR: 0, ONE: 1, ALL: len(convs), CAPTURE: len(convs)}
    extras = {
        name: {"us_per_tap": (timing.median(name) * 1e6 - floor_us) / count if count else None}
        for name, count in taps.items()
    }
    one.close()
    every.close()
    return R.make_group(CASE, {"mode": "no-grad", "batch": 1, "size": 16}, timing, FLOOR, extras)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=4.0)
    group = run(cfg)
    H.log(", ".join(f"{row.name}={row.median_ms * 1e3:.1f}us" for row in group.rows))
    targets = [
        R.Target(f"{name}: µs per tap", CASE, group.row(name).extra["us_per_tap"], 20.0, "<=", unit="µs")
        for name in (ALL, CAPTURE)
    ]
    notes = ["*µs per tap* = (median - median of the bare forward) / number of taps, in microseconds."]
    payload = R.save(
        "hook_overhead",
        "Hook overhead on a tiny model: time / bare forward",
        cfg,
        [group],
        targets,
        {"budget_s": cfg.budget},
        notes,
        extra_columns=[("us_per_tap", "µs per tap", ".1f")],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
