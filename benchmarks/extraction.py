"""Question 1: what does hook-based extraction with early exit cost, next to the alternatives, in each memory format?

Contenders, all fed the same NCHW [0, 1] images and the same seeded weights, all normalizing the
input the same way (``(x - mean) / std`` with the weights' mean/std), all returning the same tensors:

- hand-written NCHW loop (**the floor**, every ratio's denominator): a loop over the model's modules
  up to the deepest requested layer, collecting the taps, no hooks, in PyTorch's default memory
  format (NCHW, ``torch.contiguous_format``);
- hand-written channels_last loop: the same loop over a copy of the model converted with
  ``.to(memory_format=torch.channels_last)``, the images converted before normalizing (as
  FeatureExtractor converts them);
- FeatureExtractor (auto): ``featurehooks.FeatureExtractor(...)`` with its defaults: early exit and
  ``memory_format="auto"``, which runs channels_last where 2-D convolutions do most of the FLOPs up
  to the deepest requested layer (VGG, ResNet) and contiguous otherwise (ConvNeXt, ViT); native
  outputs (tokens for a ViT);
- FeatureExtractor contiguous / channels_last: the same with ``memory_format=`` given;
- FeatureExtractor (auto) / contiguous, ``precision='bf16'`` (and ``'fp16'``): the same extractors with the
  frozen backbone stored in that dtype, wherever featurehooks runs it on the device (``check_device``: bf16 on a
  CPU with AVX512-BF16/AMX or on a CUDA device of compute capability 8.0+; fp16 on CUDA and on AVX512-FP16/AMX-FP16
  CPUs), so their ratios to the float32 floor sit beside the float32 contenders' (bf16 numbers differ from float32
  at bf16 rounding: the *max rel diff* column);
- FeatureExtractor output_format=nchw (ViT only): ``FeatureExtractor(..., output_format="nchw")``,
  ``(B, C, H, W)`` views of the patch tokens (class token dropped, no copy);
- hooks without early exit (VGG16 relu3_3 only): ``FeatureExtractor(..., early_exit=False)``;
- bare full forward (VGG16 relu3_3 only): the whole classification model (logits), no hooks, NCHW;
- torchvision FX: ``torchvision.models.feature_extraction.create_feature_extractor`` (for the ViT with
  timm's own tracer settings, ``timm.layers.get_notrace_modules/functions``, without which it cannot
  trace), NCHW as users run it;
- timm forward_intermediates: ``model.forward_intermediates(stop_early=True, intermediates_only=True)``
  (timm models only; for the ViT with ``output_fmt="NCHW"``: contiguous ``(B, C, H, W)`` maps), NCHW.

The *format* column gives the memory format each backbone ran in (for ``auto``: the one it chose).
Outputs keep their logical shape in every format. Each contender is checked against the hand-written
loop in its own format (*compared with*: max abs diff, and max rel diff ``max|out - ref| / max|ref|``),
and the channels_last loop against the NCHW floor: there they differ at float32 rounding in no-grad
mode (the kernels sum in another order, ~1e-6) and by more in grad mode, where a ReLU or max-pool
near-tie can go the other way and move a gradient entry.

Modes: ``no-grad`` (inference) and ``grad`` (forward, then ``torch.autograd.grad`` of the summed
feature means back to the input, as a loss would). Cases: VGG16 relu3_3; VGG16 relu1_2…relu5_3;
ResNet50 layer1…layer4; timm ConvNeXt-T stages.1+stages.2; timm ViT-S/16 blocks.5+blocks.8 (a token
model: ``vit_small_patch16_224`` with seeded random weights, built with ``dynamic_img_size=True`` so that
every shape runs; the floor there is patch_embed, _pos_embed, patch_drop, norm_pre and blocks 0…8).
In the ViT case the contenders that return maps (FeatureExtractor output_format=nchw, timm) are checked
against the floor's tokens laid out as maps, ``tokens[:, 1:].reshape(B, H/16, W/16, C).permute(0, 3, 1, 2)``
(in ``grad`` mode: the input gradient of the floor's maps), the others against its tokens.
Shapes: CPU ``2x224,8x112`` (the format targets are claims about batches of two and more); CUDA
``1x224,32x224``. With ``--device cuda`` every group also runs under bf16 autocast; the images stay NCHW
and every contender keeps its own memory format there too (the channels_last rows are the bf16 +
channels_last numbers). ``--cases timm-vit`` runs one case.

Targets: in every group, FeatureExtractor (auto) at most 3% slower than FeatureExtractor contiguous and
than the hand-written NCHW loop, and than contiguous in each reduced precision. VGG16 relu3_3: hook overhead
(FeatureExtractor contiguous / NCHW loop and / torchvision FX <= 1.05), early exit (hooks without early exit /
FeatureExtractor), and on the CPU at batch >= 2 without a graph FeatureExtractor (auto) >= 1.1x faster than the
NCHW loop and than torchvision FX (with a graph auto runs NCHW, bitwise the loop's gradients: nothing to gain
there) and, issue 23, ``precision='bf16'`` (auto) >= 1.5x faster than float32 (auto). Timm models:
FeatureExtractor / forward_intermediates <= 1.05 (<= 1.03 for the ViT's nchw maps).

    python benchmarks/extraction.py                  # CPU, ~12 min on 1 thread (2x224 and 8x112)
    python benchmarks/extraction.py --device cuda    # adds bf16 autocast groups
    python benchmarks/extraction.py --quick          # seconds: checks the script, not speed
    python benchmarks/extraction.py --cases vgg16-relu3_3 --modes no-grad --shapes 4x224 --threads 1 --clock cpu
                                                     # issue 23's bf16 target, ~2 min
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import featurehooks as fh

import _harness as H
import _report as R
from _machine import reduced_precisions
from _weights import load_seeded, seeded_hub_weights, seeded_torch_home

FLOOR = "hand-written NCHW loop (floor)"
FLOOR_CL = "hand-written channels_last loop"
FE = "FeatureExtractor (auto)"
FE_CONTIGUOUS = "FeatureExtractor contiguous"
FE_CHANNELS_LAST = "FeatureExtractor channels_last"
FE_NCHW = "FeatureExtractor output_format=nchw"
NO_EE = "hooks without early exit"
FULL = "bare full forward"
FX = "torchvision FX"
TIMM = "timm forward_intermediates"

# FeatureExtractor contenders: their keyword arguments (the rest are defaults)
VARIANTS: dict[str, dict[str, Any]] = {
    FE: {},
    FE_CONTIGUOUS: {"memory_format": "contiguous"},
    FE_CHANNELS_LAST: {"memory_format": "channels_last"},
}
# FeatureExtractor contenders that also run in each reduced precision the device runs (precision_variants)
PRECISION_FORMATS: dict[str, dict[str, Any]] = {FE: {}, FE_CONTIGUOUS: {"memory_format": "contiguous"}}
HEADLINE = "vgg16-relu3_3"  # the case with the early-exit contenders and the speed targets
SPEEDUP = 1.1  # FeatureExtractor (auto) vs the NCHW loop and FX, VGG16 relu3_3, CPU, batch >= 2, no graph
AUTO_SLACK = 1.03  # "auto" never more than 3% slower than NCHW
SHAPES = H.Shapes(quick="1x32,2x32", cpu="2x224,8x112", cuda="1x224,32x224")

VGG_ALL = ["relu1_2", "relu2_2", "relu3_3", "relu4_3", "relu5_3"]
RESNET_ALL = ["layer1", "layer2", "layer3", "layer4"]
TIMM_MODEL = "convnext_tiny"
TIMM_LAYERS = ["stages.1", "stages.2"]
VIT_MODEL = "vit_small_patch16_224"
VIT_LAYERS = ["blocks.5", "blocks.8"]  # of 12: early exit skips blocks 9-11

Loop = Callable[[Tensor], list[Tensor]]


@dataclass
class Models:
    """Everything one case times: FeatureExtractor contenders, plain models and the hand-written loops.

    ``extractors``: contender name -> (no-grad extractor, grad extractor). ``loop(model)``: the
    hand-written truncated forward over ``model``, run over ``plain`` (NCHW) and ``plain_cl`` (a
    channels-last copy). ``full``: also time the whole classification model.
    """

    extractors: dict[str, tuple[fh.FeatureExtractor, fh.FeatureExtractor]]
    plain: nn.Module  # a separate, hook-free copy of the same weights
    loop: Callable[[nn.Module], Loop]
    fx: Loop | None
    timm: Loop | None
    graph: nn.Module | None = None  # the FX GraphModule (moved along with the rest)
    full: bool = False
    # token models: the floor's outputs as maps, (floor outputs, input) -> maps, and the contenders whose
    # outputs are maps
    to_maps: Callable[[list[Tensor], Tensor], list[Tensor]] | None = None
    maps_out: frozenset[str] = frozenset()
    plain_cl: nn.Module = field(init=False)  # a channels-last copy of plain
    truncated: Loop = field(init=False)  # the hand-written loop over plain (the floor)
    truncated_cl: Loop = field(init=False)  # the same loop over plain_cl

    def __post_init__(self) -> None:
        self.plain_cl = copy.deepcopy(self.plain).to(memory_format=torch.channels_last)
        self.truncated = self.loop(self.plain)
        self.truncated_cl = self.loop(self.plain_cl)

    @property
    def reference(self) -> fh.FeatureExtractor:
        """The extractor whose mean/std every contender normalizes with."""
        return self.extractors[FE][0]

    def all_extractors(self) -> list[fh.FeatureExtractor]:
        return [ext for pair in self.extractors.values() for ext in pair]

    def all_modules(self) -> list[nn.Module]:
        extra = [self.graph] if self.graph is not None else []
        return [*self.all_extractors(), self.plain, self.plain_cl, *extra]


def precision_variants(precisions: Sequence[str]) -> dict[str, dict[str, Any]]:
    """FeatureExtractor (auto) and contiguous in each of ``precisions``: what auto chooses there is measured too."""
    return {
        R.with_precision(name, precision): {**options, "precision": precision}
        for precision in precisions
        for name, options in PRECISION_FORMATS.items()
    }


def _extractors(
    backbone: Any,
    layers: list[str],
    *,
    headline: bool,
    precisions: Sequence[str] = (),
    extra: dict[str, dict[str, Any]] | None = None,
    **kwargs: Any,
) -> dict[str, tuple[fh.FeatureExtractor, fh.FeatureExtractor]]:
    """(no-grad, grad) extractors for every FeatureExtractor contender of a case."""
    variants = {
        **VARIANTS,
        **precision_variants(precisions),
        **(extra or {}),
        **({NO_EE: {"early_exit": False}} if headline else {}),
    }
    return {
        name: (
            fh.FeatureExtractor(backbone, layers, mode="detach", **kwargs, **options),
            fh.FeatureExtractor(backbone, layers, mode="grad", **kwargs, **options),
        )
        for name, options in variants.items()
    }


def _tv_fx(plain: nn.Module, paths: list[str], tracer_kwargs: dict[str, Any] | None = None) -> tuple[nn.Module, Loop]:
    from torchvision.models.feature_extraction import create_feature_extractor

    graph = create_feature_extractor(plain, return_nodes={p: p for p in paths}, tracer_kwargs=tracer_kwargs).eval()
    return graph, lambda x: list(graph(x).values())


def build_vgg(layers: list[str], precisions: Sequence[str] = (), headline: bool = False) -> Models:
    seeded_hub_weights("vgg16")
    extractors = _extractors("vgg16", layers, headline=headline, precisions=precisions, weights="DEFAULT")
    plain = load_seeded("vgg16")
    paths = extractors[FE][0].taps.paths
    positions = {int(p.split(".")[1]) for p in paths}

    def loop(model: nn.Module) -> Loop:
        return lambda x: H.truncated_forward(model.features, x, positions)

    graph, fx = _tv_fx(plain, paths)
    return Models(extractors, plain, loop, fx, None, graph, full=headline)


def build_resnet(layers: list[str], precisions: Sequence[str] = ()) -> Models:
    seeded_hub_weights("resnet50")
    extractors = _extractors("resnet50", layers, headline=False, precisions=precisions, weights="DEFAULT")
    plain = load_seeded("resnet50")
    paths = extractors[FE][0].taps.paths
    wanted = set(paths)
    stages = ["layer1", "layer2", "layer3", "layer4"]
    last = max(stages.index(p) for p in wanted)

    def loop(model: nn.Module) -> Loop:
        def truncated(x: Tensor) -> list[Tensor]:
            x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
            out = []
            for name in stages[: last + 1]:
                x = getattr(model, name)(x)
                if name in wanted:
                    out.append(x)
            return out

        return truncated

    graph, fx = _tv_fx(plain, paths)
    return Models(extractors, plain, loop, fx, None, graph)


def build_timm(layers: list[str], precisions: Sequence[str] = ()) -> Models:
    import timm

    torch.manual_seed(H.SEED)
    extractors = _extractors(f"timm/{TIMM_MODEL}", layers, headline=False, precisions=precisions, weights=None)
    first, *others = [ext for pair in extractors.values() for ext in pair]
    state = first.backbone.state_dict()  # float32: FE comes first
    for ext in others:  # every contender runs the same weights (cast to a reduced precision's dtype on loading)
        ext.backbone.load_state_dict(state)
    plain = timm.create_model(TIMM_MODEL, pretrained=False)
    plain.load_state_dict(state)
    plain.eval().requires_grad_(False)
    paths = extractors[FE][0].taps.paths
    indices = sorted(int(p.split(".")[1]) for p in paths)

    def loop(model: nn.Module) -> Loop:
        return lambda x: H.truncated_forward(model.stages, model.stem(x), indices)

    def intermediates(x: Tensor) -> list[Tensor]:
        return plain.forward_intermediates(x, indices=indices, stop_early=True, intermediates_only=True)

    graph, fx = None, None
    try:
        graph, fx = _tv_fx(plain, paths)
    except Exception as exc:  # noqa: BLE001 - FX tracing fails on some models; that is a finding, not a crash
        H.log(f"torchvision FX cannot trace {TIMM_MODEL}: {type(exc).__name__}: {exc}")
    return Models(extractors, plain, loop, fx, intermediates, graph)


def build_vit(layers: list[str], precisions: Sequence[str] = ()) -> Models:
    """timm ViT-S/16: tokens ``(B, 1 + N, C)``; every contender runs one seeded random init of ``plain``."""
    import timm
    from timm.layers import get_notrace_functions, get_notrace_modules

    torch.manual_seed(H.SEED)
    # dynamic_img_size: any multiple of 16 runs (the 112 and --quick shapes); at 224 the pos-embed is used as is
    plain = timm.create_model(VIT_MODEL, pretrained=False, dynamic_img_size=True)
    plain.eval().requires_grad_(False)
    data = timm.data.resolve_data_config({}, model=plain)  # the normalization FeatureExtractor gives timm/<name>
    # each extractor deep-copies plain: the same weights everywhere
    extractors = _extractors(
        plain,
        layers,
        headline=False,
        precisions=precisions,
        extra={FE_NCHW: {"output_format": "nchw"}},
        weights=None,
        mean=data["mean"],
        std=data["std"],
    )
    paths = extractors[FE][0].taps.paths
    indices = sorted(int(p.split(".")[1]) for p in paths)
    prefix = plain.num_prefix_tokens
    patch = plain.patch_embed.patch_size

    def loop(model: nn.Module) -> Loop:
        def truncated(x: Tensor) -> list[Tensor]:
            tokens = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
            return H.truncated_forward(model.blocks, tokens, indices)

        return truncated

    def to_maps(tokens: list[Tensor], x: Tensor) -> list[Tensor]:
        rows, cols = x.shape[-2] // patch[0], x.shape[-1] // patch[1]
        return [t[:, prefix:].reshape(t.shape[0], rows, cols, t.shape[-1]).permute(0, 3, 1, 2) for t in tokens]

    def intermediates(x: Tensor) -> list[Tensor]:
        return plain.forward_intermediates(
            x, indices=indices, stop_early=True, intermediates_only=True, output_fmt="NCHW"
        )

    graph, fx = None, None
    try:  # plain torch.fx cannot trace dynamic_img_size's pos-embed resampling; timm says what to leave opaque
        graph, fx = _tv_fx(
            plain, paths, {"leaf_modules": get_notrace_modules(), "autowrap_functions": get_notrace_functions()}
        )
    except Exception as exc:  # noqa: BLE001 - a finding, not a crash
        H.log(f"torchvision FX cannot trace {VIT_MODEL}: {type(exc).__name__}: {exc}")
    return Models(
        extractors, plain, loop, fx, intermediates, graph, to_maps=to_maps, maps_out=frozenset({FE_NCHW, TIMM})
    )


# case -> (title, its Models given the reduced precisions to add contenders in)
CASES: dict[str, tuple[str, Callable[[Sequence[str]], Models]]] = {
    HEADLINE: ("VGG16 relu3_3", lambda precisions: build_vgg(["relu3_3"], precisions, headline=True)),
    "vgg16-all": ("VGG16 relu1_2…relu5_3", lambda precisions: build_vgg(VGG_ALL, precisions)),
    "resnet50-all": ("ResNet50 layer1…layer4", lambda precisions: build_resnet(RESNET_ALL, precisions)),
    "timm-convnext": (f"timm {TIMM_MODEL} stages.1+stages.2", lambda precisions: build_timm(TIMM_LAYERS, precisions)),
    "timm-vit": (
        f"timm ViT-S/16 ({VIT_MODEL}) blocks.5+blocks.8",
        lambda precisions: build_vit(VIT_LAYERS, precisions),
    ),
}


def _normalizer(ext: fh.FeatureExtractor) -> Callable[[Tensor], Tensor]:
    mean, std = ext.mean.clone(), ext.std.clone()  # own copies: same values, same op as the extractor
    return lambda x: (x - mean) / std


def _timed(
    fn: Callable[[Tensor], list[Tensor]], x: Tensor, mode: str, precision: str, device: torch.device
) -> Callable[[], Any]:
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


def _channels_last(x: Tensor) -> Tensor:
    return x.contiguous(memory_format=torch.channels_last)


def contenders(m: Models, x: Tensor, mode: str, precision: str, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Zero-argument callables for one group; each returns the features (no-grad) or the input gradient (grad)."""
    norm = _normalizer(m.reference)
    pick = 1 if mode == "grad" else 0
    feats: dict[str, Callable[[Tensor], Any]] = {
        FLOOR: lambda t: m.truncated(norm(t)),
        FLOOR_CL: lambda t: m.truncated_cl(norm(_channels_last(t))),  # converted first, as FeatureExtractor does
    }
    for name, pair in m.extractors.items():
        feats[name] = lambda t, ext=pair[pick]: list(ext(t).values())
    if m.full:
        feats[FULL] = lambda t: [m.plain(norm(t))]
    if m.fx is not None:
        feats[FX] = lambda t: m.fx(norm(t))
    if m.timm is not None:
        feats[TIMM] = lambda t: m.timm(norm(t))
    return {name: _timed(fn, x, mode, precision, device) for name, fn in feats.items()}


