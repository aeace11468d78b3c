"""Question 1: what does hook-based extraction with early exit cost, next to the alternatives?

Contenders, all fed the same [0, 1] images and the same seeded weights, all normalizing the input
the same way (``(x - mean) / std`` with the weights' mean/std), all returning the same tensors:

- bare full forward: the whole classification model (logits), no hooks;
- bare truncated forward (**the floor**, every ratio's denominator): a hand-written loop over the
  model's modules up to the deepest requested layer, collecting the taps;
- FeatureExtractor (early exit): ``featurehooks.FeatureExtractor(...)`` (native outputs: tokens for a ViT);
- FeatureExtractor nchw (ViT only): ``FeatureExtractor(..., output_format="nchw")``, ``(B, C, H, W)`` views
  of the patch tokens (class token dropped, no copy);
- hooks without early exit: ``FeatureExtractor(..., early_exit=False)`` (the whole network runs);
- torchvision FX: ``torchvision.models.feature_extraction.create_feature_extractor`` (for the ViT with timm's
  own tracer settings, ``timm.layers.get_notrace_modules/functions``, without which it cannot trace);
- timm forward_intermediates: ``model.forward_intermediates(stop_early=True, intermediates_only=True)``
  (timm models only; for the ViT with ``output_fmt="NCHW"``: contiguous ``(B, C, H, W)`` maps).

Modes: ``no-grad`` (inference) and ``grad`` (forward, then ``torch.autograd.grad`` of the summed
feature means back to the input, as a loss would). Cases: VGG16 relu3_3; VGG16 relu1_2…relu5_3;
ResNet50 layer1…layer4; timm ConvNeXt-T stages.1+stages.2; timm ViT-S/16 blocks.5+blocks.8 (a token
model: ``vit_small_patch16_224`` with seeded random weights, built with ``dynamic_img_size=True`` so that
every shape runs; the floor there is patch_embed, _pos_embed, patch_drop, norm_pre and blocks 0…8).
In the ViT case the contenders that return maps (FeatureExtractor nchw, timm) are checked against the
floor's tokens laid out as maps, ``tokens[:, 1:].reshape(B, H/16, W/16, C).permute(0, 3, 1, 2)`` (in
``grad`` mode: the input gradient of the floor's maps), the others against its tokens.
Shapes: a small and a large batch. With ``--device cuda`` every group also runs under bf16 autocast
with channels_last. ``--cases timm-vit`` runs one case.

    python benchmarks/extraction.py                  # CPU, a few minutes on 2 cores
    python benchmarks/extraction.py --device cuda    # adds bf16 + channels_last groups
    python benchmarks/extraction.py --quick          # seconds: checks the script, not speed
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402

import featurehooks as fh  # noqa: E402

FLOOR = "bare truncated forward"
FULL = "bare full forward"
FE = "FeatureExtractor (early exit)"
FE_NCHW = "FeatureExtractor nchw (early exit)"
NO_EE = "hooks without early exit"
FX = "torchvision FX"
TIMM = "timm forward_intermediates"

VGG_ALL = ["relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"]
RESNET_ALL = ["layer1", "layer2", "layer3", "layer4"]
TIMM_MODEL = "convnext_tiny"
TIMM_LAYERS = ["stages.1", "stages.2"]
VIT_MODEL = "vit_small_patch16_224"
VIT_LAYERS = ["blocks.5", "blocks.8"]  # of 12: early exit skips blocks 9-11


@dataclass
class Models:
    """Everything one case times: extractors in both modes, a plain model and the bare/FX functions."""

    detach: fh.FeatureExtractor
    grad: fh.FeatureExtractor
    detach_full: fh.FeatureExtractor
    grad_full: fh.FeatureExtractor
    plain: nn.Module  # a separate, hook-free copy of the same weights
    truncated: Callable[[Tensor], list[Tensor]]
    fx: Callable[[Tensor], list[Tensor]] | None
    timm: Callable[[Tensor], list[Tensor]] | None
    graph: nn.Module | None = None  # the FX GraphModule (moved along with the rest)
    # token models: extractors with output_format="nchw" (detach, grad), the floor's outputs as maps
    # (floor outputs, input) -> maps, and the contenders whose outputs are maps
    nchw: tuple[fh.FeatureExtractor, fh.FeatureExtractor] | None = None
    to_maps: Callable[[list[Tensor], Tensor], list[Tensor]] | None = None
    maps_out: frozenset[str] = frozenset()

    def extractors(self) -> list[fh.FeatureExtractor]:
        return [self.detach, self.grad, self.detach_full, self.grad_full, *(self.nchw or ())]

    def all_modules(self) -> list[nn.Module]:
        extra = [self.graph] if self.graph is not None else []
        return [*self.extractors(), self.plain, *extra]


def _extractors(backbone: str, layers: list[str], weights: Any) -> tuple[fh.FeatureExtractor, ...]:
    return tuple(
        fh.FeatureExtractor(backbone, layers, weights=weights, mode=mode, early_exit=early)
        for early in (True, False)
        for mode in ("detach", "grad")
    )


def _tv_fx(plain: nn.Module, paths: list[str], tracer_kwargs: dict[str, Any] | None = None
           ) -> tuple[nn.Module, Callable[[Tensor], list[Tensor]]]:
    from torchvision.models.feature_extraction import create_feature_extractor

    graph = create_feature_extractor(plain, return_nodes={p: p for p in paths}, tracer_kwargs=tracer_kwargs).eval()
    return graph, lambda x: list(graph(x).values())


def build_vgg(layers: list[str]) -> Models:
    H.seeded_hub_weights("vgg16")
    detach, grad, detach_full, grad_full = _extractors("vgg16", layers, "DEFAULT")
    plain = H.load_seeded("vgg16")
    paths = detach.taps.paths
    positions = {int(p.split(".")[1]) for p in paths}
    last = max(positions)
    features = plain.features

    def truncated(x: Tensor) -> list[Tensor]:
        out = []
        for i in range(last + 1):
            x = features[i](x)
            if i in positions:
                out.append(x)
        return out

    graph, fx = _tv_fx(plain, paths)
    return Models(detach, grad, detach_full, grad_full, plain, truncated, fx, None, graph)


def build_resnet(layers: list[str]) -> Models:
    H.seeded_hub_weights("resnet50")
    detach, grad, detach_full, grad_full = _extractors("resnet50", layers, "DEFAULT")
    plain = H.load_seeded("resnet50")
    wanted = set(detach.taps.paths)
    stages = ["layer1", "layer2", "layer3", "layer4"]
    last = max(stages.index(p) for p in wanted)

    def truncated(x: Tensor) -> list[Tensor]:
        x = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))
        out = []
        for name in stages[: last + 1]:
            x = getattr(plain, name)(x)
            if name in wanted:
                out.append(x)
        return out

    graph, fx = _tv_fx(plain, detach.taps.paths)
    return Models(detach, grad, detach_full, grad_full, plain, truncated, fx, None, graph)


def build_timm(layers: list[str]) -> Models:
    import timm

    torch.manual_seed(H.SEED)
    detach, grad, detach_full, grad_full = _extractors(f"timm/{TIMM_MODEL}", layers, None)
    state = detach.backbone.state_dict()
    for ext in (grad, detach_full, grad_full):  # every contender runs the same weights
        ext.backbone.load_state_dict(state)
    plain = timm.create_model(TIMM_MODEL, pretrained=False)
    plain.load_state_dict(state)
    plain.eval().requires_grad_(False)
    indices = sorted(int(p.split(".")[1]) for p in detach.taps.paths)

    def truncated(x: Tensor) -> list[Tensor]:
        x = plain.stem(x)
        out = []
        for i in range(indices[-1] + 1):
            x = plain.stages[i](x)
            if i in indices:
                out.append(x)
        return out

    def intermediates(x: Tensor) -> list[Tensor]:
        return plain.forward_intermediates(x, indices=indices, stop_early=True, intermediates_only=True)

    graph, fx = None, None
    try:
        graph, fx = _tv_fx(plain, detach.taps.paths)
    except Exception as exc:  # noqa: BLE001 - FX tracing fails on some models; that is a finding, not a crash
        H.log(f"torchvision FX cannot trace {TIMM_MODEL}: {type(exc).__name__}: {exc}")
    return Models(detach, grad, detach_full, grad_full, plain, truncated, fx, intermediates, graph)


def build_vit(layers: list[str]) -> Models:
    """timm ViT-S/16: tokens ``(B, 1 + N, C)``; every contender runs one seeded random init of ``plain``."""
    import timm
    from timm.layers import get_notrace_functions, get_notrace_modules

    torch.manual_seed(H.SEED)
    # dynamic_img_size: any multiple of 16 runs (the 112 and --quick shapes); at 224 the pos-embed is used as is
    plain = timm.create_model(VIT_MODEL, pretrained=False, dynamic_img_size=True)
    plain.eval().requires_grad_(False)
    data = timm.data.resolve_data_config({}, model=plain)  # the normalization FeatureExtractor gives timm/<name>
    norm = {"mean": data["mean"], "std": data["std"]}
    detach, grad, detach_full, grad_full = (  # each deep-copies plain: the same weights everywhere
        fh.FeatureExtractor(plain, layers, weights=None, mode=mode, early_exit=early, **norm)
        for early in (True, False)
        for mode in ("detach", "grad")
    )
    nchw = tuple(
        fh.FeatureExtractor(plain, layers, weights=None, mode=mode, output_format="nchw", **norm)
        for mode in ("detach", "grad")
    )
    indices = sorted(int(p.split(".")[1]) for p in detach.taps.paths)
    prefix = plain.num_prefix_tokens
    patch = plain.patch_embed.patch_size

    def truncated(x: Tensor) -> list[Tensor]:
        x = plain.norm_pre(plain.patch_drop(plain._pos_embed(plain.patch_embed(x))))
        out = []
        for i in range(indices[-1] + 1):
            x = plain.blocks[i](x)
            if i in indices:
                out.append(x)
        return out

    def to_maps(tokens: list[Tensor], x: Tensor) -> list[Tensor]:
        rows, cols = x.shape[-2] // patch[0], x.shape[-1] // patch[1]
        return [t[:, prefix:].reshape(t.shape[0], rows, cols, t.shape[-1]).permute(0, 3, 1, 2) for t in tokens]

    def intermediates(x: Tensor) -> list[Tensor]:
        return plain.forward_intermediates(x, indices=indices, stop_early=True, intermediates_only=True,
                                           output_fmt="NCHW")

    graph, fx = None, None
    try:  # plain torch.fx cannot trace dynamic_img_size's pos-embed resampling; timm says what to leave opaque
        graph, fx = _tv_fx(plain, detach.taps.paths,
                           {"leaf_modules": get_notrace_modules(), "autowrap_functions": get_notrace_functions()})
    except Exception as exc:  # noqa: BLE001 - a finding, not a crash
        H.log(f"torchvision FX cannot trace {VIT_MODEL}: {type(exc).__name__}: {exc}")
    return Models(detach, grad, detach_full, grad_full, plain, truncated, fx, intermediates, graph,
                  nchw=(nchw[0], nchw[1]), to_maps=to_maps, maps_out=frozenset({FE_NCHW, TIMM}))


CASES: dict[str, tuple[str, Callable[[], Models]]] = {
    "vgg16-relu3_3": ("VGG16 relu3_3", lambda: build_vgg(["relu3_3"])),
    "vgg16-all": ("VGG16 relu1_2…relu5_3", lambda: build_vgg(VGG_ALL)),
    "resnet50-all": ("ResNet50 layer1…layer4", lambda: build_resnet(RESNET_ALL)),
    "timm-convnext": (f"timm {TIMM_MODEL} stages.1+stages.2", lambda: build_timm(TIMM_LAYERS)),
    "timm-vit": (f"timm ViT-S/16 ({VIT_MODEL}) blocks.5+blocks.8", lambda: build_vit(VIT_LAYERS)),
}


def _normalizer(ext: fh.FeatureExtractor) -> Callable[[Tensor], Tensor]:
    mean, std = ext.mean.clone(), ext.std.clone()  # own copies: same values, same op as the extractor
    return lambda x: (x - mean) / std


def _timed(fn: Callable[[Tensor], list[Tensor]], x: Tensor, mode: str, precision: str,
           device: torch.device) -> Callable[[], Any]:
    """A zero-argument call of ``fn`` on ``x``: its features (no-grad) or the input gradient of their summed means."""
    if mode == "no-grad":

        def call() -> Any:
            with torch.no_grad(), H.autocast(precision, device):
                return fn(x)

        return call
    leaf = x.detach().clone().requires_grad_(True)

    def call_grad() -> Any:
        with H.autocast(precision, device):
            out = fn(leaf)
            loss = sum(o.float().mean() for o in out)
        (grad,) = torch.autograd.grad(loss, leaf)
        return grad

    return call_grad


def contenders(m: Models, x: Tensor, mode: str, precision: str, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Zero-argument callables for one group; each returns the features (no-grad) or the input gradient (grad)."""
    norm = _normalizer(m.detach)
    feats: dict[str, Callable[[Tensor], Any]] = {
        FULL: lambda t: [m.plain(norm(t))],
        FLOOR: lambda t: m.truncated(norm(t)),
        FE: lambda t: list((m.grad if mode == "grad" else m.detach)(t).values()),
    }
    if m.nchw is not None:
        detach_nchw, grad_nchw = m.nchw
        feats[FE_NCHW] = lambda t: list((grad_nchw if mode == "grad" else detach_nchw)(t).values())
    feats[NO_EE] = lambda t: list((m.grad_full if mode == "grad" else m.detach_full)(t).values())
    if m.fx is not None:
        feats[FX] = lambda t: m.fx(norm(t))
    if m.timm is not None:
        feats[TIMM] = lambda t: m.timm(norm(t))
    return {name: _timed(fn, x, mode, precision, device) for name, fn in feats.items()}


