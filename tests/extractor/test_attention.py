"""capture_attention and attention_rollout.

Oracles: each timm module's own unfused path (``fused_attn = False``, the softmax taken where it enters
``attn_drop``), ``nn.MultiheadAttention`` with ``need_weights=True, average_attn_weights=False``, torchvision Swin's own
softmax, and a float64 numpy rewrite of the rollout. Models are tiny, seeded and randomly initialized.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.testing import assert_close

import featurehooks as fh
from featurehooks.attention import attention_rollout, capture_attention
from featurehooks.errors import InvalidTypeError, InvalidValueError, LayerNotFoundError, LayerNotRunError

from helpers import maps_and_own_softmaxes

timm = pytest.importorskip("timm")
from timm.models.cait import TalkingHeadAttn  # noqa: E402

SEED = 0
VIT = {"patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}
# family -> (timm name, kwargs, image size, batch, layers (None: every attention module))
TIMM: dict[str, tuple[str, dict[str, Any], int, int, str | None]] = {
    "vit": ("vit_tiny_patch16_224", {"img_size": 32, **VIT}, 32, 2, None),
    "deit-distilled": ("deit_tiny_distilled_patch16_224", {"img_size": 40, **VIT}, 40, 1, None),
    "deit3": ("deit3_small_patch16_224", {"img_size": 32, **VIT}, 32, 3, None),
    "dinov2-registers": ("vit_small_patch14_reg4_dinov2", {"img_size": 28, **VIT, "patch_size": 14}, 28, 2, None),
    "vit-qk-norm": ("vit_tiny_patch16_224", {"img_size": 32, **VIT, "qk_norm": True}, 32, 2, None),
    "flexivit": ("flexivit_small", {"img_size": 48, **VIT}, 48, 1, None),
    "eva02-rope": ("eva02_tiny_patch14_224", {"img_size": 42, **VIT, "patch_size": 14}, 42, 2, None),
    "beit-relative-bias": ("beit_base_patch16_224", {"img_size": 32, **VIT}, 32, 2, None),
    "cait-talking-heads": ("cait_xxs24_224", {"img_size": 32, **VIT}, 32, 2, None),
    "pit": ("pit_ti_224", {"img_size": 64}, 64, 1, None),
    "twins": (
        "twins_svt_small",
        {"embed_dims": (16, 32, 64, 128), "num_heads": (1, 2, 4, 8), "depths": (1,) * 4},
        64,
        2,
        None,
    ),
    "pvt-v2-spatial-reduction": ("pvt_v2_b0", {"depths": (1, 1, 1, 1)}, 64, 2, None),
    "swin-shifted": (
        "swin_tiny_patch4_window7_224",
        {"img_size": 56, "depths": (2, 2), "embed_dim": 16, "num_heads": (1, 2)},
        56,
        2,
        None,
    ),
    "swinv2-cosine": (
        "swinv2_tiny_window8_256",
        {"img_size": 64, "depths": (2, 2), "embed_dim": 16, "num_heads": (1, 2), "window_size": 8},
        64,
        1,
        None,
    ),
    "vit-relpos": ("vit_relpos_small_patch16_224", {"img_size": 32, **VIT}, 32, 2, None),
    "xcit-class-attention": ("xcit_nano_12_p16_224", {"img_size": 32, "depth": 2}, 32, 2, "cls_attn_blocks.*.attn"),
}


def create(name: str, **kwargs: Any) -> nn.Module:
    torch.manual_seed(SEED)
    return timm.create_model(name, pretrained=False, **kwargs).eval()


def build(family: str) -> nn.Module:
    """The tiny seeded model of one family of ``TIMM``."""
    name, kwargs, *_ = TIMM[family]
    return create(name, **kwargs)


def images(batch: int, size: int) -> Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(SEED))


def unfused_maps(model: nn.Module, x: Tensor, paths: list[str]) -> dict[str, Tensor]:
    """The softmax of each module's own unfused path, where it enters ``attn_drop`` (CaiT's talking heads: where it
    enters ``proj_w``, which mixes the heads again), on a copy of the model switched to that path."""
    reference = copy.deepcopy(model)
    found: dict[str, Tensor] = {}

    def keep(path: str, reorder: Callable[[Tensor], Tensor]) -> Callable[..., None]:
        return lambda _module, args: found.__setitem__(path, reorder(args[0]))

    for path in paths:
        module = reference.get_submodule(path)
        if hasattr(module, "fused_attn"):
            module.fused_attn = False
        if isinstance(module, TalkingHeadAttn):
            module.proj_w.register_forward_pre_hook(keep(path, lambda t: t.permute(0, 3, 1, 2)))
        else:
            module.attn_drop.register_forward_pre_hook(keep(path, lambda t: t))
    with torch.no_grad():
        reference(x)
    return {path: value.reshape(-1, *value.shape[-3:]) for path, value in found.items()}


@pytest.mark.parametrize("family", sorted(TIMM))
def test_timm_maps_equal_the_unfused_path_and_outputs_stay_bitwise(family: str) -> None:
    name, kwargs, size, batch, layers = TIMM[family]
    model = create(name, **kwargs)
    fused = [m for m in model.modules() if getattr(m, "fused_attn", False)]
    x = images(batch, size)
    with torch.no_grad():
        expected = model(x)
        with capture_attention(model, layers) as maps:
            out = model(x)
    assert torch.equal(out, expected)
    assert all(m.fused_attn for m in fused)  # still fused: nothing switched
    reference = unfused_maps(model, x, list(maps))
    assert len(maps) >= 2 and list(maps) == list(reference)
    for path, value in maps.items():
        assert value.dtype == torch.float32 and not value.requires_grad
        assert_close(value, reference[path], atol=1e-6, rtol=0)
        assert_close(value.sum(-1), torch.ones(value.shape[:-1]), atol=1e-5, rtol=0)


def test_timm_shapes_of_prefix_windows_and_spatial_reduction() -> None:
    shapes = {}
    for family in ("dinov2-registers", "pvt-v2-spatial-reduction", "swin-shifted"):
        name, kwargs, size, batch, layers = TIMM[family]
        model = create(name, **kwargs)
        with torch.no_grad(), capture_attention(model, layers) as maps:
            model(images(batch, size))
        shapes[family] = tuple(next(iter(maps.values())).shape)
    assert shapes["dinov2-registers"] == (2, 2, 1 + 4 + 4, 1 + 4 + 4)  # class, 4 registers, 2x2 patches
    assert shapes["pvt-v2-spatial-reduction"] == (2, 1, 16 * 16, 2 * 2)  # keys spatially reduced by 8
    assert shapes["swin-shifted"] == (2 * 4, 1, 49, 49)  # (batch * windows, heads, window tokens, window tokens)


def test_timm_in_training_with_grads_keeps_outputs_and_gradients() -> None:
    name, kwargs, size, batch, _ = TIMM["beit-relative-bias"]
    model = create(name, **kwargs).train()
    x = images(batch, size)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with capture_attention(model, ["blocks.1.attn"]) as maps:
        model(x).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
    assert list(maps) == ["blocks.1.attn"] and not maps["blocks.1.attn"].requires_grad


def _vit() -> nn.Module:
    torch.manual_seed(SEED)
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    return vit.eval()


def mha_reference(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """What each nn.MultiheadAttention returns for its own inputs with ``need_weights=True`` per head."""
    found: dict[str, Tensor] = {}
    handles = []
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):

            def again(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
                kwargs = kwargs | {"need_weights": True, "average_attn_weights": False}
                with torch.no_grad():
                    found[path] = nn.MultiheadAttention.forward(module, *args, **kwargs)[1]

            handles.append(module.register_forward_pre_hook(again, with_kwargs=True))
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return found


@pytest.mark.parametrize("batch", [1, 3])
def test_torchvision_vit_matches_need_weights_on_the_fast_path(batch: int) -> None:
    vit, x = _vit(), images(batch, 32)
    with torch.no_grad():  # eval + no grad: nn.MultiheadAttention takes its fused fast path
        expected = vit(x)
        with capture_attention(vit) as maps:
            out = vit(x)
    assert torch.equal(out, expected)
    reference = mha_reference(vit, x)
    assert list(maps) == list(reference) == [f"encoder.layers.encoder_layer_{k}.self_attention" for k in range(2)]
    for path, value in maps.items():
        assert value.shape == (batch, 2, 17, 17)
        assert_close(value, reference[path], atol=1e-6, rtol=0)


def test_an_extractor_gives_the_maps_of_its_backbone_up_to_its_early_exit() -> None:
    vit, x = _vit(), images(2, 32)
    with torch.no_grad():
        with capture_attention(vit) as whole:
            vit(x)
        extractor = fh.FeatureExtractor(vit, ["encoder.layers.encoder_layer_0"], mode="detach", normalize=False)
        with capture_attention(extractor) as maps:
            extractor(x)
    first = "encoder.layers.encoder_layer_0.self_attention"
    assert list(maps) == [first]  # the extractor stopped before the second block
    # the same q and k, bitwise; the map recomputed from them on the extractor's own copy of the weights may round
    # differently (seen: 6e-8 on an AVX-512 EPYC, where the same values in another tensor gave another BLAS rounding)
    assert_close(maps[first], whole[first], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["swin_t", "swin_v2_t"])
def test_torchvision_swin_matches_its_own_softmax(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(SEED)
    block = "SwinTransformerBlockV2" if arch == "swin_v2_t" else "SwinTransformerBlock"
    swin = torchvision.models.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[1, 2],
        window_size=[4, 4],
        block=getattr(torchvision.models.swin_transformer, block),
        downsample_layer=getattr(
            torchvision.models.swin_transformer, "PatchMergingV2" if arch == "swin_v2_t" else "PatchMerging"
        ),
    ).eval()
    x = images(2, 24)  # 6x6 patches: padded to 8x8 windows of 4x4, shifted by 2
    maps, softmaxes = maps_and_own_softmaxes(swin, x, monkeypatch)
    assert len(maps) == len(softmaxes) == 4
    assert tuple(maps["features.1.0.attn"].shape) == (2 * 4, 1, 16, 16)
    for value, softmax in zip(maps.values(), softmaxes):
        assert torch.equal(value, softmax)


class Attend(nn.Module):
    """One nn.MultiheadAttention called as a model calls it, with the caller's masks."""

    def __init__(self, mha: nn.MultiheadAttention, **call: Any) -> None:
        super().__init__()
        self.mha, self.call = mha, call

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return self.mha(query, key, value, need_weights=False, **self.call)[0]


