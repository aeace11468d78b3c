"""detect_nonfinite on transformers: -inf masks and fills that never reach the output are no errors; a NaN
made inside or after attention, or a non-finite gradient, is still named where it starts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from featurehooks.errors import NonFiniteError
from featurehooks.probes.nonfinite import INPUT, detect_nonfinite

from helpers import ChangesGradient, Scale

D, HEADS, L = 16, 2, 5

# --------------------------------------------------------------------------------------------------
# models and masks


def encoder(layers: int = 2, nested: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=nested)


def decoder() -> nn.TransformerDecoder:
    torch.manual_seed(0)
    return nn.TransformerDecoder(nn.TransformerDecoderLayer(D, HEADS, 32, dropout=0.0, batch_first=True), 2)


def tokens(batch: int = 2, length: int = L) -> Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, length, D)


def causal(length: int = L) -> Tensor:
    return nn.Transformer.generate_square_subsequent_mask(length)  # float: 0 and -inf


def padded(length: int = L, as_float: bool = False) -> Tensor:
    """Key padding: the second sequence of the batch ends two tokens early (True / -inf: padding)."""
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[1, -2:] = True
    return torch.zeros(mask.shape).masked_fill(mask, -math.inf) if as_float else mask


class Attend(nn.Module):
    """Self-attention over a mask made by a submodule, and scores a submodule masks with -inf for this
    module's own softmax: both hold -inf and are used on purpose."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = CausalMask()
        self.scores = MaskedScores()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.proj = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        h = self.attn(x, x, x, attn_mask=self.mask(x), need_weights=False)[0]
        weights = self.scores(h).softmax(-1)  # rows of weights: -inf scores give 0
        return self.proj(weights @ h)