def formats(m: Models, mode: str) -> dict[str, str]:
    """The memory format each contender's backbone runs in (``auto``: the one it chose on this device)."""
    pick = 1 if mode == "grad" else 0
    found = {FLOOR: "contiguous", FLOOR_CL: "channels_last", FULL: "contiguous", FX: "contiguous", TIMM: "contiguous"}
    return {**found, **{name: pair[pick].memory_format_in_use for name, pair in m.extractors.items()}}


def references(m: Models, x: Tensor, mode: str, precision: str, device: torch.device) -> dict[str, Any]:
    """What contenders must return: the floor's outputs (``"floor"``), the channels-last loop's (``"channels_last
    floor"``), and for token models (``m.maps_out``) their tokens as maps (``"... as maps"``)."""
    norm = _normalizer(m.reference)
    refs = {
        "floor": _timed(lambda t: m.truncated(norm(t)), x, mode, precision, device)(),
        "channels_last floor": _timed(lambda t: m.truncated_cl(norm(_channels_last(t))), x, mode, precision, device)(),
    }
    if m.to_maps is not None:
        to_maps = m.to_maps
        refs["floor as maps"] = _timed(lambda t: to_maps(m.truncated(norm(t)), t), x, mode, precision, device)()
        refs["channels_last floor as maps"] = _timed(
            lambda t: to_maps(m.truncated_cl(norm(_channels_last(t))), t), x, mode, precision, device
        )()
    return refs