def _mha_case(case: str) -> tuple[Attend, tuple[Tensor, Tensor, Tensor]]:
    torch.manual_seed(SEED)
    rand = torch.Generator().manual_seed(SEED)
    first = case.startswith("batch_first")
    mha = nn.MultiheadAttention(
        8,
        2,
        batch_first=first,
        kdim=6 if "kdim" in case else None,
        vdim=5 if "kdim" in case else None,
        add_bias_kv="bias_kv" in case,
        add_zero_attn="zero_attn" in case,
        bias="nobias" not in case,
    ).eval()
    batch, queries, keys = 3, 4, 6
    shape = (lambda n, c: (batch, n, c)) if first else (lambda n, c: (n, batch, c))
    if "unbatched" in case:
        shape = lambda n, c: (n, c)  # noqa: E731
    query = torch.rand(*shape(queries, 8), generator=rand)
    key = torch.rand(*shape(keys, 6 if "kdim" in case else 8), generator=rand)
    value = torch.rand(*shape(keys, 5 if "kdim" in case else 8), generator=rand)
    call: dict[str, Any] = {}
    if "bool_mask" in case:
        call["attn_mask"] = torch.rand(queries, keys, generator=rand) > 0.7
    if "float_mask" in case:
        call["attn_mask"] = torch.randn(batch * 2, queries, keys, generator=rand)
    if "padding" in case:
        call["key_padding_mask"] = torch.tensor([[False] * 5 + [True], [False] * 6, [False] * 3 + [True] * 3])
    return Attend(mha, **call), (query, key, value)


