"""Question: what does recording every attention map cost a forward, with the attention kept fused?

Two timm backbones at 224 px, randomly initialized, in eval mode under ``torch.no_grad``:

- forward (the floor): the model called directly, fused attention (``F.scaled_dot_product_attention``);
- forward + capture_attention: the same model inside ``capture_attention(model)``, every attention module
  recorded (ViT-S/16: 12 maps of 6x197x197; Swin-T: 12 windowed maps), the maps read after each forward.

The target is a ratio of at most 1.3 to the floor. ``--quick`` runs tiny versions of both at 32/56 px.

    python benchmarks/attention.py --threads 1 --clock cpu --batch 2     # seconds
    python benchmarks/attention.py --quick                                # checks the script
"""

from __future__ import annotations

import copy
from typing import Any

import timm
import torch
from torch import nn

from featurehooks.attention import capture_attention

import _harness as H
import _report as R

FLOOR = "forward"
CAPTURED = "forward + capture_attention"
TARGET = 1.3

# case -> (timm name, size, kwargs of the full model, kwargs and size of the quick one)
CASES: dict[str, tuple[str, int, dict[str, Any], tuple[dict[str, Any], int]]] = {
    "timm ViT-S/16 (vit_small_patch16_224)": (
        "vit_small_patch16_224",
        224,
        {},
        ({"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}, 32),
    ),
    "timm Swin-T (swin_tiny_patch4_window7_224)": (
        "swin_tiny_patch4_window7_224",
        224,
        {},
        ({"img_size": 56, "depths": (2, 2), "embed_dim": 16, "num_heads": (1, 2)}, 56),
    ),
}


def build(name: str, kwargs: dict[str, Any], device: torch.device) -> nn.Module:
    torch.manual_seed(H.SEED)
    return timm.create_model(name, pretrained=False, **kwargs).eval().requires_grad_(False).to(device)


def run(case: str, cfg: H.Settings, batch: int) -> R.Group:
    name, size, kwargs, (quick_kwargs, quick_size) = CASES[case]
    if cfg.quick:
        kwargs, size = quick_kwargs, quick_size
    model = build(name, kwargs, cfg.device)
    watched = copy.deepcopy(model)  # the capture's hooks must not slow the floor down
    x = H.images(batch, size, cfg, "fp32")
    with torch.no_grad(), capture_attention(watched) as maps:
        contenders = {FLOOR: lambda: model(x), CAPTURED: lambda: (watched(x), list(maps.values()))}
        timing = H.time_interleaved(contenders, cfg)
        count, elements = len(maps), sum(m.numel() for m in maps.values())
    extras = {FLOOR: {"maps": 0, "map_mb": 0.0}, CAPTURED: {"maps": count, "map_mb": elements * 4 / 2**20}}
    return R.make_group(case, {"mode": "no-grad", "batch": batch, "size": size}, timing, FLOOR, extras)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2, help="images per forward")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=6.0)
    batch = 1 if args.quick else args.batch
    groups = [run(case, cfg, batch) for case in CASES]
    for group in groups:
        H.log(f"{group.case}: " + ", ".join(f"{row.name}={row.median_ms:.1f}ms" for row in group.rows))
    targets = [R.Target(f"{CAPTURED}: time / forward", g.label, g.row(CAPTURED).ratio, TARGET, "<=") for g in groups]
    notes = [
        "Maps are recomputed from each module's own q, k and mask at its fused attention call; the floor keeps "
        "the same fused kernels, and the outputs of both are bitwise equal (tests/extractor/test_attention.py).",
        "*maps*: attention maps recorded per forward; *map MB*: their size in float32.",
    ]
    payload = R.save(
        "attention",
        "Attention maps under fused attention: time / plain forward",
        cfg,
        groups,
        targets,
        {"batch": batch, **cfg.timing_config()},
        notes,
        extra_columns=[("maps", "maps", "d"), ("map_mb", "map MB", ".1f")],
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