def compared_with(m: Models, mode: str, names: list[str]) -> dict[str, str]:
    """The reference of each contender: the loop in its own memory format (channels-last kernels sum in another
    order), the floor's tokens as maps for map outputs of a token model; the channels-last loop itself is
    compared with the floor."""
    layout = formats(m, mode)
    against = {}
    for name in names:
        if name == FULL:  # logits: nothing to compare
            continue
        if name in m.maps_out:
            against[name] = "floor as maps" if layout[name] == "contiguous" else "channels_last floor as maps"
        elif name == FLOOR_CL or layout[name] == "contiguous":
            against[name] = "floor"
        else:
            against[name] = "channels_last floor"
    return against


def run_group(
    case: str, title: str, m: Models, batch: int, size: int, mode: str, precision: str, cfg: H.Settings, budget: float
) -> R.Group:
    # NCHW images under bf16 too: each contender converts them (or not) to its own memory format
    x = H.images(batch, size, cfg, precision).contiguous()
    fns = contenders(m, x, mode, precision, cfg.device)
    # Same outputs, or the timing compares different work (the full forward returns logits: skipped).
    refs = references(m, x, mode, precision, cfg.device)
    against = compared_with(m, mode, list(fns))
    outputs = {name: fns[name]() for name in against}
    abs_diffs = {name: H.max_abs_diff(outputs[name], refs[ref]) for name, ref in against.items()}
    rel_diffs = {name: H.max_rel_diff(outputs[name], refs[ref]) for name, ref in against.items()}
    del outputs
    timing = H.time_interleaved(fns, cfg, budget=budget, min_sample_s=0.02 if cfg.cuda else 0.0)
    layout = formats(m, mode)
    extras = {
        name: {
            "format": layout[name],
            "max_abs_diff": abs_diffs.get(name),
            "max_rel_diff": rel_diffs.get(name),
            "compared_with": against.get(name),
        }
        for name in fns
    }
    params = {"mode": mode, "batch": batch, "size": size, "precision": precision}
    group = R.make_group(title, params, timing, FLOOR, extras)
    H.log(f"{title} {params}: " + ", ".join(f"{r.name}={r.ratio:.3f}" for r in group.rows))
    return group