MHA_CASES = [
    "batch_first",
    "seq_first",
    "seq_first-kdim",
    "batch_first-bool_mask-padding",
    "seq_first-float_mask",
    "batch_first-bias_kv-zero_attn-padding",
    "seq_first-nobias",
    "unbatched-bool_mask",
]


@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_in_any_configuration(case: str) -> None:
    model, inputs = _mha_case(case)
    with torch.no_grad():
        expected = model(*inputs)
        with capture_attention(model) as maps:
            out = model(*inputs)
        reference = model.mha(*inputs, need_weights=True, average_attn_weights=False, **model.call)[1]
    assert torch.equal(out, expected)
    assert_close(maps["mha"], reference.reshape(maps["mha"].shape), atol=1e-6, rtol=0)
    assert maps["mha"].dim() == 4


def enter(model: nn.Module, layers: str | None = None) -> None:
    with capture_attention(model, layers):
        pass


def test_unsupported_kind_is_refused_naming_its_class() -> None:
    xcit = build("xcit-class-attention")
    refused = r"^capture_attention: 'blocks.0.attn' is a timm.models.xcit.XCA.*channel"
    with pytest.raises(InvalidTypeError, match=refused):
        enter(xcit)
    with pytest.raises(InvalidTypeError, match=r"'blocks.0.mlp' is a timm.layers.mlp.Mlp"):
        enter(xcit, "blocks.0.mlp")
    with pytest.raises(InvalidValueError, match="ResNet has no attention module"):
        enter(torchvision.models.resnet18())
    with pytest.raises(LayerNotFoundError, match="did you mean 'blocks.0.attn'"):
        enter(build("vit"), "blocks.0.atn")


