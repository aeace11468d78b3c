"""Every torchvision classification model through list_layers and FeatureExtractor, against torchvision FX.

For each model of ``torchvision.models.list_models(module=torchvision.models)`` this pins:

- ``list_layers`` has a row for every ``call_module`` node of FX's eval graph (the graph that
  ``get_graph_node_names`` and ``create_feature_extractor`` trace, torchvision ops as leaves), named
  as FX names it (``path``, ``path_1``, ..., or the row's alias) and with FX's count of calls; and the
  rows of modules that FX sees as leaves and that run are exactly those nodes. One FX quirk is left
  out: FX drops a trailing ``_<n>`` from a module path before numbering its calls, so ViT's
  ``ln_1``/``ln_2`` are FX nodes ``ln``/``ln_1``; those nodes are compared by module path and call.
- ``FeatureExtractor(name, picked, weights=None, mode="grad")`` (every model but the larger members of a family
  in ``REPEATED``) over about six of those nodes spread
  over the depth, plus a repeated call and the last stage container, returns bit for bit what
  ``create_feature_extractor`` returns on the same backbone when each node's value is cloned the
  moment it is computed (FX's own outputs are overwritten by later in-place ops), on the smallest
  input the model takes from 64 pixels up; input gradients agree to float32 rounding.
- Under the default ``memory_format="auto"`` a graph runs NCHW, so every model's input gradients are those
  of the NCHW code a user ports; ``channels_last`` (opt-in) keeps values to 1e-5 of scale. That last check runs
  on ``CHANNELS_LAST_SAMPLE``, one model of each family and the variants whose blocks differ: its NCHW run is
  the code path the FX check covers on every model.

``make test-fast`` runs these checks on ``FAST``; the other models are marked slow.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch
import torchvision
import torchvision.models as tvm
from torch import Tensor, fx, nn
from torchvision.models.feature_extraction import NodePathTracer, create_feature_extractor

import featurehooks as fh
from featurehooks.backbones import build_architecture

from helpers import slow_unless

MODELS = sorted(tvm.list_models(module=tvm))
SEED = 0
PICKS = 6  # leaf nodes spread over the depth, before the repeated call and the stage container are added
SMALL = 64  # input side of models that take any size (AlexNet needs 63): every stage keeps a 2x2 map or more
# Found by trying smaller sizes: Inception v3 needs 75. ViT and MaxViT take only the size they are built
# for, the crop size of their DEFAULT weights (224; vit_h_14: 518).
LARGER_INPUT = {"inception_v3": 75}
FIXED_INPUT = ("vit_", "maxvit_")
# Too slow for the suite (measured single-threaded on its 2-core CPU machine, where every other model takes
# at most 4.5 s); list_layers is still checked for them (meta device, no compute).
TOO_SLOW = {
    "vit_h_14": "a forward and backward at its fixed 518x518 input take 105 s, random init of 632M parameters 5 s",
    "regnet_y_128gf": "random init of 644M parameters takes 5-10 s, the whole check 9 s",
    "vit_l_16": "a forward and backward of ViT-L at its fixed 224x224 input take 6.5 s, the whole check 9 s",
    "vit_l_32": "ViT-L's blocks again (vit_b_32 has its patching): the check took 10 s, the suite's slowest model",
}
# Deeper or wider members of a family whose blocks a smaller member already runs through the FX check: their
# random init (80-145M parameters each) made up most of this file's time; list_layers is still checked for them
# on the meta device, and VGG16 against FX in test_extractor_equivalence.py.
REPEATED = {
    **dict.fromkeys(("vgg13", "vgg16", "vgg19"), "vgg11"),
    **dict.fromkeys(("vgg13_bn", "vgg16_bn", "vgg19_bn"), "vgg11_bn"),
    **dict.fromkeys(("resnet101", "resnet152"), "resnet50"),
    "wide_resnet101_2": "wide_resnet50_2",
    **dict.fromkeys(("resnext101_32x8d", "resnext101_64x4d"), "resnext50_32x4d"),
    **dict.fromkeys(("densenet161", "densenet169", "densenet201"), "densenet121"),
    **dict.fromkeys(("convnext_base", "convnext_large"), "convnext_tiny and convnext_small"),
    **dict.fromkeys(("efficientnet_b5", "efficientnet_b6", "efficientnet_b7"), "efficientnet_b0 ... b4"),
    **dict.fromkeys(("efficientnet_v2_m", "efficientnet_v2_l"), "efficientnet_v2_s"),
    **dict.fromkeys(("regnet_x_16gf", "regnet_x_32gf"), "the smaller RegNetX models"),
    **dict.fromkeys(("regnet_y_16gf", "regnet_y_32gf"), "the smaller RegNetY models"),
    "swin_b": "swin_t and swin_s",
    "swin_v2_b": "swin_v2_t and swin_v2_s",
    "vit_b_16": "vit_b_32 (the same blocks; the patch size is conv_proj's stride)",
}
STAGE_LAYOUTS = ("NCHW", "NHWC", "NLC")
# The smallest model of each family, and the variants whose blocks differ: batch norm (VGG), bottlenecks and
# grouped convolutions (ResNet, ResNeXt), squeeze-excitation (RegNetY), fused MBConv (EfficientNetV2), V1 and
# V2 blocks (SqueezeNet, Swin). Deeper and wider members repeat these blocks. MaxViT (NCHW under "auto"), whose
# fixed 224 px input made it the file's slowest model (16 s), has the FX check only.
CHANNELS_LAST_SAMPLE = (
    "alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet", "inception_v3",
    "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf", "regnet_y_400mf", "resnet18",
    "resnet50", "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_0", "squeezenet1_1", "swin_t", "swin_v2_t",
    "vgg11", "vgg11_bn", "vit_b_32",
)  # fmt: skip
# make test-fast: three quick CNNs (residual blocks, inverted residuals with SE, fire modules); transformers by
# name are in test_transformers.py
FAST = ("resnet18", "mobilenet_v3_small", "squeezenet1_1")

_NUMBERED = re.compile(r"_[0-9]+$")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Hundreds of small forwards: on a 2-core machine with other work, two torch threads wait on each other
    (measured 6.5-7 min for this file, against 111 s with one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class LeafCall:
    """One ``call_module`` node of FX's eval graph: FX's node ``name`` and the module call it runs."""

    name: str
    path: str
    call: int

    @property
    def call_name(self) -> str:
        """The name FX gives the ``call``-th run of a module: ``path``, then ``path_1``, ``path_2``, ..."""
        return f"{self.path}_{self.call}" if self.call else self.path

    @property
    def renamed_by_fx(self) -> bool:
        """FX strips a trailing ``_<n>`` off a path before numbering calls: ViT's ``ln_1`` is node ``ln``."""
        return _NUMBERED.search(self.path) is not None