def targets(groups: list[R.Group], device_type: str = "cpu") -> list[R.Target]:
    """The issues' extraction targets, checked in every group where they apply.

    Every group: ``auto`` at most 3% slower than NCHW (than FeatureExtractor contiguous and than the NCHW
    loop). VGG16 relu3_3: hook overhead and early exit; on the CPU at batch >= 2 without a graph, ``auto``
    >= 1.1x faster than the NCHW loop and than torchvision FX.
    """
    found: list[R.Target] = []
    for g in groups:
        where = g.label
        found.append(R.Target(f"{FE} / {FE_CONTIGUOUS}", where, R.ratio(g, FE, FE_CONTIGUOUS), AUTO_SLACK, "<="))
        found.append(R.Target(f"{FE} / {FLOOR}", where, R.ratio(g, FE, FLOOR), AUTO_SLACK, "<="))
        speedup = device_type == "cpu" and g.params["batch"] >= 2 and g.params["mode"] == "no-grad"
        found += R.precision_targets(g, FE, FE_CONTIGUOUS, AUTO_SLACK, speedup and g.case == CASES[HEADLINE][0])
        if g.case == CASES[HEADLINE][0]:
            found.append(
                R.Target(
                    f"{FE_CONTIGUOUS} / {FLOOR} (hook overhead)", where, R.ratio(g, FE_CONTIGUOUS, FLOOR), 1.05, "<="
                )
            )
            if g.has(FX):
                found.append(
                    R.Target(
                        f"{FE_CONTIGUOUS} / {FX} (hook overhead)", where, R.ratio(g, FE_CONTIGUOUS, FX), 1.05, "<="
                    )
                )
            if device_type == "cpu" and g.params["batch"] >= 2 and g.params["mode"] == "no-grad":
                found.append(R.Target(f"{FLOOR} / {FE} (speed-up)", where, R.ratio(g, FLOOR, FE), SPEEDUP, ">="))
                if g.has(FX):
                    found.append(R.Target(f"{FX} / {FE} (speed-up)", where, R.ratio(g, FX, FE), SPEEDUP, ">="))
            if g.params["mode"] == "no-grad":  # FLOPs cap: 1 / 0.60 = 1.66x
                found.append(R.Target(f"{NO_EE} / {FE}", where, R.ratio(g, NO_EE, FE), 1.4, ">="))
            else:  # frozen weights: backward ~ forward FLOPs up to relu3_3, so the cap is (1 + .6) / (2 * .6) = 1.33x
                found.append(
                    R.Target(f"{NO_EE} / {FE} (grad: FLOPs cap 1.33x)", where, R.ratio(g, NO_EE, FE), 1.0, ">=")
                )
        if g.has(TIMM):
            found.append(R.Target(f"{FE} / {TIMM}", where, R.ratio(g, FE, TIMM), 1.05, "<="))
        if g.has(TIMM) and g.has(FE_NCHW):  # the same (B, C, H, W) maps from a token model
            found.append(R.Target(f"{FE_NCHW} / {TIMM}", where, R.ratio(g, FE_NCHW, TIMM), 1.03, "<="))
    return found


