"""capture_attention(model) with ``layers=None`` across torchvision's classification zoo and one model per timm family.

Each model either gives a map for every attention module, outputs bitwise unchanged and rows summing to 1, or is
refused with featurehooks' own error naming one class (a kind it cannot read) or saying it has no attention module.
Weights are random (``weights=None``, ``pretrained=False``). torchvision's detection, segmentation, video, optical
flow and quantized models are left out (their inputs are not one image batch and their builds are slow), and the
three largest RegNets (the smaller ones run).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchvision
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from featurehooks.attention import capture_attention
from featurehooks.errors import InvalidTypeError, InvalidValueError

from helpers import maps_and_own_softmaxes

timm = pytest.importorskip("timm")

SEED = 0
SKIPPED = ("rcnn", "retinanet", "ssd", "fcos", "raft", "keypoint", "mvit", "s3d", "r3d", "r2plus1", "mc3", "swin3d")
SKIPPED += ("deeplab", "fcn", "lraspp", "quantized")
SKIPPED += ("regnet_y_16gf", "regnet_y_32gf", "regnet_y_128gf")  # RegNets too big to build in a test; the others run
TORCHVISION = sorted(n for n in torchvision.models.list_models() if not any(part in n for part in SKIPPED))
READ = ("vit_", "swin_", "maxvit_")  # torchvision's models with attention: all read
LARGE = ("vit_h_14", "vit_l_16", "vit_l_32")  # the base ViT's attention, at sizes that take seconds to build

# timm name -> None (every attention module read) or the class that refuses it ("" : no attention module at all)
TIMM: dict[str, str | None] = {
    "vit_tiny_patch16_224": None,
    "deit_tiny_patch16_224": None,
    "deit3_small_patch16_224": None,
    "beit_base_patch16_224": None,
    "eva02_tiny_patch14_224": None,
    "swin_s3_tiny_224": None,
    "cait_xxs24_224": None,
    "pit_xs_224": None,
    "twins_svt_small": None,
    "pvt_v2_b0": None,
    "mobilevit_xs": None,
    "vitamin_small_224": None,
    "swinv2_cr_tiny_224": None,
    "xcit_nano_12_p8_224": "timm.models.xcit.XCA",
    "levit_128s": None,
    "mvitv2_tiny": None,
    "coat_tiny": "timm.models.coat.FactorAttnConvRelPosEnc",
    "crossvit_tiny_240": None,
    "tnt_s_patch16_224": None,
    "maxvit_nano_rw_256": None,
    "coatnet_nano_cc_224": None,
    "efficientformer_l1": None,
    "efficientformerv2_s0": None,
    "nextvit_small": "timm.models.nextvit.ConvAttention",
    "edgenext_small": "timm.models.edgenext.CrossCovarianceAttn",
    "davit_tiny": "timm.models.davit.ChannelAttention",
    "convit_tiny": "timm.models.convit.GPSA",
    "gcvit_tiny": None,
    "hiera_tiny_224": None,
    "tiny_vit_5m_224": None,
    "efficientvit_m0": "timm.models.efficientvit_msra.CascadedGroupAttention",
    "volo_d1_224": "timm.models.volo.OutlookAttention",
    "nest_tiny": None,
    "fastvit_s12": "",
    "poolformer_s12": "",
    "focalnet_tiny_lrf": "",
    "efficientvit_b0": "",
}


def outcome(model: nn.Module, x: Tensor) -> str | None:
    """None when every attention module was read with the outputs bitwise unchanged; else the refusal's message."""
    with torch.no_grad():
        expected = model(x)
        try:
            with capture_attention(model) as maps:
                out = model(x)
        except (InvalidTypeError, InvalidValueError) as error:
            assert "\n" not in str(error)
            return str(error)
    assert maps and all(torch.equal(a, b) for a, b in zip(tree_leaves(out), tree_leaves(expected), strict=True))
    for value in maps.values():
        assert value.dim() == 4 and torch.allclose(value.sum(-1), torch.ones(()), atol=1e-5)
    return None


def image(size: int) -> Tensor:
    return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(SEED))


@pytest.mark.slow
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_zoo_is_read_or_refused(name: str) -> None:
    """A model without attention is refused before it runs (built on the meta device: no weights to make); the large
    ViTs, whose attention is the base ViT's (nn.MultiheadAttention, read below), are accepted without a forward."""
    torch.manual_seed(SEED)
    if not name.startswith(READ) or name in LARGE:
        try:
            with torch.device("meta"):
                model = torchvision.models.get_model(name, weights=None).eval()
        except NotImplementedError:  # RegNet's builder reads a tensor's value: built for real
            model = torchvision.models.get_model(name, weights=None).eval()
        if name in LARGE:
            with capture_attention(model) as maps:
                assert not maps
            return
        with pytest.raises(InvalidValueError, match="has no attention module") as refused:
            capture_attention(model).__enter__()
        assert "\n" not in str(refused.value)
        return
    model = torchvision.models.get_model(name, weights=None).eval()
    assert outcome(model, image(224)) is None


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TIMM))
def test_timm_family_is_read_or_refused_naming_its_class(name: str) -> None:
    torch.manual_seed(SEED)
    model = timm.create_model(name, pretrained=False).eval()
    found = outcome(model, image(model.pretrained_cfg["input_size"][-1]))
    refused = TIMM[name]
    if refused is None:
        assert found is None
    elif refused:
        assert found is not None and f"is a {refused}, whose map cannot be read" in found
    else:
        assert found is not None and "has no attention module" in found


def test_torchvision_maxvit_matches_its_own_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(SEED)
    kwargs: dict[str, Any] = {
        "stem_channels": 8,
        "block_channels": [16],
        "block_layers": [1],
        "head_dim": 8,
        "stochastic_depth_prob": 0.0,
    }
    maxvit = torchvision.models.MaxVit(input_size=(32, 32), partition_size=4, **kwargs).eval()
    x = image(32).expand(2, -1, -1, -1)
    maps, softmaxes = maps_and_own_softmaxes(maxvit, x, monkeypatch)
    assert list(maps) == [f"blocks.0.layers.0.layers.{kind}_attention.attn_layer.1" for kind in ("window", "grid")]
    assert len(softmaxes) == 2  # (batch, windows or grids, heads, tokens, tokens)
    for value, softmax in zip(maps.values(), softmaxes):
        assert value.shape == (2 * 4, 2, 16, 16)
        assert torch.equal(value, softmax.flatten(0, 1))