@dataclass(frozen=True)
class FxGraph:
    """FX's leaf-module calls of one model in execution order, and the module paths FX treats as leaves."""

    calls: tuple[LeafCall, ...]
    leaves: frozenset[str]


def fx_tracer() -> NodePathTracer:
    """The tracer that ``get_graph_node_names`` and ``create_feature_extractor`` build by default (as they
    document it): torchvision ops are leaf modules and, like ``math``, autowrapped."""
    ops = [obj for obj in vars(torchvision.ops).values() if isinstance(obj, type) and issubclass(obj, nn.Module)]
    return NodePathTracer(autowrap_modules=(math, torchvision.ops), leaf_modules=ops)


@functools.cache
def layer_rows(name: str) -> tuple[fh.FeatureInfo, ...]:
    """``fh.list_layers(name)``, computed once for both tests."""
    return tuple(fh.list_layers(name))


@functools.cache
def fx_graph(name: str) -> FxGraph:
    """FX's eval graph of ``name``, traced on the architecture with meta parameters (nothing initialized)."""
    model = build_architecture(name, "DEFAULT").model.eval()
    tracer = fx_tracer()
    graph = tracer.trace(model)
    seen: Counter[str] = Counter()
    calls = []
    for node in graph.nodes:
        if node.op == "call_module":
            calls.append(LeafCall(tracer.node_to_qualname[node], node.target, seen[node.target]))
            seen[node.target] += 1
    leaves = frozenset(path for path, module in model.named_modules() if path and tracer.is_leaf_module(module, path))
    return FxGraph(tuple(calls), leaves)


