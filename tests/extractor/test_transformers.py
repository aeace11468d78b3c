"""Transformer backbones with ``output_format="nchw"``: ViT-style tokens, Swin and MaxViT maps.

Oracles: timm's own ``forward_intermediates`` on the same modules (whose intermediates are the outputs
of ``blocks.<i>`` for ViT-style models, ``layers.<i>`` for Swin, ``stem``/``stages.<i>`` for MaxViT), and
torchvision's native module outputs re-laid out by hand. Every model is small and randomly initialized.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

import featurehooks as fh
from featurehooks._layout import Layout
from featurehooks.errors import InvalidTypeError, InvalidValueError

timm = pytest.importorskip("timm")
from timm.models import maxxvit  # noqa: E402

SEED = 0


# Swin-T's layout at half the width (a quarter of the compute): 48/96/192/384 channels, shifted windows.
SMALL_SWIN = {"img_size": 112, "depths": (2, 2, 2, 2), "embed_dim": 48, "num_heads": (2, 4, 8, 16)}


def create(name: str, **kwargs: Any) -> nn.Module:
    """A seeded, randomly initialized timm model in eval mode, built once per file (initialization is the
    slow part; the extractor deep-copies it and no test changes it).

    MaxViT configurations (``maxvit_rmlp_pico_rw``) take ``depths`` to shrink their stages.
    """
    return _create(name, tuple(sorted(kwargs.items())))


@pytest.fixture(scope="module", autouse=True)
def _release_models() -> Iterator[None]:
    """Drop the models built once for this file when it is done."""
    yield
    _create.cache_clear()
    listed.cache_clear()


@functools.cache
def _create(name: str, items: tuple[tuple[str, Any], ...]) -> nn.Module:
    kwargs = dict(items)
    torch.manual_seed(SEED)
    if "depths" in kwargs and name in maxxvit.model_cfgs:
        cfg = dataclasses.replace(maxxvit.model_cfgs[name], depths=kwargs.pop("depths"))
        return maxxvit.MaxxVit(cfg, **kwargs).eval()
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def images(height: int, width: int, batch: int = 2) -> Tensor:
    """Seeded images in [0, 1] (the range an nn.Module backbone expects: no normalization, no warning)."""
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(SEED))


def timm_intermediates(model: nn.Module, x: Tensor, indices: list[int], **kwargs: Any) -> list[Any]:
    """timm's NCHW intermediates, with (maps, prefix) tuples where the model has a return_prefix_tokens argument."""
    if "return_prefix_tokens" in inspect.signature(model.forward_intermediates).parameters:
        kwargs.setdefault("return_prefix_tokens", True)
    kwargs.setdefault("norm", False)
    return model.forward_intermediates(
        x, indices=indices, output_fmt="NCHW", intermediates_only=True, stop_early=True, **kwargs
    )


def expected_outputs(names: list[str], reference: list[Any]) -> dict[str, Tensor]:
    """timm's intermediates keyed the way the extractor names them: ``name`` and ``name.prefix``."""
    expected: dict[str, Tensor] = {}
    for name, ref in zip(names, reference, strict=True):
        if isinstance(ref, tuple):
            expected[name], expected[f"{name}.prefix"] = ref
        else:
            expected[name] = ref
    return expected


