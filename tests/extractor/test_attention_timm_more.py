"""capture_attention on timm's hierarchical and hybrid families (LeViT, TNT, TinyViT, GCViT, DaViT, CrossViT,
EfficientFormer v1/v2, MaxViT, CoAtNet, Swin V2-CR, MViT v2, NesT, Hiera), and the refusals of the kinds it cannot
read.

Oracle: each class's own softmax on its unfused path (``fused_attn = False``), taken where the weights enter
``attn_drop`` (or EfficientFormer v2's ``talking_head2``, DaViT's ``nn.Softmax``), or, where the class applies them
straight to the values, recomputed from its own projections and attention biases (a few lines per class). Models
are tiny, seeded and randomly initialized.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.testing import assert_close

from featurehooks.attention import capture_attention
from featurehooks.errors import InvalidTypeError

timm = pytest.importorskip("timm")
from timm.layers.attention import Attention  # noqa: E402
from timm.models import (  # noqa: E402
    crossvit,
    davit,
    efficientformer,
    efficientformer_v2,
    gcvit,
    hiera,
    levit,
    maxxvit,
    mvitv2,
    nest,
    swin_transformer_v2_cr,
    tiny_vit,
    tnt,
)

SEED = 0
Keep = Callable[[Tensor], None]


def entering(child: str) -> Callable[[nn.Module, Keep], None]:
    """The weights as they enter ``child`` (``attn_drop``, a talking-heads mix)."""
    return lambda module, keep: module.get_submodule(child).register_forward_pre_hook(lambda _m, a: keep(a[0]))


def leaving(child: str) -> Callable[[nn.Module, Keep], None]:
    """The weights as ``child`` (an ``nn.Softmax``) returns them."""
    return lambda module, keep: module.get_submodule(child).register_forward_hook(lambda _m, _a, out: keep(out))


def recomputed(logits: Callable[..., Tensor]) -> Callable[[nn.Module, Keep], None]:
    """softmax of ``logits(module, input)``: the class's scores rebuilt from its own projections and biases."""
    return lambda module, keep: module.register_forward_pre_hook(lambda m, a: keep(logits(m, a[0]).softmax(-1)))


def levit_logits(m: Any, x: Tensor) -> Tensor:
    if m.use_conv:  # (batch, channels, height, width)
        q, k, _ = m.qkv(x).flatten(2).unflatten(1, (m.num_heads, -1)).split([m.key_dim, m.key_dim, m.val_dim], 2)
        return q.transpose(-2, -1) @ k * m.scale + m.get_attention_biases(x.device)
    q, k, _ = m.qkv(x).unflatten(-1, (m.num_heads, -1)).split([m.key_dim, m.key_dim, m.val_dim], 3)
    return q.transpose(1, 2) @ k.permute(0, 2, 3, 1) * m.scale + m.get_attention_biases(x.device)


def levit_downsample_logits(m: Any, x: Tensor) -> Tensor:
    if m.use_conv:
        k = m.kv(x).flatten(2).unflatten(1, (m.num_heads, -1))[:, :, : m.key_dim]
        q = m.q(x).flatten(2).unflatten(1, (m.num_heads, m.key_dim))
        return q.transpose(-2, -1) @ k * m.scale + m.get_attention_biases(x.device)
    k = m.kv(x).unflatten(-1, (m.num_heads, -1))[..., : m.key_dim]
    q = m.q(x).unflatten(-1, (m.num_heads, m.key_dim))
    return q.transpose(1, 2) @ k.permute(0, 2, 3, 1) * m.scale + m.get_attention_biases(x.device)


def efficientformer_logits(m: Any, x: Tensor) -> Tensor:
    q, k, _ = m.qkv(x).unflatten(-1, (m.num_heads, -1)).transpose(1, 2).split([m.key_dim, m.key_dim, m.val_dim], 3)
    return q @ k.transpose(-2, -1) * m.scale + m.get_attention_biases(x.device)


def efficientformer_v2_downsample_logits(m: Any, x: Tensor) -> Tensor:
    q = m.q(x).flatten(2).unflatten(1, (m.num_heads, -1)).transpose(-2, -1)
    k = m.k(x).flatten(2).unflatten(1, (m.num_heads, -1))
    return q @ k * m.scale + m.get_attention_biases(x.device)


def tiny_vit_logits(m: Any, x: Tensor) -> Tensor:
    q, k, _ = m.qkv(m.norm(x)).unflatten(-1, (m.num_heads, -1)).split([m.key_dim, m.key_dim, m.val_dim], 3)
    return (q.transpose(1, 2) * m.scale) @ k.permute(0, 2, 3, 1) + m.get_attention_biases(x.device)