class CausalMask(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.full((x.shape[1], x.shape[1]), -math.inf).triu(1)


class MaskedScores(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        scores = h @ h.transpose(1, 2)
        return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -math.inf)


class Wrapped(nn.Module):
    """Multi-head attention inside a model, so that the attention is a module call of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.head = nn.Linear(D, 3)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        return self.head(self.attn(x, x, x, key_padding_mask=key_padding_mask)[0])


def vit(fused: bool = True) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=4)
    for block in model.blocks:
        block.attn.fused_attn = fused  # False: timm builds the -inf bias itself (resolve_self_attn_mask)
    return model


def images() -> Tensor:
    torch.manual_seed(2)
    return torch.rand(2, 3, 32, 32)


def vit_padding_mask() -> Tensor:
    """Additive mask over the 5 tokens (class token and 4 patches): the last patch of the second image is padding."""
    mask = torch.zeros(2, 1, 1, 5)
    mask[1, ..., -1] = -math.inf
    return mask


def quiet(model: nn.Module, run: Callable[[], Any], backward: bool = True) -> Tensor:
    """Run a finite forward (and backward) under the sentinel, which must stay silent."""
    with detect_nonfinite(model):
        out = run()
        out = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(out).all()
        if backward:
            out.sum().backward()
    return out


def origin(model: nn.Module, run: Callable[[], Any]) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
        out = run()
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return info.value


# --------------------------------------------------------------------------------------------------
# finite forwards and backwards with masks: no error


@pytest.mark.parametrize(
    "masks",
    [
        {"mask": causal(), "is_causal": True},
        {"mask": causal()},
        {"mask": torch.ones(L, L, dtype=torch.bool).triu(1)},
        {"src_key_padding_mask": padded()},
        {"src_key_padding_mask": padded(as_float=True)},
        {"mask": causal(), "src_key_padding_mask": padded()},
    ],
    ids=["float causal", "float", "bool", "key padding bool", "key padding float", "causal and key padding"],
)
def test_encoder_with_masks_is_quiet(masks: dict[str, Tensor]) -> None:
    model = encoder()
    quiet(model, lambda: model(tokens(), **masks))


def test_encoder_mask_as_a_later_positional_argument_is_quiet() -> None:
    model = encoder()
    quiet(model, lambda: model(tokens(), causal(), padded(as_float=True)))


@pytest.mark.parametrize("masks", [{}, {"mask": causal()}], ids=["padding", "padding and causal"])
def test_encoder_fast_path_on_a_padded_batch_is_quiet(masks: dict[str, Tensor]) -> None:
    model = encoder(nested=True).eval()
    with torch.no_grad():
        out = quiet(model, lambda: model(tokens(), src_key_padding_mask=padded(), **masks), backward=False)
    if not masks:  # the nested-tensor fast path ran: its padded positions come back as zeros
        assert (out[1, -2:] == 0).all() and (out[0] != 0).all()


def test_decoder_with_causal_and_padding_masks_is_quiet() -> None:
    model = decoder()
    memory = tokens(length=7)
    memory_padding = torch.zeros(2, 7, dtype=torch.bool)
    memory_padding[0, -3:] = True

    def run() -> Tensor:
        return model(
            tokens(),
            memory,
            tgt_mask=causal(),
            tgt_is_causal=True,
            tgt_key_padding_mask=padded(as_float=True),
            memory_key_padding_mask=memory_padding,
        )

    quiet(model, run)
    model.eval()
    with torch.no_grad():
        quiet(model, run, backward=False)


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize(
    "masks",
    [
        {"attn_mask": causal()},
        {"attn_mask": causal().expand(2 * HEADS, L, L)},
        {"attn_mask": torch.ones(L, L, dtype=torch.bool).triu(1)},
        {"key_padding_mask": padded()},
        {"key_padding_mask": padded(as_float=True)},
        {"attn_mask": causal(), "key_padding_mask": padded(as_float=True)},
    ],
    ids=["float", "float 3-d", "bool", "key padding bool", "key padding float", "both"],
)
def test_multihead_attention_with_masks_is_quiet(masks: dict[str, Tensor], need_weights: bool) -> None:
    torch.manual_seed(0)
    model = nn.MultiheadAttention(D, HEADS, batch_first=True)
    x = tokens()
    quiet(model, lambda: model(x, x, x, need_weights=need_weights, **masks))


def test_transformer_with_positional_masks_is_quiet() -> None:
    torch.manual_seed(0)
    model = nn.Transformer(D, HEADS, 1, 1, 32, dropout=0.0, batch_first=True)
    src, tgt = tokens(length=6), tokens()
    src_mask = torch.zeros(6, 6)
    # src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask, memory_key_padding_mask
    quiet(model, lambda: model(src, tgt, src_mask, causal(), None, None, padded(as_float=True)))


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "timm attention"])
@pytest.mark.parametrize(
    "masks", [{}, {"is_causal": True}, {"attn_mask": vit_padding_mask()}], ids=["none", "causal", "padding"]
)
def test_timm_vit_is_quiet(fused: bool, masks: dict[str, Any]) -> None:
    model = vit(fused)
    quiet(model, lambda: model(images(), **masks))


def test_timm_gemma4_vit_with_padding_patches_is_quiet() -> None:
    pytest.importorskip("timm")
    from timm.models.gemma4_vit import Gemma4VitEncoder

    torch.manual_seed(0)
    model = Gemma4VitEncoder(
        img_size=96, embed_dim=32, depth=2, num_heads=2, head_dim=16, intermediate_size=64, global_pool="avg"
    )
    patches, coord = torch.rand(2, 6, 16 * 16 * 3), torch.cartesian_prod(torch.arange(2), torch.arange(3))
    coord = coord.expand(2, 6, 2).clone()
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, -2:], coord[1, -2:] = False, -1  # padding patches: the model builds a -inf attention mask
    quiet(model, lambda: model(patches, coord, valid))


def test_submodules_that_return_minus_inf_on_purpose_are_quiet() -> None:
    torch.manual_seed(0)
    model = Attend()
    quiet(model, lambda: model(tokens()))


def test_a_minus_inf_bias_passed_as_a_later_argument_is_quiet() -> None:
    model = Wrapped()
    quiet(model, lambda: model(tokens(), padded(as_float=True)))


# --------------------------------------------------------------------------------------------------
# real NaNs and infinite gradients: still named where they start


def test_nan_weight_after_attention_is_named_despite_masks() -> None:
    model = encoder()
    with torch.no_grad():
        model.layers[1].linear1.weight[0, 0] = math.nan
    error = origin(model, lambda: model(tokens(), mask=causal(), src_key_padding_mask=padded()))
    assert (error.path, error.call, error.phase, error.tensor) == ("layers.1.linear1", 0, "forward", "output")


def test_nan_weight_inside_attention_is_the_attention_not_its_mask() -> None:
    model = encoder()
    with torch.no_grad():
        model.layers[0].self_attn.in_proj_weight[2 * D, 0] = math.nan  # a row of the value projection
    error = origin(model, lambda: model(tokens(), mask=causal(), is_causal=True))
    assert (error.path, error.phase, error.tensor) == ("layers.0.self_attn", "forward", "output")
    assert "-inf masks" in str(error)


def test_nan_module_after_attention_is_named() -> None:
    model = encoder()
    model.layers[0].dropout1 = Scale(math.nan)  # takes the attention's output
    error = origin(model, lambda: model(tokens(), src_key_padding_mask=padded(as_float=True)))
    assert (error.path, error.phase) == ("layers.0.dropout1", "forward")


def test_nan_in_the_nested_tensor_path_is_named() -> None:
    model = encoder(nested=True).eval()
    with torch.no_grad():
        model.layers[0].linear1.weight[0, 0] = math.nan
        with pytest.raises(NonFiniteError) as info, detect_nonfinite(model):
            model(tokens(), src_key_padding_mask=padded())
    # layers run on nested tensors; a layer that runs as one fused kernel is named itself
    assert (info.value.path, info.value.phase) in {("layers.0.linear1", "forward"), ("layers.0", "forward")}


def test_nan_in_a_decoder_is_named_despite_masks() -> None:
    model = decoder()
    with torch.no_grad():
        model.layers[1].multihead_attn.out_proj.weight[0, 0] = math.nan
    error = origin(model, lambda: model(tokens(), tokens(length=7), tgt_mask=causal(), tgt_is_causal=True))
    assert (error.path, error.phase) == ("layers.1.multihead_attn", "forward")


def test_nan_in_a_timm_vit_with_a_padding_mask_is_named() -> None:
    model = vit(fused=False)
    with torch.no_grad():
        model.blocks[1].mlp.fc1.weight[0, 0] = math.nan
    error = origin(model, lambda: model(images(), attn_mask=vit_padding_mask()))
    assert (error.path, error.phase) == ("blocks.1.mlp.fc1", "forward")


def test_nan_after_modules_that_return_minus_inf_is_named_not_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Attend(), nn.Linear(D, D), Scale(math.nan), nn.Linear(D, 3))
    error = origin(model, lambda: model(tokens()))
    assert (error.path, error.phase) == ("2", "forward")


@pytest.mark.parametrize("rows", [[1], [0, 1]], ids=["one sequence", "every sequence"])
def test_a_row_masked_entirely_is_named_at_the_attention(rows: list[int]) -> None:
    model = Wrapped()
    mask = torch.zeros(2, L)
    mask[rows] = -math.inf  # every key of a sequence masked: softmax over nothing gives NaN
    error = origin(model, lambda: model(tokens(), mask))
    assert (error.path, error.phase) == ("attn", "forward")
    assert "-inf masks (input[3]" in str(error)  # query, key and value are input[0] to input[2]


def test_an_infinity_absorbed_before_the_output_is_left_to_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), Scale(math.inf), nn.Tanh(), nn.Linear(D, 3))
    with detect_nonfinite(model):
        out = model(tokens())  # tanh(±inf) = ±1: the output is finite, so the forward is not reported
    assert torch.isfinite(out).all()
    error = origin(model, lambda: model(tokens()))  # but 0 * inf is NaN in the gradient through Scale
    assert (error.path, error.phase, error.tensor) == ("1", "backward", "grad_input")


def test_nan_in_the_input_or_in_a_mask_is_the_input() -> None:
    model = encoder()
    x = tokens()
    x[0, 1, 2] = math.nan
    assert origin(model, lambda: model(x, mask=causal())).path == INPUT
    mask = causal()
    mask[3, 0] = math.nan  # a NaN is never a mask
    error = origin(model, lambda: model(tokens(), mask=mask))
    assert (error.path, error.tensor) == (INPUT, "input[1]")


def test_nan_gradient_after_attention_is_named_in_backward() -> None:
    model = encoder()
    model.layers[1].dropout1 = ChangesGradient(lambda grad: grad * math.nan)
    error = origin(model, lambda: model(tokens(), mask=causal(), src_key_padding_mask=padded()))
    assert (error.path, error.phase, error.tensor) == ("layers.1.dropout1", "backward", "grad_input")


def test_nan_gradient_in_a_timm_vit_is_named_in_backward() -> None:
    model = vit(fused=False)
    model.blocks[0].ls1 = ChangesGradient(lambda grad: grad * math.nan)  # takes the attention's output
    error = origin(model, lambda: model(images(), is_causal=True))
    assert (error.path, error.phase) == ("blocks.0.ls1", "backward")