class TwoSoftmaxAttention(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.softmax(-1) + x.softmax(-1)


def test_a_module_with_two_candidate_maps_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("featurehooks._attention_kinds._FUNCTIONAL", frozenset({f"{__name__}.TwoSoftmaxAttention"}))
    model = nn.Sequential(TwoSoftmaxAttention())
    made = r"'0' \(.*TwoSoftmaxAttention\) made 0 attention call\(s\) and 2"
    with pytest.raises(InvalidTypeError, match=made), capture_attention(model):
        model(torch.rand(2, 3, 3))


def test_maps_refill_each_forward_name_repeated_calls_and_hooks_go_away() -> None:
    attn = build("vit").blocks[0].attn
    twice = nn.Sequential(attn, attn)  # one module, called twice per forward
    with torch.no_grad(), capture_attention(twice) as maps:
        first = twice(torch.rand(2, 5, 32))
        assert list(maps) == ["0", "0_1"] and tuple(maps["0"].shape) == (2, 2, 5, 5)
        twice(torch.rand(1, 7, 32))
        assert tuple(maps["0_1"].shape) == (1, 2, 7, 7)
    assert not attn._forward_hooks and not attn._forward_pre_hooks
    assert torch.equal(
        twice(torch.rand(2, 5, 32, generator=torch.Generator())),
        twice(torch.rand(2, 5, 32, generator=torch.Generator())),
    ) and first.shape == (2, 5, 32)


@pytest.mark.parametrize("family", ["vit", "torchvision-vit"])
def test_maps_under_autocast_are_float32_softmax_of_the_modules_inputs(family: str) -> None:
    model, x = (_vit(), images(2, 32)) if family == "torchvision-vit" else (build("vit"), images(2, 32))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), capture_attention(model) as maps:
        model(x)
    for value in maps.values():
        assert value.dtype == torch.float32
        torch.testing.assert_close(value.sum(-1), torch.ones(value.shape[:-1]), atol=1e-6, rtol=0)