def after_relative_position(module: nn.Module, keep: Keep) -> None:
    """MViT v2: softmax of the scores as ``cal_rel_pos_type`` returns them (its last step before the softmax)."""
    original = mvitv2.cal_rel_pos_type
    patch = mock.patch.object(mvitv2, "cal_rel_pos_type", lambda *a: _kept(original(*a), keep))

    def start(_module: nn.Module, _args: tuple[Any, ...]) -> None:
        patch.start()

    def stop(_module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        patch.stop()

    module.register_forward_pre_hook(start)
    module.register_forward_hook(stop)


def _kept(scores: Tensor, keep: Keep) -> Tensor:
    keep(scores.softmax(-1))
    return scores


TAPS: dict[type, Callable[[nn.Module, Keep], None]] = {
    levit.Attention: recomputed(levit_logits),
    levit.AttentionDownsample: recomputed(levit_downsample_logits),
    tnt.Attention: entering("attn_drop"),
    tiny_vit.Attention: recomputed(tiny_vit_logits),
    gcvit.WindowAttentionGlobal: entering("attn_drop"),
    davit.WindowAttention: leaving("softmax"),
    crossvit.CrossAttention: entering("attn_drop"),
    Attention: entering("attn_drop"),  # CrossViT's branches
    efficientformer.Attention: recomputed(efficientformer_logits),
    efficientformer_v2.Attention2d: entering("talking_head2"),
    efficientformer_v2.Attention2dDownsample: recomputed(efficientformer_v2_downsample_logits),
    maxxvit.AttentionCl: entering("attn_drop"),
    maxxvit.Attention2d: entering("attn_drop"),
    swin_transformer_v2_cr.WindowMultiHeadAttention: entering("attn_drop"),
    mvitv2.MultiScaleAttention: after_relative_position,
    nest.Attention: entering("attn_drop"),
    hiera.MaskUnitAttention: lambda module, keep: softmax_inside(module, keep),
}
HEADS_BEFORE_WINDOWS = (nest.Attention, hiera.MaskUnitAttention)  # (batch, heads, windows, q, k)


class _Softmaxes(TorchFunctionMode):
    def __init__(self, keep: Keep) -> None:
        super().__init__()
        self.keep = keep

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is Tensor.softmax:
            self.keep(out)
        return out


def softmax_inside(module: nn.Module, keep: Keep) -> None:
    """The softmax the module takes itself (Hiera applies it to the values with no module in between)."""
    mode = _Softmaxes(keep)

    def enter(*_: object) -> None:
        mode.__enter__()

    def leave(*_: object) -> None:
        mode.__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def create(name: str, **kwargs: Any) -> nn.Module:
    torch.manual_seed(SEED)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def seeded(build: Callable[..., nn.Module], **kwargs: Any) -> nn.Module:
    torch.manual_seed(SEED)
    return build(**kwargs).eval()


LEVIT = {"img_size": 64, "embed_dim": (32, 48, 64), "key_dim": 8, "num_heads": (2, 3, 4), "depth": (1, 1, 1)}
# family -> (builder, image size, layers (None: every attention module), (module, first map's shape) to check)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], int, str | None, tuple[str, tuple[int, ...]]]] = {
    "levit": (lambda: create("levit_128s", **LEVIT), 64, None, ("stages.1.downsample.attn_downsample", (2, 4, 4, 16))),
    "levit-conv": (lambda: create("levit_conv_128s", **LEVIT), 64, None, ("stages.0.blocks.0.attn", (2, 2, 16, 16))),
    "tnt": (
        lambda: create(
            "tnt_s_patch16_224",
            img_size=32,
            embed_dim=32,
            inner_dim=8,
            depth=2,
            num_heads_inner=2,
            num_heads_outer=2,
        ),
        32,
        None,
        ("blocks.0.attn_in", (2 * 4, 2, 16, 16)),  # 4 patches of 4x4 pixels each: inner attention per patch
    ),
    "tiny-vit": (
        lambda: create(
            "tiny_vit_5m_224",
            embed_dims=(16, 32, 48, 64),
            depths=(1, 1, 1, 1),
            num_heads=(1, 2, 3, 4),
            window_sizes=(2, 2, 2, 2),
        ),
        64,
        None,
        ("stages.1.blocks.0.attn", (2 * 16, 2, 4, 4)),  # 8x8 tokens in 2x2 windows
    ),
    "gcvit-global-queries": (
        lambda: seeded(
            gcvit.GlobalContextVit,
            img_size=64,
            embed_dim=16,
            depths=(1, 2, 1, 1),
            num_heads=(1, 2, 2, 4),
            window_size=(4, 4, 4, 2),
        ),
        64,
        None,
        ("stages.1.blocks.1.attn", (2 * 4, 2, 16, 16)),  # a global block: the image's query in each window
    ),
    "davit-windows": (
        lambda: create(
            "davit_tiny", embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 3, 4), window_size=2
        ),
        32,
        "stages.*.blocks.*.0.attn",  # the spatial blocks; the channel blocks are refused
        ("stages.0.blocks.0.0.attn", (2 * 16, 1, 4, 4)),
    ),
    "crossvit-cross-attention": (
        lambda: create(
            "crossvit_tiny_240",
            img_size=32,
            img_scale=(1.0, 1.0),
            patch_size=(8, 16),
            embed_dim=(16, 32),
            depth=((1, 1, 0),),
            num_heads=(2, 2),
            mlp_ratio=(2.0, 2.0, 2.0),
        ),
        32,
        None,
        ("blocks.0.fusion.0.attn", (2, 2, 1, 1 + 4)),  # one query: the class token over the other branch's tokens
    ),
    "efficientformer": (
        lambda: create("efficientformer_l1", embed_dims=(8, 8, 8, 16), depths=(1, 1, 1, 2), num_vit=2),
        224,
        None,
        ("stages.3.blocks.1.token_mixer", (2, 8, 49, 49)),
    ),
    "efficientformer-v2-talking-heads": (
        lambda: create("efficientformerv2_s0", img_size=64),
        64,
        None,
        ("stages.3.downsample.attn", (2, 8, 4, 16)),  # 4x4 keys, queries downsampled to 2x2
    ),
    "maxvit-windows-and-grids": (
        lambda: create("maxvit_nano_rw_256", img_size=64, embed_dim=(32, 64), depths=(1, 1), stem_width=(8, 16)),
        64,
        None,
        ("stages.0.blocks.0.attn_block.attn", (2 * 64, 1, 4, 4)),  # 16x16 tokens in 2x2 windows
    ),
    "coatnet-2d": (
        lambda: create("coatnet_nano_cc_224", img_size=64),
        64,
        None,
        ("stages.2.blocks.1.attn", (2, 8, 16, 16)),
    ),
    "swinv2-cr-cosine": (
        lambda: create("swinv2_cr_tiny_224", img_size=64, embed_dim=16, depths=(2, 2), num_heads=(1, 2), window_size=4),
        64,
        None,
        ("stages.0.blocks.1.attn", (2 * 16, 1, 16, 16)),  # shifted windows
    ),
    "nest-blocks": (
        lambda: seeded(
            nest.Nest, img_size=32, patch_size=4, embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 1)
        ),
        32,
        None,
        ("levels.0.transformer_encoder.0.attn", (2 * 16, 1, 4, 4)),  # 8x8 tokens in 16 blocks of 2x2
    ),
    "hiera-mask-units": (
        lambda: create("hiera_tiny_224", img_size=(64, 64), embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)),
        64,
        None,
        ("blocks.0.attn", (2 * 4, 1, 64, 64)),  # 16x16 tokens in 4 mask units
    ),
    "mvitv2-pooled": (
        lambda: seeded(mvitv2.MultiScaleVit, cfg=mvitv2.MultiScaleVitCfg(depths=(1, 2), embed_dim=16), img_size=32),
        32,
        None,
        ("stages.0.blocks.0.attn", (2, 1, 64, 4)),  # 8x8 tokens; keys pooled 4x in each axis
    ),
}