def ancestors(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b"]``."""
    parts = path.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def fx_visible_sites(rows: Sequence[fh.FeatureInfo], leaves: frozenset[str]) -> set[tuple[str, int]]:
    """(path, call) of the module calls FX records as nodes: leaves that run, inside no leaf that runs."""
    running = {row.path for row in rows if row.calls and row.path in leaves}
    return {
        (row.path, row.call) for row in rows if row.path in running and not running.intersection(ancestors(row.path))
    }


def last_stage(rows: Sequence[fh.FeatureInfo], graph: FxGraph) -> str | None:
    """The last child of the model that holds modules, runs once, outputs a feature map or tokens and
    does not hold the model's last leaf call (the head: SqueezeNet's conv ``classifier`` is not a stage).

    A child that never runs itself (a ModuleList such as MaxViT's ``blocks``) stands for its children.
    """
    first_calls = {row.path: row for row in rows if row.call == 0}
    head = graph.calls[-1].path

    def children(parent: str) -> list[str]:
        prefix, depth = (f"{parent}.", parent.count(".") + 1) if parent else ("", 0)
        return [path for path in first_calls if path.startswith(prefix) and path.count(".") == depth]

    stages = []
    for child in children(""):
        stages.extend(children(child) if first_calls[child].calls == 0 else [child])
    found = [
        path
        for path in stages
        if children(path)
        and first_calls[path].calls == 1
        and first_calls[path].layout in STAGE_LAYOUTS
        and not head.startswith(f"{path}.")
    ]
    return found[-1] if found else None


def pick_nodes(rows: Sequence[fh.FeatureInfo], graph: FxGraph) -> list[str]:
    """PICKS leaf nodes with tensor outputs evenly spread over FX's execution order, one repeated call
    (``..._1``) when the model has one, and the last stage container."""
    by_site = {(row.path, row.call): row for row in rows}
    tensors = [
        call for call in graph.calls if not call.renamed_by_fx and by_site[call.path, call.call].layout != "other"
    ]
    picked = [tensors[round(i * (len(tensors) - 1) / (PICKS - 1))] for i in range(PICKS)]
    repeated = [call for call in tensors if call.call > 0]
    if repeated and not any(call.call > 0 for call in picked):
        picked.append(repeated[len(repeated) // 2])
    stage = last_stage(rows, graph)
    if stage is None:
        return list(dict.fromkeys(call.name for call in picked))
    # create_feature_extractor answers each graph node to one query only: asked for "features.30" (the
    # last node of "features") and for "features", it answers "features" with "features.29".
    stage_end = [call for call in graph.calls if call.path.startswith(f"{stage}.")][-1]
    return list(dict.fromkeys([call.name for call in picked if call != stage_end] + [stage]))


def fx_reference(model: nn.Module, nodes: Sequence[str]) -> fx.GraphModule:
    """``create_feature_extractor(model, nodes)`` returning a clone of each node's value taken right after
    the node runs, before a later in-place op (``ReLU(inplace=True)``, ``+=``) can change it."""
    extractor = create_feature_extractor(model, list(nodes), suppress_diff_warning=True).eval()
    graph = extractor.graph
    output = next(node for node in graph.nodes if node.op == "output")
    clones = {}
    for key, node in output.args[0].items():
        with graph.inserting_after(node):
            clones[key] = graph.call_method("clone", (node,))
    output.args = (clones,)
    extractor.recompile()
    return extractor


def input_side(name: str, crop_size: int) -> int:
    """The side of the square test input: see SMALL, LARGER_INPUT and FIXED_INPUT."""
    return crop_size if name.startswith(FIXED_INPUT) else LARGER_INPUT.get(name, SMALL)


def weighted_sum(features: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> Tensor:
    """A scalar that reaches every element of every feature through its own fixed weight."""
    return sum(((features[key] * weight).sum() for key, weight in weights.items()), torch.zeros(()))


def check_list_layers(rows: Sequence[fh.FeatureInfo], graph: FxGraph) -> None:
    """``list_layers`` has a row for every FX leaf call, named and counted as FX does, and no other running leaf."""
    assert len({row.name for row in rows}) == len(rows), "layer names must be unique"
    by_site = {(row.path, row.call): row for row in rows}
    missing = [call.name for call in graph.calls if (call.path, call.call) not in by_site]
    assert not missing, f"FX nodes without a list_layers row: {missing[:5]}"
    counts = Counter(call.path for call in graph.calls)
    for call in graph.calls:
        assert call.renamed_by_fx or call.name == call.call_name, f"FX named {call} differently"
        row = by_site[call.path, call.call]
        assert (row.name, row.calls) == (row.alias or call.call_name, counts[call.path]), call.name
    assert fx_visible_sites(rows, graph.leaves) == {(call.path, call.call) for call in graph.calls}


def check_features_and_input_gradients(name: str, extractor: fh.FeatureExtractor, picked: list[str]) -> None:
    """The extractor's features equal FX's bit for bit, and its input gradients to float32 rounding."""
    reference = fx_reference(extractor.backbone, picked)
    side = input_side(name, extractor.preprocessing.crop_size or SMALL)
    generator = torch.Generator().manual_seed(SEED)
    images = torch.rand(1, 3, side, side, generator=generator)
    ours_input, theirs_input = images.clone().requires_grad_(), images.clone().requires_grad_()
    ours = extractor(ours_input)
    theirs = reference(extractor.normalize(theirs_input))
    assert list(ours) == picked
    for node in picked:
        torch.testing.assert_close(ours[node], theirs[node], rtol=0, atol=0, msg=lambda m, n=node: f"{n}: {m}")
    weights = {node: torch.randn(ours[node].shape, generator=generator) for node in picked}
    weighted_sum(ours, weights).backward()
    weighted_sum(theirs, weights).backward()
    # Relative to the largest gradient: FX clones every tap and we only those changed in place later, so the
    # two autograd graphs add up the gradients reaching a tensor in different orders, which float32 rounds
    # differently (at most 1.2e-6 of the largest apart, ResNet-50; in float64 1e-14).
    scale = float(theirs_input.grad.abs().max())
    torch.testing.assert_close(ours_input.grad / scale, theirs_input.grad / scale, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", slow_unless(MODELS, FAST))
def test_model_against_fx(name: str) -> None:
    """One model through the three checks of the module docstring, traced and initialized once for all three:
    list_layers against FX's graph; features and input gradients against ``create_feature_extractor``; and, for
    the models of ``CHANNELS_LAST_SAMPLE``, channels-last against NCHW."""
    rows, graph = layer_rows(name), fx_graph(name)
    check_list_layers(rows, graph)
    if name in TOO_SLOW:
        pytest.skip(TOO_SLOW[name])
    if name in REPEATED:
        pytest.skip(f"its blocks run through the FX check in {REPEATED[name]}")
    picked = pick_nodes(rows, graph)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        extractor = fh.FeatureExtractor(name, picked, weights=None, mode="grad")
    with extractor:
        check_features_and_input_gradients(name, extractor, picked)
    if name in CHANNELS_LAST_SAMPLE:
        check_channels_last(name, extractor, picked)


def _run_in_format(
    model: nn.Module, picked: list[str], side: int, memory_format: str, dtype: torch.dtype, grad: bool
) -> tuple[fh.FeatureExtractor, dict, Tensor | None]:
    """Features (float64, detached) of ``model`` in ``memory_format`` and ``dtype`` and, with ``grad``, the
    input gradient of a seeded weighted sum, on a batch of two seeded images."""
    extractor = fh.FeatureExtractor(model, picked, mode="grad", memory_format=memory_format).to(dtype)
    with extractor, torch.set_grad_enabled(grad):
        generator = torch.Generator().manual_seed(SEED)
        images = torch.rand(2, 3, side, side, generator=generator, dtype=dtype).requires_grad_(grad)
        features = extractor(images)
        if grad:
            weights = {node: torch.randn(features[node].shape, generator=generator, dtype=dtype) for node in picked}
            weighted_sum(features, weights).backward()
    values = {node: value.detach().double() for node, value in features.items()}
    return extractor, values, images.grad.double() if grad else None


def check_channels_last(name: str, extractor: fh.FeatureExtractor, picked: list[str]) -> None:
    """Each model of the sample runs in channels-last when asked, with the NCHW values to float32 rounding, 1e-5 of each
    feature's scale. Where "auto" picks channels-last, input gradients too: their norm-relative error from
    a float64 run is at most twice NCHW's (deep random networks amplify float32 rounding in either format,
    a ReLU tie decided the other way moves a whole path: 1% of the norm between the two formats on
    wide_resnet101_2). The others (ViT, Swin, ConvNeXt) run NCHW unless asked, so only their values
    are checked, without a graph. Every run is a copy of the FX check's backbone."""
    auto = fh.FeatureExtractor(extractor.backbone, picked)  # the default format and mode: what "auto" picks
    auto.close()  # its backbone is copied by every run below, without hooks
    side = input_side(name, extractor.preprocessing.crop_size or SMALL)
    grad = auto.memory_format_for((8, 3, 224, 224)) == "channels_last"
    runs = {
        fmt: _run_in_format(auto.backbone, picked, side, fmt, torch.float32, grad)
        for fmt in ("contiguous", "channels_last")
    }
    assert [runs[fmt][0].memory_format_in_use for fmt in runs] == ["contiguous", "channels_last"]
    (_, expected, expected_grad), (_, found, found_grad) = runs["contiguous"], runs["channels_last"]
    for node in picked:
        scale = float(expected[node].abs().max())
        torch.testing.assert_close(found[node], expected[node], rtol=0, atol=1e-5 * scale + 1e-30, msg=node)
    if grad:
        _, _, exact = _run_in_format(auto.backbone, picked, side, "contiguous", torch.float64, grad)
        assert exact is not None and expected_grad is not None and found_grad is not None
        errors = [float((g - exact).norm() / exact.norm()) for g in (expected_grad, found_grad)]
        assert errors[1] <= 2 * errors[0] + 1e-5, f"NCHW {errors[0]:.2e}, channels-last {errors[1]:.2e} from float64"
