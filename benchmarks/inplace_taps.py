"""Question: what does running a tapped convolution's in-place ReLU out of place save over cloning the tap?

VGG16 ``conv3_3`` with ``relu3_3`` (the ReLU runs before the forward stops, so the conv tap would be
changed in place), seeded DEFAULT weights, NCHW, on the CPU:

- clone (before): the tap is cloned in the hook and the ReLU stays in place (the behaviour of a
  user's own module under ``capture``, and of the extractor before issue 18);
- out of place: the extractor's private backbone runs that ReLU out of place, no clone.

No-grad (the extractor's call) and a grad step (a loss on both taps, backward to the input), at 2x64x64
and 8x112x112. Both contenders return bitwise the same features (checked before timing). A third group per
size times the two ways alone on a conv3_3-sized map (``clone`` + ``relu_`` against ``relu``): the most the
switch can save per forward.

    python benchmarks/inplace_taps.py --threads 1 --clock cpu   # about 4 minutes on 2 cores
    python benchmarks/inplace_taps.py --quick          # checks the script
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import featurehooks as fh
from featurehooks import _tap_session

import _harness as H
import _report as R
from _weights import seeded_hub_weights, seeded_torch_home

CLONE = "clone (before)"
OUT_OF_PLACE = "out of place"
LAYERS = ["conv3_3", "relu3_3"]


def extractors(mode: str, device: torch.device) -> dict[str, fh.FeatureExtractor]:
    """The two contenders, on the same weights; the first with the in-place ReLU kept (and the tap cloned)."""
    keep = _tap_session.release_inplace
    _tap_session.release_inplace = lambda model, found, sites, stop_early: found  # as before: clone every changed tap
    try:
        cloned = fh.FeatureExtractor("vgg16", LAYERS, mode=mode, memory_format="contiguous").to(device)
    finally:
        _tap_session.release_inplace = keep
    released = fh.FeatureExtractor("vgg16", LAYERS, mode=mode, memory_format="contiguous").to(device)
    if released.backbone.get_submodule("features.15").inplace:
        raise SystemExit("the extractor did not switch relu3_3 out of place: is prepare(..., owns_model=True) called?")
    return {CLONE: cloned, OUT_OF_PLACE: released}


def step(extractor: fh.FeatureExtractor, images: torch.Tensor) -> Callable[[], Any]:
    """One loss step: features, a loss on every tap, the gradient to the input."""

    def run() -> torch.Tensor:
        x = images.detach().requires_grad_(True)
        loss = sum(value.square().mean() for value in extractor(x).values())
        (grad,) = torch.autograd.grad(loss, x)
        return grad

    return run


def run_case(cfg: H.Settings, mode: str, batch: int, size: int) -> R.Group:
    contenders = extractors(mode, cfg.device)
    images = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(H.SEED)).to(cfg.device)
    if mode == "grad":
        calls = {name: step(ext, images) for name, ext in contenders.items()}
    else:
        calls = {name: (lambda ext=ext: ext(images)) for name, ext in contenders.items()}
    outputs = {name: call() for name, call in calls.items()}
    diff = H.max_abs_diff(outputs[OUT_OF_PLACE], outputs[CLONE])
    if diff != 0:
        raise SystemExit(f"contenders disagree by {diff} ({mode}, {batch}x{size})")
    timing = H.time_interleaved(calls, cfg)
    params = {"mode": mode, "batch": batch, "size": size}
    group = R.make_group(f"VGG16 conv3_3+relu3_3, {mode}, {batch}x{size}", params, timing, CLONE)
    for ext in contenders.values():
        ext.close()
    return group


def run_ops(cfg: H.Settings, batch: int, size: int, shape: tuple[int, ...]) -> R.Group:
    """The clone plus in-place ReLU against the out-of-place ReLU, on a map shaped like the conv3_3 tap."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(H.SEED)).to(cfg.device)
    calls = {CLONE: lambda: (x.clone(), x.relu_()), OUT_OF_PLACE: lambda: x.relu()}
    timing = H.time_interleaved(calls, cfg, min_sample_s=0.01)
    params = {"mode": "op alone", "batch": batch, "size": size}
    return R.make_group(f"conv3_3 map alone, {batch}x{size}", params, timing, CLONE)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=20.0)
    shapes = [(1, 32)] if cfg.quick else [(2, 64), (8, 112)]
    groups = []
    with seeded_torch_home(args.torch_home):
        seeded_hub_weights("vgg16")
        for batch, size in shapes:
            for mode in ("detach", "grad"):
                groups.append(run_case(cfg, mode, batch, size))
                H.log(f"{groups[-1].case}: out of place / clone = {R.ratio(groups[-1], OUT_OF_PLACE, CLONE):.3f}")
            groups.append(run_ops(cfg, batch, size, (batch, 256, size // 4, size // 4)))
            H.log(f"{groups[-1].case}: out of place / clone = {R.ratio(groups[-1], OUT_OF_PLACE, CLONE):.3f}")
    notes = ["ratio: median / median of the clone contender in the same group (below 1: out of place is faster)."]
    payload = R.save(
        "inplace_taps", "In-place ReLU after a conv tap: out of place vs clone", cfg, groups, [], {}, notes
    )
    return R.publish(cfg, payload)


if __name__ == "__main__":
    main()