def references(m: Models, x: Tensor, mode: str, precision: str, device: torch.device) -> dict[str, Any]:
    """What each contender must return: the floor's outputs, or (``m.maps_out``) the floor's tokens as maps."""
    norm = _normalizer(m.detach)
    tokens = _timed(lambda t: m.truncated(norm(t)), x, mode, precision, device)()
    if m.to_maps is None:
        return {"floor": tokens}
    to_maps = m.to_maps
    maps = _timed(lambda t: to_maps(m.truncated(norm(t)), t), x, mode, precision, device)()
    return {"floor": tokens, "floor as maps": maps}


def run_group(case: str, title: str, m: Models, batch: int, size: int, mode: str, precision: str,
              cfg: H.Settings, budget: float) -> H.Group:
    x = H.images(batch, size, cfg, precision)
    fns = contenders(m, x, mode, precision, cfg.device)
    # Same outputs, or the timing compares different work (the full forward returns logits: skipped).
    refs = references(m, x, mode, precision, cfg.device)
    against = {name: "floor as maps" if name in m.maps_out else "floor" for name in fns if name != FULL}
    diffs = {name: H.max_abs_diff(fns[name](), refs[ref]) for name, ref in against.items()}
    timing = H.time_interleaved(fns, cfg, budget=budget, min_sample_s=0.02 if cfg.cuda else 0.0)
    extras = {name: {"max_abs_diff": diffs.get(name), "compared_with": against.get(name)} for name in fns}
    params = {"mode": mode, "batch": batch, "size": size, "precision": precision}
    group = H.make_group(title, params, timing, FLOOR, extras)
    H.log(f"{title} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f}" for r in group.rows))
    return group


