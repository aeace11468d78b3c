"""capture_attention on Hugging Face vision transformers.

Oracle: the model's own ``output_attentions=True`` under ``attn_implementation="eager"`` (the same weights), which
returns each layer's softmax. Each model is captured under its fused path (``"sdpa"``) where it has one and under
``"eager"`` itself (then the map is the module's own softmax). Configs are tiny, weights seeded and random.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.testing import assert_close

from featurehooks._attention_kinds import attention_modules, class_name
from featurehooks.attention import capture_attention
from featurehooks.errors import InvalidTypeError

transformers = pytest.importorskip("transformers")

SEED = 0
VIT = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
}
SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 1], "num_heads": [1, 2], "window_size": 4}
PYRAMID = {
    "num_encoder_blocks": 2,
    "depths": [1, 1],
    "hidden_sizes": [16, 32],
    "patch_sizes": [7, 3],
    "strides": [4, 2],
    "num_attention_heads": [1, 2],
    "mlp_ratios": [2, 2],
}
BOTH, EAGER = ("sdpa", "eager"), ("eager",)


def _last_block_of_each_stage(paths: list[str]) -> list[str]:
    """Swin's ``output_attentions`` holds the last block's map of each stage."""
    last: dict[str, str] = {}
    for path in paths:
        last[path.split(".blocks.")[0]] = path
    return list(last.values())


# case -> (config class, model class, config kwargs, implementations, paths that output_attentions returns)
CASES: dict[str, tuple[str, str, dict[str, Any], tuple[str, ...], str]] = {
    "vit": ("ViTConfig", "ViTModel", VIT, BOTH, "*"),
    "deit": ("DeiTConfig", "DeiTModel", VIT, BOTH, "*"),
    "dinov2": ("Dinov2Config", "Dinov2Model", VIT, BOTH, "*"),
    "dinov2-registers": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", VIT, BOTH, "*"),
    "dinov3-rope": ("DINOv3ViTConfig", "DINOv3ViTModel", VIT, BOTH, "*"),
    "clip": ("CLIPVisionConfig", "CLIPVisionModel", VIT, BOTH, "*"),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", VIT, BOTH, "encoder.*"),  # + the head's MHA
    "vit-mae": ("ViTMAEConfig", "ViTMAEModel", {**VIT, "mask_ratio": 0.0}, BOTH, "*"),
    "vit-msn": ("ViTMSNConfig", "ViTMSNModel", VIT, BOTH, "*"),
    "ijepa": ("IJepaConfig", "IJepaModel", VIT, BOTH, "*"),
    "beit-relative-bias": ("BeitConfig", "BeitModel", {**VIT, "use_relative_position_bias": True}, BOTH, "*"),
    "data2vec-vision": (
        "Data2VecVisionConfig",
        "Data2VecVisionModel",
        {**VIT, "use_relative_position_bias": True},
        BOTH,
        "*",
    ),
    "yolos": ("YolosConfig", "YolosModel", {**VIT, "image_size": [32, 32], "num_detection_tokens": 2}, BOTH, "*"),
    "segformer": ("SegformerConfig", "SegformerModel", {**PYRAMID, "sr_ratios": [2, 1]}, BOTH, "*"),
    "swin": ("SwinConfig", "SwinModel", SWIN, BOTH, "last block"),
    "swinv2-cosine": ("Swinv2Config", "Swinv2Model", SWIN, EAGER, "last block"),
    "donut-swin": ("DonutSwinConfig", "DonutSwinModel", SWIN, EAGER, "last block"),
    "pvt": (
        "PvtConfig",
        "PvtModel",
        {**PYRAMID, "image_size": 32, "patch_sizes": [4, 2], "sequence_reduction_ratios": [2, 1]},
        EAGER,
        "*",
    ),
    "pvt-v2": ("PvtV2Config", "PvtV2Model", {**PYRAMID, "sr_ratios": [2, 1]}, EAGER, "*"),
}
PAIRS = [(case, impl) for case, (*_, impls, _) in CASES.items() for impl in impls]


def build(case: str, impl: str) -> nn.Module:
    config_name, model_name, kwargs, *_ = CASES[case]
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(SEED)
    return getattr(transformers, model_name)._from_config(config, attn_implementation=impl).eval()


def inputs(case: str) -> dict[str, Tensor]:
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(SEED))
    if case == "vit-mae":  # its shuffle of the patches draws noise each forward unless given
        return {"pixel_values": x, "noise": torch.rand(2, 16, generator=torch.Generator().manual_seed(SEED))}
    return {"pixel_values": x}


def flat(attentions: Any) -> list[Tensor]:
    """``output_attentions`` as one list (PVT v2 nests it by stage)."""
    if isinstance(attentions, Tensor):
        return [attentions]
    return [t for inner in attentions for t in flat(inner)]


def eager_attentions(case: str, model: nn.Module, x: dict[str, Tensor]) -> list[Tensor]:
    """The model's own attention maps, ``output_attentions=True`` on an eager copy with the same weights."""
    reference = build(case, "eager")
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        return flat(reference(**x, output_attentions=True).attentions)


@pytest.mark.parametrize(("case", "impl"), PAIRS)
def test_maps_equal_output_attentions_and_outputs_stay_bitwise(case: str, impl: str) -> None:
    model, x = build(case, impl), inputs(case)
    with torch.no_grad():
        expected = model(**x).last_hidden_state
        with capture_attention(model) as maps:
            out = model(**x).last_hidden_state
    assert torch.equal(out, expected)
    assert list(maps) == attention_modules(model) and len(maps) >= 2
    pattern = CASES[case][-1]
    paths = [p for p in maps if fnmatch.fnmatchcase(p, pattern)]
    if pattern == "last block":
        paths = _last_block_of_each_stage(list(maps))
    reference = eager_attentions(case, model, x)
    assert len(paths) == len(reference)
    for path, attention in zip(paths, reference):
        value = maps[path]
        assert value.dtype == torch.float32 and value.shape == attention.shape
        assert_close(value, attention.float(), atol=1e-6, rtol=0)
    for value in maps.values():
        assert_close(value.sum(-1), torch.ones(value.shape[:-1]), atol=1e-5, rtol=0)


def test_data2vec_reads_the_inner_module_that_makes_the_call() -> None:
    """Data2VecVisionAttention wraps the self-attention that calls SDPA (or softmax): only the inner one is read."""
    for impl, inner in (("sdpa", "Data2VecVisionSdpaSelfAttention"), ("eager", "Data2VecVisionSelfAttention")):
        model = build("data2vec-vision", impl)
        paths = attention_modules(model)
        assert paths == [f"encoder.layer.{k}.attention.attention" for k in range(2)]
        assert {class_name(model.get_submodule(p)).rsplit(".", 1)[1] for p in paths} == {inner}


def test_siglip_head_is_read_as_multihead_attention() -> None:
    model, x = build("siglip", "sdpa"), inputs("siglip")
    with torch.no_grad(), capture_attention(model) as maps:
        model(**x)
    assert list(maps)[-1] == "head.attention" and maps["head.attention"].shape == (2, 2, 1, 16)  # one probe query


def test_vitdet_is_refused_naming_its_class() -> None:
    torch.manual_seed(SEED)
    model = transformers.VitDetModel(transformers.VitDetConfig(**{**VIT, "image_size": 32})).eval()
    with pytest.raises(InvalidTypeError, match=r"VitDetAttention.*heads"), capture_attention(model):
        pass
