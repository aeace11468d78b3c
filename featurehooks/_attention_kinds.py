"""Which modules compute attention, which of them ``capture_attention`` can read, and the two formulas it reads with.

Classes are named, not imported, so that neither timm nor torchvision's Swin is imported to ask. A ``"functional"``
module makes one ``F.scaled_dot_product_attention`` call (fused) or one softmax over the keys (unfused) per forward,
and its map comes from that call's own arguments (``sdpa_weights``) or output; ``nn.MultiheadAttention`` (``"mha"``)
may run one fused kernel that no Python hook sees inside, so its map is recomputed from its weights and the arguments
of its call (``mha_weights``), as ``F.multi_head_attention_forward`` computes it with ``need_weights=True``.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "FUNCTIONAL",
    "MHA",
    "attention_kind",
    "attention_modules",
    "class_name",
    "folded",
    "mha_weights",
    "refusal",
    "sdpa_weights",
]

FUNCTIONAL = "functional"
MHA = "mha"

# Each class was checked against its source (timm 1.0.31, torchvision 0.29, transformers 5.25) and is tested against
# its unfused path (tests/extractor/test_attention.py, test_attention_hf.py, test_attention_sweep.py).
_FUNCTIONAL = frozenset(
    {
        "timm.models.nest.Attention",  # blocks: (batch, heads, blocks, ...), heads before blocks
        "timm.models.hiera.MaskUnitAttention",  # mask units: (batch, heads, windows, ...), heads before windows
        "timm.layers.attention.Attention",  # ViT, DeiT, DeiT III, FlexiViT, DINOv2 (+registers), PiT, qk_norm
        "timm.layers.attention.AttentionRope",
        "timm.models.eva.EvaAttention",  # EVA-02, rope
        "timm.models.beit.Attention",  # relative position bias
        "timm.models.cait.ClassAttn",  # class attention (CaiT, XCiT): one query
        "timm.models.cait.TalkingHeadAttn",  # the softmax, before the talking heads mix it again
        "timm.models.twins.LocallyGroupedAttn",  # windows
        "timm.models.twins.GlobalSubSampleAttn",  # spatial reduction: fewer keys than queries
        "timm.models.pvt_v2.Attention",
        "timm.models.swin_transformer.WindowAttention",  # windows, relative bias, shift masks
        "timm.models.swin_transformer_v2.WindowAttention",  # cosine attention
        "timm.models.vision_transformer_relpos.RelPosAttention",
        "timm.models.vision_transformer_sam.Attention",
        "timm.models.levit.Attention",  # attention biases; tokens or (conv mode) feature maps
        "timm.models.levit.AttentionDownsample",  # subsampled queries: fewer queries than keys
        "timm.models.tnt.Attention",  # inner (pixel) and outer (patch) attention alike
        "timm.models.tiny_vit.Attention",  # windows, attention biases
        "timm.models.gcvit.WindowAttentionGlobal",  # windows; global queries in its global blocks
        "timm.models.davit.WindowAttention",  # windows (its channel attention is refused)
        "timm.models.crossvit.CrossAttention",  # one query: the class token of one branch over the other's tokens
        "timm.models.efficientformer.Attention",  # attention biases
        "timm.models.efficientformer_v2.Attention2d",  # the softmax, before talking_head2 mixes the heads again
        "timm.models.efficientformer_v2.Attention2dDownsample",  # fewer queries than keys
        "timm.models.maxxvit.AttentionCl",  # MaxViT, CoAtNet: windows and grids in batch, relative bias
        "timm.models.maxxvit.Attention2d",  # CoAtNet: channels-first, relative bias
        "timm.models.swin_transformer_v2_cr.WindowMultiHeadAttention",  # cosine attention, windows, shift masks
        "timm.models.mvitv2.MultiScaleAttention",  # pooled queries and keys, relative position
        "torchvision.models.swin_transformer.ShiftedWindowAttention",
        "torchvision.models.swin_transformer.ShiftedWindowAttentionV2",
        "torchvision.models.maxvit.RelativePositionalMultiHeadAttention",  # its softmax; windows and grids in batch
        # Hugging Face transformers 5.25, equal to output_attentions=True under "eager"; under "sdpa" too
        "transformers.models.vit.modeling_vit.ViTAttention",
        "transformers.models.deit.modeling_deit.DeiTAttention",
        "transformers.models.dinov2.modeling_dinov2.Dinov2Attention",
        "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers.Dinov2WithRegistersAttention",
        "transformers.models.dinov3_vit.modeling_dinov3_vit.DINOv3ViTAttention",  # rope
        "transformers.models.clip.modeling_clip.CLIPAttention",
        "transformers.models.siglip.modeling_siglip.SiglipAttention",
        "transformers.models.vit_mae.modeling_vit_mae.ViTMAEAttention",
        "transformers.models.vit_msn.modeling_vit_msn.ViTMSNAttention",
        "transformers.models.ijepa.modeling_ijepa.IJepaAttention",
        "transformers.models.beit.modeling_beit.BeitAttention",  # relative position bias
        "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSelfAttention",  # inside ...Attention
        "transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSdpaSelfAttention",
        "transformers.models.yolos.modeling_yolos.YolosSelfAttention",  # detection tokens
        "transformers.models.segformer.modeling_segformer.SegformerAttention",  # spatial reduction
        "transformers.models.swin.modeling_swin.SwinAttention",  # windows
        "transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention",  # eager only: cosine attention
        "transformers.models.donut.modeling_donut_swin.DonutSwinSelfAttention",  # eager only
        "transformers.models.pvt.modeling_pvt.PvtEfficientSelfAttention",  # eager only: spatial reduction
        "transformers.models.pvt_v2.modeling_pvt_v2.PvtV2SelfAttention",  # eager only
    }
)

_REFUSED = {
    "timm.models.xcit.XCA": "it attends across channels (cross-covariance attention), not across tokens",
    "timm.models.davit.ChannelAttention": "it attends across channels, not across tokens",
    "timm.models.davit.ChannelAttentionV2": "it attends across channels, not across tokens",
    "timm.models.convit.GPSA": "its weights mix two softmaxes through a learned gate",
    "timm.models.edgenext.CrossCovarianceAttn": "it attends across channels (cross-covariance attention), not tokens",
    "timm.models.coat.FactorAttnConvRelPosEnc": (
        "its factorized attention takes a softmax of the keys over tokens, never a queries-by-keys map"
    ),
    "timm.models.volo.OutlookAttention": (
        "its outlook attention predicts each token's weights over its k x k neighbourhood, not queries against keys"
    ),
    "timm.models.nextvit.ConvAttention": "it is a grouped convolution: there are no attention weights",
    "timm.models.efficientvit_msra.CascadedGroupAttention": (
        "it takes one softmax per head in a cascade (each head fed by the previous head's output), not one map"
    ),
    "transformers.models.vitdet.modeling_vitdet.VitDetAttention": (
        "its softmax folds the heads into the batch axis, so its map has no heads axis to give"
    ),
}

# Class names that say "attention": a module so named is an attention module, read or refused, never skipped.
_LOOKS_LIKE_ATTENTION = re.compile(r"Attn|Attention|^XCA$|^[GM]HSA$|^GPSA$")


def class_name(module: nn.Module) -> str:
    """``module.qualname`` of the module's class, as the catalogue names it."""
    kind = type(module)
    return f"{kind.__module__}.{kind.__qualname__}"