def targets(groups: list[H.Group]) -> list[H.Target]:
    """The issue's extraction targets, checked in every group where they apply."""
    found: list[H.Target] = []
    for g in groups:
        label = ", ".join(f"{k}={v}" for k, v in g.params.items())
        if g.case == CASES["vgg16-relu3_3"][0]:
            found.append(H.Target("FeatureExtractor / bare truncated", label, H.ratio(g, FE, FLOOR), 1.05, "<="))
            if g.has(FX):
                found.append(H.Target("FeatureExtractor / torchvision FX", label, H.ratio(g, FE, FX), 1.05, "<="))
            if g.params["mode"] == "no-grad":  # FLOPs cap: 1 / 0.60 = 1.66x
                found.append(H.Target("hooks w/o early exit / FeatureExtractor", label,
                                      H.ratio(g, NO_EE, FE), 1.4, ">="))
            else:  # frozen weights: backward ~ forward FLOPs up to relu3_3, so the cap is (1 + .6) / (2 * .6) = 1.33x
                found.append(H.Target("hooks w/o early exit / FeatureExtractor (grad: FLOPs cap 1.33x)", label,
                                      H.ratio(g, NO_EE, FE), 1.0, ">="))
        if g.has(TIMM):
            found.append(H.Target("FeatureExtractor / timm forward_intermediates", f"{g.case}: {label}",
                                  H.ratio(g, FE, TIMM), 1.05, "<="))
        if g.has(TIMM) and g.has(FE_NCHW):  # the same (B, C, H, W) maps from a token model
            found.append(H.Target("FeatureExtractor nchw / timm forward_intermediates", f"{g.case}: {label}",
                                  H.ratio(g, FE_NCHW, TIMM), 1.03, "<="))
    return found