class Counting(TorchFunctionMode):
    """A user's mode: counts the torch calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stop", [RuntimeError, KeyboardInterrupt])
def test_a_forward_stopped_inside_attention_leaves_no_mode_and_the_users_own(stop: type[BaseException]) -> None:
    model, x = build("vit"), images(1, 32)
    attn = model.blocks[0].attn

    def stopped(*_: object) -> None:
        raise stop

    with torch.no_grad(), capture_attention(model) as maps:
        handle = attn.proj.register_forward_pre_hook(stopped)
        with pytest.raises(stop):
            model(x)
        handle.remove()
        user = Counting()
        with user:  # entered above a recorder a KeyboardInterrupt left behind
            model(x)
            assert _get_current_function_mode_stack() == [user]
            calls = user.calls
            torch.ones(1).add(1)
            assert user.calls == calls + 2  # still the user's: torch.ones and Tensor.add
        assert list(maps) == [f"blocks.{k}.attn" for k in range(len(model.blocks))]
    assert _get_current_function_mode_stack() == []


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        self.spare = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor, spare: bool = False) -> Tensor:
        return self.spare(x, x, x)[0] if spare else self.encoder(x)


def test_encoder_layers_are_captured_and_a_module_that_did_not_run_says_so() -> None:
    torch.manual_seed(SEED)
    model, x = Branchy().eval(), torch.rand(2, 5, 8)
    with torch.no_grad():
        expected = model(x)
        with capture_attention(model) as maps:
            out = model(x)  # hooks turn off the encoder layer's one-kernel path (torch's rule): it calls self_attn
    assert torch.equal(out, expected)
    assert list(maps) == ["encoder.self_attn"]
    assert_close(maps["encoder.self_attn"], mha_reference(model, x)["encoder.self_attn"], atol=1e-6, rtol=0)
    with pytest.raises(LayerNotRunError, match="'spare' did not run in the last forward"):
        maps["spare"]
    with pytest.raises(LayerNotFoundError, match="did you mean 'spare'"):
        maps["spar"]


def rollout_numpy(maps: list[np.ndarray], fusion: str) -> np.ndarray:
    """Abnar & Zuidema's rollout in float64: fuse heads, add I, renormalize rows, multiply from the first layer."""
    batch, _, tokens, _ = maps[0].shape
    result = np.stack([np.eye(tokens)] * batch)
    for layer in maps:
        fused = {"mean": layer.mean(1), "max": layer.max(1), "min": layer.min(1)}[fusion] + np.eye(tokens)
        result = np.einsum("bij,bjk->bik", fused / fused.sum(-1, keepdims=True), result)
    return result


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_matches_a_float64_rewrite(fusion: str) -> None:
    name, kwargs, size, batch, _ = TIMM["dinov2-registers"]
    model = create(name, **{**kwargs, "depth": 3})
    with torch.no_grad(), capture_attention(model) as maps:
        model(images(batch, size))
    expected = rollout_numpy([m.double().numpy() for m in maps.values()], fusion)
    assert_close(attention_rollout(maps, head_fusion=fusion).double(), torch.from_numpy(expected), atol=1e-6, rtol=0)
    saliency = attention_rollout(list(maps.values()), head_fusion=fusion, prefix_tokens=5)
    assert_close(saliency.double(), torch.from_numpy(expected[:, 0, 5:]), atol=1e-6, rtol=0)
    assert saliency.shape == (batch, 4)  # a 2x2 patch grid


def test_rollout_refuses_maps_it_cannot_multiply() -> None:
    with pytest.raises(InvalidValueError, match=r"maps\[1\] has shape \(2, 1, 4, 2\)"):
        attention_rollout([torch.rand(2, 1, 4, 4), torch.rand(2, 1, 4, 2)])
    with pytest.raises(InvalidValueError, match="head_fusion"):
        attention_rollout([torch.rand(2, 1, 4, 4)], head_fusion="median")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="prefix_tokens"):
        attention_rollout([torch.rand(2, 1, 4, 4)], prefix_tokens=4)


def test_list_layers_marks_attention_modules() -> None:
    rows = fh.list_layers(_vit(), input_size=32)
    marked = [row.path for row in rows if row.attention]
    assert marked == [f"encoder.layers.encoder_layer_{k}.self_attention" for k in range(2)]
    name, kwargs, size, _, _ = TIMM["swin-shifted"]
    swin = {row.path: row.attention for row in fh.list_layers(create(name, **kwargs), input_size=size)}
    assert swin["layers.0.blocks.1.attn"] and not swin["layers.0.blocks.1"] and not swin["layers.0.blocks.1.attn.qkv"]


@pytest.fixture(autouse=True)
def _no_mode_left() -> Iterator[None]:
    yield
    assert _get_current_function_mode_stack() == []