def own_softmax(model: nn.Module, x: Tensor, paths: list[str]) -> dict[str, Tensor]:
    """Each module's own weights (``TAPS``), on a copy of the model switched to its unfused path."""
    reference = copy.deepcopy(model)
    found: dict[str, Tensor] = {}
    for path in paths:
        module = reference.get_submodule(path)
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
        TAPS[type(module)](module, lambda weights, path=path: found.__setitem__(path, weights))
    with torch.no_grad():
        reference(x)
    heads_first = {path for path in found if isinstance(reference.get_submodule(path), HEADS_BEFORE_WINDOWS)}
    return {
        path: value.transpose(1, 2).flatten(0, 1)
        if path in heads_first and value.dim() == 5
        else value.reshape(-1, *value.shape[-3:])
        for path, value in found.items()
    }


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_maps_equal_the_modules_own_softmax_and_outputs_stay_bitwise(family: str) -> None:
    build, size, layers, (path, shape) = FAMILIES[family]
    model = build()
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        expected = model(x)
        with capture_attention(model, layers) as maps:
            out = model(x)
    assert torch.equal(out, expected)
    reference = own_softmax(model, x, list(maps))
    assert len(maps) >= 2 and list(maps) == list(reference)
    assert tuple(maps[path].shape) == shape
    for name, value in maps.items():
        assert value.dtype == torch.float32 and not value.requires_grad
        assert_close(value, reference[name], atol=1e-6, rtol=0)


# timm name, kwargs, the refused class and the reason its error gives
REFUSED = [
    ("edgenext_xx_small", "edgenext.CrossCovarianceAttn", "across channels"),
    ("coat_lite_tiny", "coat.FactorAttnConvRelPosEnc", "softmax of the keys over tokens"),
    ("volo_d1_224", "volo.OutlookAttention", "outlook attention"),
    ("nextvit_small", "nextvit.ConvAttention", "grouped convolution"),
    ("efficientvit_m0", "efficientvit_msra.CascadedGroupAttention", "one softmax per head in a cascade"),
]


@pytest.mark.parametrize(("name", "refused", "reason"), REFUSED)
def test_kinds_that_are_not_a_softmax_over_tokens_are_refused_with_their_reason(
    name: str, refused: str, reason: str
) -> None:
    """Refused before any forward: built on the meta device, without weights."""
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    with pytest.raises(InvalidTypeError, match=rf"is a timm\.models\.{refused}, whose map cannot be read: .*{reason}"):
        capture_attention(model).__enter__()