def attention_kind(module: nn.Module) -> str | None:
    """How ``capture_attention`` reads this module's map (``FUNCTIONAL`` or ``MHA``), or None if it cannot.

    Examples:
        >>> import torch
        >>> from featurehooks._attention_kinds import attention_kind
        >>> attention_kind(torch.nn.MultiheadAttention(8, 2)), attention_kind(torch.nn.Linear(2, 2))
        ('mha', None)
    """
    if isinstance(module, nn.MultiheadAttention):
        return MHA
    return FUNCTIONAL if class_name(module) in _FUNCTIONAL else None


def _looks_like_attention(module: nn.Module) -> bool:
    return attention_kind(module) is not None or bool(_LOOKS_LIKE_ATTENTION.search(type(module).__name__))


def attention_modules(model: nn.Module) -> list[str]:
    """Paths of the attention modules of ``model``, supported or not, in module order.

    A module counts when the catalogue reads it or its class name says attention, unless it holds another such
    module (a block named after its attention, such as CaiT's ``LayerScaleBlockClassAttn``).
    """
    found = []
    for path, module in model.named_modules():
        if not _looks_like_attention(module):
            continue
        if attention_kind(module) is None and any(
            _looks_like_attention(inner) for inner in module.modules() if inner is not module
        ):
            continue
        found.append(path)
    return found


def refusal(module: nn.Module) -> str:
    """Why ``capture_attention`` cannot read this module, in a few words."""
    return _REFUSED.get(class_name(module), "featurehooks does not know how this kind computes its weights")