def assert_same_outputs(out: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert list(out) == list(expected)
    for name, value in expected.items():
        assert_close(out[name], value, msg=lambda m, name=name: f"{name}: {m}")


# (model name, create kwargs, input (H, W), layers, timm indices, prefix tokens)
TIMM_CASES = {
    "vit_class_token": (
        "vit_tiny_patch16_224",
        {"img_size": 64, "depth": 4},
        (64, 64),
        ["blocks.0", "blocks.3"],
        [0, 3],
        1,
    ),
    "vit_registers": (
        "vit_small_patch14_reg4_dinov2",
        {"img_size": 56, "depth": 4},
        (56, 56),
        ["blocks.1", "blocks.3"],
        [1, 3],
        5,
    ),
    "deit_distilled": (
        "deit_tiny_distilled_patch16_224",
        {"img_size": 64, "depth": 4},
        (64, 64),
        ["blocks.1", "blocks.3"],
        [1, 3],
        2,
    ),
    "eva02_rope": (
        "eva02_tiny_patch14_224",
        {"img_size": 56, "depth": 4},
        (56, 56),
        ["blocks.0", "blocks.3"],
        [0, 3],
        1,
    ),
    "eva02_rope_dynamic_non_square": (
        "eva02_tiny_patch14_224",
        {"img_size": 56, "depth": 2, "dynamic_img_size": True},
        (56, 84),
        ["blocks.0", "blocks.1"],
        [0, 1],
        1,
    ),
    "vit_dynamic_size_non_square": (
        "vit_tiny_patch16_224",
        {"img_size": 64, "depth": 2, "dynamic_img_size": True},
        (160, 224),
        ["blocks.0", "blocks.1"],
        [0, 1],
        1,
    ),
    "vit_strict_non_square": (
        "vit_tiny_patch16_224",
        {"img_size": (160, 224), "depth": 2},
        (160, 224),
        ["blocks.0", "blocks.1"],
        [0, 1],
        1,
    ),
    "vit_dynamic_pad": (
        "vit_tiny_patch16_224",
        {"img_size": 64, "depth": 2, "dynamic_img_size": True, "dynamic_img_pad": True},
        (150, 220),
        ["blocks.0", "blocks.1"],
        [0, 1],
        1,
    ),
    "swin": (
        "swin_tiny_patch4_window7_224",
        SMALL_SWIN,
        (112, 112),
        ["layers.0", "layers.1", "layers.2", "layers.3"],
        [0, 1, 2, 3],
        0,
    ),
    "maxvit": (
        "maxvit_rmlp_pico_rw",
        {"img_size": 64, "depths": (1, 1, 1, 1)},
        (64, 64),
        ["stem", "stages.0", "stages.1", "stages.2", "stages.3"],
        [0, 1, 2, 3, 4],
        0,
    ),
}


@pytest.mark.parametrize("case", list(TIMM_CASES))
def test_nchw_matches_timm_forward_intermediates(case: str) -> None:
    name, kwargs, (height, width), layers, indices, prefix = TIMM_CASES[case]
    model = create(name, **kwargs)
    assert getattr(model, "num_prefix_tokens", 0) == prefix
    x = images(height, width)
    # normalize=False: a timm instance normalizes as its pretrained_cfg says, and timm's reference takes x as it is
    ext = fh.FeatureExtractor(model, layers, output_format="nchw", return_prefix_tokens=True, normalize=False)
    out = ext(x)
    with torch.no_grad():
        expected = expected_outputs(layers, timm_intermediates(model, x, indices))
    assert_same_outputs(out, expected)  # a ".prefix" output exactly where timm returns prefix tokens
    for layer in layers:
        assert out[layer].dim() == 4 and out[layer].shape[0] == 2
        if prefix:
            assert out[f"{layer}.prefix"].shape == (2, prefix, out[layer].shape[1])
    layouts = ext.output_layouts
    assert list(layouts) == list(out)
    patch_embed = getattr(model, "patch_embed", None)
    for key, value in out.items():
        layout = layouts[key]
        if key.endswith(".prefix"):
            assert layout == Layout("NLC", value.shape[2], None, prefix)
        else:  # tokens: the patch size; maps: the stride at which they cover the input
            stride = patch_embed.patch_size[0] if prefix else height // value.shape[2]
            assert layout == Layout("NCHW", value.shape[1], stride)


def test_maxvit_norm_is_timms_normed_last_intermediate() -> None:
    """timm applies the final norm only to the last stage with norm=True: the output of the ``norm`` module."""
    model = create("maxvit_rmlp_pico_rw", img_size=64, depths=(1, 1, 1, 1))
    x = images(64, 64)
    out = fh.FeatureExtractor(model, ["norm"], output_format="nchw")(x)
    with torch.no_grad():
        (expected,) = timm_intermediates(model, x, [4], norm=True)
    assert_close(out["norm"], expected)


def test_swin_window_attention_stays_native() -> None:
    """Window attention internals (batch = B * windows) are "other" and returned as they are under "nchw"."""
    model = create("swin_tiny_patch4_window7_224", **SMALL_SWIN)
    names = ["layers.0.blocks.1.attn", "layers.0"]
    ext = fh.FeatureExtractor(model, names, output_format="nchw", return_prefix_tokens=True)
    assert ext.output_layouts["layers.0.blocks.1.attn"].kind == "other"
    assert ext.output_layouts["layers.0"] == Layout("NCHW", 48, 4)
    out = ext(images(112, 112))
    assert list(out) == names
    assert out["layers.0.blocks.1.attn"].shape == (2 * 16, 49, 48)  # 28x28 positions in 7x7 windows
    assert out["layers.0"].shape == (2, 48, 28, 28)


# ---------------------------------------------------------------------------------------------- layouts


def test_output_layouts_native_and_nchw() -> None:
    model = create("vit_tiny_patch16_224", img_size=64, depth=2)
    layers = ["patch_embed", "blocks.1", "head"]
    native = fh.FeatureExtractor(model, layers)
    nchw = fh.FeatureExtractor(model, layers, output_format="nchw", return_prefix_tokens=True)
    assert native.output_layouts == {
        "patch_embed": Layout("NLC", 192, 16, 0),
        "blocks.1": Layout("NLC", 192, 16, 1),
        "head": Layout("NC", 1000),
    }
    assert nchw.output_layouts == {
        "patch_embed": Layout("NCHW", 192, 16),
        "blocks.1": Layout("NCHW", 192, 16),
        "blocks.1.prefix": Layout("NLC", 192, None, 1),
        "head": Layout("NC", 1000),
    }
    x = images(64, 64)
    native_out, nchw_out = native(x), nchw(x)
    assert list(nchw_out) == list(nchw.output_layouts)  # patch_embed has no prefix tokens: no "patch_embed.prefix"
    assert {k: tuple(v.shape) for k, v in native_out.items()} == {
        "patch_embed": (2, 16, 192),
        "blocks.1": (2, 17, 192),
        "head": (2, 1000),
    }
    assert_close(nchw_out["patch_embed"], native_out["patch_embed"].reshape(2, 4, 4, 192).permute(0, 3, 1, 2))
    assert_close(nchw_out["blocks.1"], native_out["blocks.1"][:, 1:].reshape(2, 4, 4, 192).permute(0, 3, 1, 2))
    assert_close(nchw_out["blocks.1.prefix"], native_out["blocks.1"][:, :1])
    assert_close(nchw_out["head"], native_out["head"])


def test_output_layouts_of_swin_native_and_nchw() -> None:
    model = create("swin_tiny_patch4_window7_224", **SMALL_SWIN)
    native = fh.FeatureExtractor(model, ["layers.0", "layers.2"])
    nchw = fh.FeatureExtractor(model, ["layers.0", "layers.2"], output_format="nchw")
    assert native.output_layouts == {"layers.0": Layout("NHWC", 48, 4), "layers.2": Layout("NHWC", 192, 16)}
    assert nchw.output_layouts == {"layers.0": Layout("NCHW", 48, 4), "layers.2": Layout("NCHW", 192, 16)}
    feature_info = {row.name: (row.layout, row.channels, row.stride) for row in nchw.feature_info}
    assert feature_info == {"layers.0": ("NHWC", 48, 4), "layers.2": ("NHWC", 192, 16)}


@functools.cache
def listed(backbone: str) -> dict[str, fh.FeatureInfo]:
    return {row.name: row for row in fh.list_layers(backbone, weights=None)}


LISTED = [
    ("timm/vit_small_patch16_224", "blocks.3", ("NLC", 384, 16, 1)),
    ("timm/vit_small_patch16_224", "patch_embed", ("NLC", 384, 16, 0)),
    ("timm/vit_small_patch16_224", "patch_embed.proj", ("NCHW", 384, 16, None)),
    ("timm/vit_small_patch16_224", "norm", ("NLC", 384, 16, 1)),
    ("timm/vit_small_patch16_224", "head", ("NC", 1000, None, None)),
    ("timm/vit_small_patch14_reg4_dinov2", "blocks.3", ("NLC", 384, 14, 5)),
    ("timm/vit_small_patch14_reg4_dinov2", "patch_embed", ("NLC", 384, 14, 0)),
    ("timm/deit_tiny_distilled_patch16_224", "blocks.3", ("NLC", 192, 16, 2)),
    ("timm/eva02_tiny_patch14_224", "blocks.3", ("NLC", 192, 14, 1)),
    ("timm/swin_tiny_patch4_window7_224", "layers.0", ("NHWC", 96, 4, None)),
    ("timm/swin_tiny_patch4_window7_224", "layers.3", ("NHWC", 768, 32, None)),
    ("timm/swin_tiny_patch4_window7_224", "layers.0.blocks.0.attn", ("other", None, None, None)),
    ("timm/swin_tiny_patch4_window7_224", "layers.1.blocks.1.attn.qkv", ("other", None, None, None)),
    ("timm/maxvit_rmlp_pico_rw_256", "stem", ("NCHW", 32, 2, None)),
    ("timm/maxvit_rmlp_pico_rw_256", "stages.0", ("NCHW", 32, 4, None)),
    ("timm/maxvit_rmlp_pico_rw_256", "stages.3", ("NCHW", 256, 32, None)),
    ("timm/maxvit_rmlp_pico_rw_256", "stages.0.blocks.0.attn_block", ("NHWC", 32, 4, None)),
    ("timm/maxvit_rmlp_pico_rw_256", "stages.1.blocks.0.attn_block.attn", ("other", None, None, None)),
    ("vit_b_16", "conv_proj", ("NCHW", 768, 16, None)),
    ("vit_b_16", "encoder.layers.encoder_layer_3", ("NLC", 768, 16, 1)),
    ("swin_t", "features.1", ("NHWC", 96, 4, None)),
    ("swin_t", "features.5", ("NHWC", 384, 16, None)),
]


@pytest.mark.parametrize(("backbone", "layer", "expected"), LISTED, ids=[f"{b}:{n}" for b, n, _ in LISTED])
def test_list_layers_layouts(backbone: str, layer: str, expected: tuple[Any, ...]) -> None:
    row = listed(backbone)[layer]
    assert (row.layout, row.channels, row.stride, row.prefix_tokens) == expected


def test_feature_info_of_a_timm_module_says_its_prefix_tokens() -> None:
    model = create("deit_tiny_distilled_patch16_224", img_size=64, depth=2)
    ext = fh.FeatureExtractor(model, ["patch_embed", "blocks.1"], output_format="nchw")
    rows = {row.name: (row.layout, row.channels, row.stride, row.prefix_tokens) for row in ext.feature_info}
    assert rows == {"patch_embed": ("NLC", 192, 16, 0), "blocks.1": ("NLC", 192, 16, 2)}


# ------------------------------------------------------------------------------------------ torchvision


def native_outputs(model: nn.Module, paths: list[str]) -> dict[str, Tensor]:
    """Capture the native outputs of ``paths`` during the extractor's own forward (hooks run before its own)."""
    seen: dict[str, Tensor] = {}
    for path in paths:
        model.get_submodule(path).register_forward_hook(
            lambda _m, _a, output, path=path: seen.__setitem__(path, output), prepend=True
        )
    return seen


def test_torchvision_vit_b_16_by_name() -> None:
    layers = ["encoder.layers.encoder_layer_1", "encoder.layers.encoder_layer_3"]
    torch.manual_seed(SEED)
    ext = fh.FeatureExtractor("vit_b_16", layers, weights=None, output_format="nchw", return_prefix_tokens=True)
    assert ext.output_layouts == {
        "encoder.layers.encoder_layer_1": Layout("NCHW", 768, 16),
        "encoder.layers.encoder_layer_1.prefix": Layout("NLC", 768, None, 1),
        "encoder.layers.encoder_layer_3": Layout("NCHW", 768, 16),
        "encoder.layers.encoder_layer_3.prefix": Layout("NLC", 768, None, 1),
    }
    native = native_outputs(ext.backbone, layers)
    out = ext(images(224, 224, batch=1))
    assert list(out) == list(ext.output_layouts)
    for layer in layers:
        tokens = native[layer]
        assert tokens.shape == (1, 197, 768)
        assert_close(out[layer], tokens[:, 1:].reshape(1, 14, 14, 768).permute(0, 3, 1, 2), rtol=0, atol=0)
        assert_close(out[f"{layer}.prefix"], tokens[:, :1], rtol=0, atol=0)
        assert out[layer].untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr()


def test_torchvision_swin_t_by_name() -> None:
    layers = ["features.1", "features.3"]
    torch.manual_seed(SEED)
    ext = fh.FeatureExtractor("swin_t", layers, weights=None, output_format="nchw", return_prefix_tokens=True)
    assert ext.output_layouts == {"features.1": Layout("NCHW", 96, 4), "features.3": Layout("NCHW", 192, 8)}
    native = native_outputs(ext.backbone, layers)
    out = ext(images(224, 224, batch=1))
    assert list(out) == layers  # no prefix tokens in a Swin
    assert native["features.1"].shape == (1, 56, 56, 96)
    for layer in layers:
        assert_close(out[layer], native[layer].permute(0, 3, 1, 2), rtol=0, atol=0)
        assert out[layer].untyped_storage().data_ptr() == native[layer].untyped_storage().data_ptr()


# --------------------------------------------------------------------------------- views, grad, compile


def test_nchw_outputs_are_views_of_the_native_outputs() -> None:
    model = create("vit_tiny_patch16_224", img_size=64, depth=2)
    ext = fh.FeatureExtractor(model, ["blocks.0", "blocks.1"], output_format="nchw", return_prefix_tokens=True)
    native = native_outputs(ext.backbone, ["blocks.0", "blocks.1"])
    out = ext(images(64, 64))
    for layer in ("blocks.0", "blocks.1"):
        pointer = native[layer].untyped_storage().data_ptr()
        assert out[layer].untyped_storage().data_ptr() == pointer
        assert out[f"{layer}.prefix"].untyped_storage().data_ptr() == pointer
        assert_close(out[layer], native[layer][:, 1:].unflatten(1, (4, 4)).permute(0, 3, 1, 2), rtol=0, atol=0)


def test_swin_nchw_output_is_a_view() -> None:
    model = create("swin_tiny_patch4_window7_224", **SMALL_SWIN)
    ext = fh.FeatureExtractor(model, ["layers.1"], output_format="nchw")
    native = native_outputs(ext.backbone, ["layers.1"])
    out = ext(images(112, 112))["layers.1"]
    assert out.untyped_storage().data_ptr() == native["layers.1"].untyped_storage().data_ptr()
    assert out.shape == (2, 96, 14, 14) and not out.is_contiguous()


@pytest.mark.parametrize(
    ("name", "kwargs", "size", "layers", "indices"),
    [
        (
            "vit_tiny_patch16_224",
            {"img_size": 64, "depth": 2, "dynamic_img_size": True},
            (48, 64),
            ["blocks.0", "blocks.1"],
            [0, 1],
        ),
        ("swin_tiny_patch4_window7_224", SMALL_SWIN, (112, 112), ["layers.0", "layers.1"], [0, 1]),
    ],
    ids=["vit", "swin"],
)
def test_gradients_flow_through_nchw_views(
    name: str, kwargs: dict[str, Any], size: tuple[int, int], layers: list[str], indices: list[int]
) -> None:
    model = create(name, **kwargs)
    ext = fh.FeatureExtractor(
        model, layers, output_format="nchw", return_prefix_tokens=True, mode="grad", normalize=False
    )
    x = images(*size).requires_grad_(True)
    out = ext(x)
    weights = {
        k: torch.rand(v.shape, generator=torch.Generator().manual_seed(i)) for i, (k, v) in enumerate(out.items())
    }
    (grad,) = torch.autograd.grad(sum((out[k] * w).sum() for k, w in weights.items()), x)
    expected_out = expected_outputs(layers, timm_intermediates(model, x, indices))
    assert list(expected_out) == list(out)
    (expected,) = torch.autograd.grad(sum((expected_out[k] * w).sum() for k, w in weights.items()), x)
    assert grad.abs().sum() > 0
    assert_close(grad, expected)
    assert all(not p.requires_grad for p in ext.backbone.parameters())


@pytest.mark.slow
def test_compiled_fullgraph_matches_eager() -> None:
    """aot_eager traces the views through AOT autograd; inductor's C++ compile takes ~40 s here, too slow."""
    model = create("vit_tiny_patch16_224", img_size=32, depth=2, dynamic_img_size=True)
    ext = fh.FeatureExtractor(model, ["blocks.0", "blocks.1"], output_format="nchw", return_prefix_tokens=True)
    compiled = torch.compile(ext, fullgraph=True, backend="aot_eager")
    for size in ((32, 48), (48, 32)):
        x = images(*size)
        eager, out = ext(x), compiled(x)
        assert list(out) == list(eager)
        for key in eager:
            assert out[key].shape == eager[key].shape
            assert_close(out[key], eager[key])
        assert out["blocks.1"].shape == (2, 192, size[0] // 16, size[1] // 16)


# ------------------------------------------------------------------------------------------------ errors


class TinyTokens(nn.Module):
    """A user's ViT-like module: a 4x4 patch embedding, a class token and a linear mixer; it does not say
    how many prefix tokens lead its tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.block = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.block(torch.cat([self.cls.expand(len(x), -1, -1), tokens], dim=1))


class SaysPrefix(TinyTokens):
    num_prefix_tokens = 1


def test_user_token_module_without_prefix_count_needs_prefix_tokens() -> None:
    with pytest.raises(InvalidValueError, match="prefix_tokens="):
        fh.FeatureExtractor(TinyTokens(), ["block"], output_format="nchw")
    native = fh.FeatureExtractor(TinyTokens(), ["block"])  # native tokens need no prefix count
    assert native.output_layouts["block"] == Layout("NLC", 8, None, None)  # 1 + 8x8 tokens tile nothing


@pytest.mark.parametrize("module", [TinyTokens(), SaysPrefix()], ids=["prefix_tokens=1", "num_prefix_tokens"])
def test_user_token_module_with_prefix_count(module: nn.Module) -> None:
    given = {} if isinstance(module, SaysPrefix) else {"prefix_tokens": 1}
    ext = fh.FeatureExtractor(module, ["block"], output_format="nchw", return_prefix_tokens=True, **given)
    assert ext.output_layouts == {"block": Layout("NCHW", 8, 4), "block.prefix": Layout("NLC", 8, None, 1)}
    x = images(32, 48)
    out = ext(x)
    with torch.no_grad():
        tokens = module(x)
    assert out["block"].shape == (2, 8, 8, 12)
    assert_close(out["block"], tokens[:, 1:].reshape(2, 8, 12, 8).permute(0, 3, 1, 2))
    assert_close(out["block.prefix"], tokens[:, :1])


def test_wrong_prefix_count_is_refused_up_front() -> None:
    with pytest.raises(InvalidValueError, match="do not tile"):
        fh.FeatureExtractor(TinyTokens(), ["block"], output_format="nchw", prefix_tokens=0)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"output_format": "native", "return_prefix_tokens": True}, InvalidValueError, "return_prefix_tokens"),
        ({"output_format": "NCHW"}, InvalidValueError, "output_format"),
        ({"output_format": "nchw", "prefix_tokens": -1}, InvalidValueError, "prefix_tokens"),
        ({"output_format": "nchw", "prefix_tokens": True}, InvalidTypeError, "prefix_tokens"),
        ({"output_format": "nchw", "prefix_tokens": 1.0}, InvalidTypeError, "prefix_tokens"),
    ],
)
def test_bad_format_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        fh.FeatureExtractor(TinyTokens(), ["block"], **kwargs)


def test_prefix_name_clash_is_refused() -> None:
    model = create("vit_tiny_patch16_224", img_size=32, depth=2)
    layers = {"blocks.0": "a", "blocks.1": "a.prefix"}
    with pytest.raises(InvalidValueError, match=r"a\.prefix"):
        fh.FeatureExtractor(model, layers, output_format="nchw", return_prefix_tokens=True)
    out = fh.FeatureExtractor(model, layers, output_format="nchw")(images(32, 32))  # no clash without prefixes
    assert list(out) == ["a", "a.prefix"] and out["a.prefix"].shape == (2, 192, 2, 2)


# ------------------------------------------------------------------------------------- hard cases


def test_strict_size_not_a_multiple_of_the_patch() -> None:
    model = create("vit_tiny_patch16_224", img_size=(64, 69), depth=1)
    x = images(64, 69)
    ext = fh.FeatureExtractor(model, ["blocks.0"], output_format="nchw")
    out = ext(x)
    with torch.no_grad():
        ((expected, _),) = timm_intermediates(model, ext.normalize(x), [0])  # the instance's pretrained_cfg mean/std
    assert_close(out["blocks.0"], expected)


class MetaShy(nn.Module):
    """Wraps a timm ViT and refuses the meta device, so the extractor learns its layouts from the first forward."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.vit = vit

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "meta":
            raise RuntimeError("no meta tensors here")
        return self.vit(x)


def test_untraced_dynamic_pad_model_first_called_at_a_padded_size() -> None:
    vit = create("vit_tiny_patch16_224", img_size=64, depth=1, dynamic_img_size=True, dynamic_img_pad=True)
    ext = fh.FeatureExtractor(MetaShy(vit), ["vit.blocks.0"], output_format="nchw", prefix_tokens=1)
    for size in ((150, 220), (300, 300)):
        x = images(*size, batch=1)
        out = ext(x)["vit.blocks.0"]
        with torch.no_grad():
            ((expected, _),) = timm_intermediates(vit, x, [0])
        assert_close(out, expected)
    assert ext.output_layouts["vit.blocks.0"].stride == 16


def test_unbatched_tensor_with_a_leading_one_is_not_tokens() -> None:
    name = "stages.0.blocks.0.attn_block.attn.rel_pos.bias_act"
    assert listed("timm/maxvit_rmlp_pico_rw_256")[name].layout == "other"