def release_models(m: Models | None) -> None:
    if m is None:
        return
    for module in m.all_extractors():
        module.close()
    H.release_memory()


@contextlib.contextmanager
def _on(m: Models, device: torch.device) -> Iterator[Models]:
    for module in m.all_modules():
        module.to(device)
    yield m


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = H.parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--modes", default="no-grad,grad", help="no-grad, grad or both")
    SHAPES.add_option(p)
    args = p.parse_args(argv)
    cfg = H.settings(args, budget=12.0, quick_budget=0.0)
    shapes = SHAPES.parse(args.shapes, cfg)
    modes = args.modes.split(",")
    precisions = H.precisions(cfg)
    reduced = reduced_precisions(cfg.device)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {list(CASES)}")
    notes = [
        f"*{FLOOR}* is the floor: a hand-written loop up to the deepest requested layer, no hooks, in PyTorch's "
        f"default memory format; *{FLOOR_CL}* is the same loop over a channels-last copy of the model.",
        f"*{FE}*: the defaults (early exit, memory_format='auto': channels_last where 2-D convolutions do most "
        f"of the FLOPs up to the deepest requested layer); *format* says what each backbone ran in. {FX}, timm "
        f"and *{FULL}* run NCHW, as users run them.",
        "Every contender normalizes the same NCHW [0, 1] input with the weights' mean/std and returns the same "
        "tensors as the hand-written loop in its own memory format (*compared with*; max rel diff = "
        f"max|out - ref| / max|ref|); *{FLOOR_CL}* is compared with the floor: in no-grad mode they differ at "
        "float32 rounding (another summation order), in grad mode more, since a ReLU or max-pool near-tie can "
        "go the other way and move a gradient entry. *grad* = forward + autograd.grad of the summed feature "
        f"means to the input; *{FULL}* backpropagates from the logits.",
        f"ViT (tokens): *{FE}*, the floor and FX return tokens; *{FE_NCHW}* (views) and timm (contiguous "
        "copies) return (B, C, H, W) maps, checked against the floor's tokens without the class token, "
        "reshaped to the patch grid (in *grad* mode the loss is then the mean over patch tokens only).",
        "Weights: seeded random (seed 0) torchvision checkpoints in a temporary TORCH_HOME; timm: seeded "
        "random init copied into every contender.",
        "*, precision='bf16'* / *'fp16'* rows: FeatureExtractor(precision=...), the frozen backbone stored once in "
        "that dtype (normalization in float32, autocast off inside), run wherever featurehooks runs it on the device "
        f"(here: {', '.join(reduced) or 'none'}); their *max rel diff* is what the precision costs against the "
        "float32 loop. The group's *precision* is the autocast around every contender (fp32: none).",
    ]
    if "bf16" in cfg.autocasts:
        notes.append(
            "bf16 groups: autocast to bfloat16; the images stay NCHW and every contender keeps its own "
            "memory format (nothing is converted for the whole group)."
        )
    config = {
        "cases": cases,
        "modes": modes,
        "shapes": shapes,
        "precisions": precisions,
        "reduced_precisions": reduced,
        **cfg.timing_config(),
    }
    results = R.Results(
        "extraction",
        "Feature extraction: time / hand-written NCHW loop",
        cfg,
        config,
        lambda groups: targets(groups, cfg.device.type),
        notes,
        [R.FORMAT_COLUMN, ("compared_with", "compared with", ""), R.ABS_DIFF_COLUMN, R.REL_DIFF_COLUMN],
    )
    with seeded_torch_home(args.torch_home):
        for key in cases:
            title, build = CASES[key]
            H.log(f"building {title}")
            models = build(reduced)
            try:
                with _on(models, cfg.device):
                    for precision in precisions:
                        for batch, size in shapes:
                            for mode in modes:
                                # the headline case gets twice the repetitions
                                budget = cfg.budget * (2 if key == HEADLINE else 1)
                                results.add(run_group(key, title, models, batch, size, mode, precision, cfg, budget))
            finally:
                release_models(models)
                del models
    return results.finish()


if __name__ == "__main__":
    main()