def sdpa_weights(
    query: Tensor,
    key: Tensor,
    value: Tensor | None = None,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The weights ``F.scaled_dot_product_attention`` applies to ``value`` for these arguments, before dropout.

    Computed in float32 (or the inputs' wider float type), detached, of shape ``(..., queries, keys)``.

    Examples:
        >>> import torch
        >>> from featurehooks._attention_kinds import sdpa_weights
        >>> q, k = torch.rand(1, 2, 3, 4), torch.rand(1, 2, 5, 4)
        >>> weights = sdpa_weights(q, k, is_causal=True)
        >>> tuple(weights.shape), weights.sum(-1).allclose(torch.ones(1, 2, 3)), float(weights[0, 0, 0, 1])
        ((1, 2, 3, 5), True, 0.0)
    """
    del value, dropout_p  # the weights are taken before dropout, and the values do not change them
    dtype = torch.promote_types(query.dtype, torch.float32)
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):  # float32 under a caller's autocast too
        q, k = query.detach().to(dtype), key.detach().to(dtype)
        if enable_gqa:
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        scores = (q * (1 / math.sqrt(q.size(-1)) if scale is None else scale)) @ k.transpose(-2, -1)
        if is_causal:
            causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, -math.inf)
        return _masked(scores, attn_mask).softmax(dim=-1)


def _masked(scores: Tensor, mask: Tensor | None) -> Tensor:
    """``scores`` with an additive float mask added, or -inf where a boolean mask is False (SDPA's convention)."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, -math.inf)
    return scores + mask.to(scores.dtype)


_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")


def mha_weights(module: nn.MultiheadAttention, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    """The per-head weights of this call of ``module`` (its forward's ``args``/``kwargs``), before dropout.

    Follows ``F.multi_head_attention_forward``: in-projection of query and key, ``bias_k``, ``add_zero_attn``,
    ``attn_mask`` (boolean: True is masked; or additive) and ``key_padding_mask``. Shape ``(batch, heads, queries,
    keys)`` (batch 1 for unbatched inputs), float32 or wider, detached.

    Examples:
        >>> import torch
        >>> from featurehooks._attention_kinds import mha_weights
        >>> mha = torch.nn.MultiheadAttention(8, 2).eval()
        >>> x = torch.rand(5, 3, 8)  # (tokens, batch, channels)
        >>> expected = mha(x, x, x, average_attn_weights=False)[1]
        >>> torch.allclose(mha_weights(mha, (x, x, x), {}), expected, atol=1e-6)
        True
    """
    given = dict(zip(_MHA_ARGS, args)) | kwargs
    query, key = given["query"], given["key"]
    dtype = torch.promote_types(query.dtype, torch.float32)
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):  # float32 under a caller's autocast too
        if query.dim() == 2:  # unbatched: (tokens, channels)
            query, key = query.unsqueeze(1), key.unsqueeze(1)
        elif module.batch_first:
            query, key = query.transpose(0, 1), key.transpose(0, 1)
        queries, batch, _ = query.shape
        heads, head_dim = module.num_heads, module.head_dim
        if module._qkv_same_embed_dim:
            w_q, w_k, _ = module.in_proj_weight.chunk(3)
        else:
            w_q, w_k = module.q_proj_weight, module.k_proj_weight
        b_q, b_k = (None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)[:2]
        q = F.linear(query.detach(), w_q, b_q).to(dtype)
        k = F.linear(key.detach(), w_k, b_k).to(dtype)
        if module.bias_k is not None:
            k = torch.cat([k, module.bias_k.to(dtype).repeat(1, batch, 1)])
        q = q.reshape(queries, batch * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], batch * heads, head_dim).transpose(0, 1)
        if module.add_zero_attn:
            k = torch.cat([k, k.new_zeros(batch * heads, 1, head_dim)], dim=1)
        scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)  # (batch * heads, queries, keys)
        extra = scores.shape[-1] - key.shape[0]  # bias_k and the zero key: never masked
        attn_mask, padding = given.get("attn_mask"), given.get("key_padding_mask")
        if attn_mask is not None:
            scores = _masked(scores, _inverted(F.pad(attn_mask, (0, extra)), attn_mask))
        scores = scores.view(batch, heads, queries, -1)
        if padding is not None:
            padding = F.pad(padding.reshape(batch, -1), (0, extra)).view(batch, 1, 1, -1)
            scores = _masked(scores, _inverted(padding, padding))
        return scores.softmax(dim=-1)


def _inverted(mask: Tensor, original: Tensor) -> Tensor:
    """nn.MultiheadAttention's boolean masks say True where SDPA's say False: flip them, keep additive ones."""
    return ~mask if original.dtype == torch.bool else mask


# Classes whose windows come after the heads axis: (batch, heads, windows, queries, keys).
_HEADS_BEFORE_WINDOWS = frozenset({"timm.models.nest.Attention", "timm.models.hiera.MaskUnitAttention"})


def folded(module: nn.Module, weights: Tensor) -> Tensor:
    """A module's map as ``(batch, heads, queries, keys)``: windows, blocks or groups folded into the batch axis
    (batch-major, as the module's input lies), a map without a heads axis given one.

    Examples:
        >>> import torch
        >>> from featurehooks._attention_kinds import folded
        >>> tuple(folded(torch.nn.Identity(), torch.rand(2, 3, 4, 5, 5)).shape)  # (batch, windows, heads, q, k)
        (6, 4, 5, 5)
    """
    if weights.dim() == 3:
        return weights.unsqueeze(1)
    if weights.dim() == 5 and class_name(module) in _HEADS_BEFORE_WINDOWS:
        return weights.transpose(1, 2).flatten(0, 1)
    return weights.reshape(-1, *weights.shape[-3:])
