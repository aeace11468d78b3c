"""Question: what does running an extractor's large CPU max pools through the channels-last kernel buy, and does a
small pool ever pay for it?

An extractor's private backbone runs each ``nn.MaxPool2d`` of at least ``POOL_MIN_CHANNELS`` channels and
``POOL_MIN_ELEMENTS`` values through ATen's channels-last kernel on a copy of its input, its output made NCHW again
(``featurehooks._tap_session``); a max is exact, so the features are bitwise those of the NCHW kernel. Two
contenders per group, under ``torch.no_grad``, on the CPU:

- extractor, NCHW kernel (the floor): the same extractor with its pools' forward put back to ``nn.MaxPool2d``'s;
- extractor (default): as built.

Groups: single pools of ResNet, VGG16 and AlexNet at their sizes, pools around the threshold and below it (where the
default must cost nothing), and ResNet-18 up to ``layer4`` as a whole. Target: the default at least as fast as the
floor in every group (0.97, the noise of one run), and 1.5x on the ResNet stem pool.

    python benchmarks/max_pool.py --threads 2 --no-plot   # about 2 minutes
    python benchmarks/max_pool.py --quick                 # checks the script
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from featurehooks import FeatureExtractor
from featurehooks._tap_session import POOL_MIN_CHANNELS, POOL_MIN_ELEMENTS

import _harness as H
import _report as R

FLOOR = "extractor, NCHW kernel"
OURS = "extractor (default)"
NO_SLOWER = 0.97  # the default over the floor's images/s, in every group
STEM_SPEEDUP = 1.5  # on ResNet's stem pool

# case -> (kernel, stride, padding, ceil_mode), (batch, channels, side), its quick shape
POOLS: dict[str, tuple[tuple[int, int, int, bool], tuple[int, int, int], tuple[int, int, int]]] = {
    "ResNet stem pool, batch 8": ((3, 2, 1, False), (8, 64, 112, 112), (1, 64, 32, 32)),
    "ResNet stem pool, batch 1": ((3, 2, 1, False), (1, 64, 112, 112), (1, 64, 32, 32)),
    "VGG16 pool1, batch 8": ((2, 2, 0, False), (8, 64, 224, 224), (1, 64, 32, 32)),
    "VGG16 pool4, batch 8": ((2, 2, 0, False), (8, 512, 28, 28), (1, 512, 8, 8)),
    "AlexNet pool1, batch 8": ((3, 2, 0, False), (8, 64, 55, 55), (1, 64, 16, 16)),
    "at the threshold": ((2, 2, 0, False), (1, POOL_MIN_CHANNELS, 128, POOL_MIN_ELEMENTS // (128 * POOL_MIN_CHANNELS)),
                         (1, POOL_MIN_CHANNELS, 128, 64)),
    "below it: 64 channels of 16x16": ((3, 2, 1, False), (1, 64, 16, 16), (1, 64, 16, 16)),
    "below it: 3 channels of 32x32, batch 2": ((2, 2, 0, True), (2, 3, 32, 32), (2, 3, 32, 32)),
}  # fmt: skip


def nchw_kernel(ext: FeatureExtractor) -> FeatureExtractor:
    """``ext`` with its pools' forward put back to ``nn.MaxPool2d``'s: the floor."""
    for module in ext.backbone.modules():
        module.__dict__.pop("forward", None)
    return ext


def group(case: str, make: Callable[[], FeatureExtractor], x: torch.Tensor, cfg: H.Settings) -> R.Group:
    torch.manual_seed(H.SEED)
    ours = make()
    torch.manual_seed(H.SEED)  # the same random init
    floor = nchw_kernel(make())
    with torch.no_grad():
        reference = floor(x)
        extras = {FLOOR: {"max_abs_diff": 0.0}, OURS: {"max_abs_diff": H.max_abs_diff(ours(x), reference)}}
        timing = H.time_interleaved({FLOOR: lambda: floor(x), OURS: lambda: ours(x)}, cfg)
    params = {"input": "x".join(map(str, x.shape))}
    return R.make_group(case, params, timing, FLOOR, extras)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=6.0)
    groups = []
    for case, ((kernel, stride, padding, ceil), shape, quick) in POOLS.items():
        x = torch.rand(*(quick if cfg.quick else shape), generator=torch.Generator().manual_seed(H.SEED))
        pool = nn.Sequential(nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil))
        groups.append(group(case, lambda pool=pool: FeatureExtractor(pool, ["0"], normalize=False), x, cfg))
    batch, size = (1, 64) if cfg.quick else (8, 224)
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(H.SEED))
    resnet = lambda: FeatureExtractor("resnet18", ["layer4"], weights=None)  # noqa: E731
    groups.append(group("ResNet-18 up to layer4", resnet, x, cfg))
    for g in groups:
        H.log(f"{g.case}: " + ", ".join(f"{row.name}={row.median_ms:.3f}ms" for row in g.rows))
    targets = [R.Target(f"{OURS} / {FLOOR} (speed)", g.label, 1 / g.row(OURS).ratio, NO_SLOWER, ">=") for g in groups]
    targets += [
        R.Target(f"{OURS} / {FLOOR} (speed, ResNet stem)", g.label, 1 / g.row(OURS).ratio, STEM_SPEEDUP, ">=")
        for g in groups
        if g.case.startswith("ResNet stem")
    ]
    notes = [
        f"Pools of at least {POOL_MIN_CHANNELS} channels and {POOL_MIN_ELEMENTS} values run channels-last; *max abs "
        "diff*: the default's features against the floor's (0: bitwise the same).",
    ]
    payload = R.save(
        "max_pool",
        "CPU max pools through the channels-last kernel: time / NCHW kernel",
        cfg,
        groups,
        targets,
        cfg.timing_config(),
        notes,
        extra_columns=[R.ABS_DIFF_COLUMN],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