def _release(m: Models | None) -> None:
    if m is None:
        return
    for module in m.extractors():
        module.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _on(m: Models, device: torch.device) -> Iterator[Models]:
    for module in m.all_modules():
        module.to(device)
    yield m


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--modes", default="no-grad,grad", help="no-grad, grad or both")
    p.add_argument("--shapes", default=None, help="BATCHxSIZE list; default 1x224,4x112 (CPU), 1x224,64x224 (cuda)")
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=12.0, quick_budget=0.0)
    if args.shapes is None:
        args.shapes = "1x32,2x32" if cfg.quick else ("1x224,64x224" if cfg.cuda else "1x224,4x112")
    shapes = H.parse_shapes(args.shapes)
    modes = args.modes.split(",")
    precisions = H.precisions(cfg)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(CASES)}")
    groups: list[H.Group] = []
    notes = [
        f"*{FLOOR}* is the floor: a hand-written loop up to the deepest requested layer, no hooks.",
        "Every contender normalizes the same [0, 1] input with the weights' mean/std and returns the same "
        "tensors (max_abs_diff against the floor); *grad* = forward + autograd.grad of the summed feature "
        f"means to the input; *{FULL}* backpropagates from the logits.",
        f"ViT (tokens): *{FE}*, the floor and FX return tokens; *{FE_NCHW}* (views) and timm (contiguous "
        "copies) return (B, C, H, W) maps, checked against the floor's tokens without the class token, "
        "reshaped to the patch grid (in *grad* mode the loss is then the mean over patch tokens only).",
        "Weights: seeded random (seed 0) torchvision checkpoints in a temporary TORCH_HOME; timm: seeded "
        "random init copied into every contender.",
    ]
    config = {"cases": cases, "modes": modes, "shapes": shapes, "precisions": precisions, "budget_s": cfg.budget,
              "min_reps": cfg.min_reps, "max_reps": cfg.max_reps, "warmup": cfg.warmup}

    def save(partial: bool) -> dict[str, Any]:
        return H.save("extraction", "Feature extraction: time / bare truncated forward", cfg, groups,
                      targets(groups), config, notes, extra_columns=[("max_abs_diff", "max abs diff", ".1e")],
                      partial=partial)

    with H.seeded_torch_home(args.torch_home):
        for key in cases:
            title, build = CASES[key]
            H.log(f"building {title}")
            models = build()
            try:
                with _on(models, cfg.device):
                    for precision in precisions:
                        if precision == "bf16":
                            for module in models.all_modules():
                                module.to(memory_format=torch.channels_last)
                        for batch, size in shapes:
                            for mode in modes:
                                # the headline case gets twice the repetitions
                                budget = cfg.budget * (2 if key == "vgg16-relu3_3" else 1)
                                groups.append(run_group(key, title, models, batch, size, mode, precision, cfg, budget))
                                save(partial=True)
            finally:
                _release(models)
                del models
    payload = save(partial=False)
    print((cfg.out / f"extraction{cfg.tag}.md").read_text())
    return payload


if __name__ == "__main__":
    main()
