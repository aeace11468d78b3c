"""Layouts everywhere past the extractor: losses, pooled and nchw dumps, the CLI, and the DINO preset."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from torch import nn

import featurehooks as fh
from featurehooks._layout import Layout, classify, pool_positions, to_nchw, token_grid
from featurehooks.cli import main

timm = pytest.importorskip("timm")


def tiny_vit(**kwargs: object) -> nn.Module:
    """A two-block timm ViT on 32x32 images, patch 8: a class token and two register tokens."""
    torch.manual_seed(0)
    options = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, reg_tokens=2, num_classes=5)
    options.update(kwargs)
    return timm.models.VisionTransformer(**options).eval()


class ConvNet(nn.Module):
    """Two convolutions; ``view`` picks how the second one's output is laid out (NCHW, NHWC or NLC tokens)."""

    def __init__(self, view: str = "NCHW", prefix: int = 0) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.out = nn.Identity()
        self.view = view
        self.prefix = nn.Parameter(torch.randn(1, prefix, 8)) if prefix else None
        if prefix:
            self.num_prefix_tokens = prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        if self.view == "NHWC":
            y = y.permute(0, 2, 3, 1)
        elif self.view == "NLC":
            y = y.flatten(2).transpose(1, 2)
            if self.prefix is not None:
                y = torch.cat([self.prefix.expand(y.shape[0], -1, -1), y], dim=1)
        return self.out(y)


# -- layout arithmetic ---------------------------------------------------------------------------------


def test_classify_reads_each_layout_from_its_shape() -> None:
    image = (2, 3, 224, 224)
    assert classify((2, 64, 56, 56), image, None) == Layout("NCHW", 64, 4)
    assert classify((2, 56, 56, 96), image, None) == Layout("NHWC", 96, 4)
    assert classify((2, 197, 384), image, 1) == Layout("NLC", 384, 16, 1)
    assert classify((2, 196, 384), image, 1) == Layout("NLC", 384, 16, 0)  # a patch embedding: no class token
    assert classify((2, 197, 384), image, None) == Layout("NLC", 384, None, None)  # unknown prefix: no grid
    assert classify((2, 1000), image, None) == Layout("NC", 1000)
    assert classify((128, 49, 96), image, 0).kind == "other"  # windows folded into the batch
    assert classify(None, image, None).kind == "other"
    assert classify((2, 6, 197, 64), image, 1).kind == "other"  # (B, heads, N, head_dim): no map of the image
    assert classify((2, 1, 384), image, 1) == Layout("NLC", 384, None, 1)  # class token only (CaiT)


def test_token_grid_rounds_down_or_up_as_the_tokens_say() -> None:
    assert token_grid(10 * 14, (160, 224), 16, "x") == (10, 14)
    assert token_grid(10 * 14, (150, 220), 16, "x") == (10, 14)  # padded (dynamic_img_pad)
    assert token_grid(9 * 13, (150, 220), 16, "x") == (9, 13)  # cropped
    with pytest.raises(fh.InvalidValueError, match="do not tile"):
        token_grid(50, (160, 224), 16, "x")


def test_pooling_never_averages_prefix_tokens() -> None:
    tokens = torch.randn(2, 3 + 4, 5)
    layout = Layout("NLC", 5, 8, 3)
    torch.testing.assert_close(pool_positions(tokens, layout, "avg", "x"), tokens[:, 3:].mean(1))
    torch.testing.assert_close(pool_positions(tokens, layout, "max", "x"), tokens[:, 3:].amax(1))
    torch.testing.assert_close(pool_positions(tokens, layout, "cls", "x"), tokens[:, 0])
    maps = torch.randn(2, 4, 4, 5)
    torch.testing.assert_close(pool_positions(maps, Layout("NHWC", 5, 8), "avg", "x"), maps.mean((1, 2)))
    with pytest.raises(fh.InvalidValueError, match="no class token"):
        pool_positions(maps, Layout("NHWC", 5, 8), "cls", "x")
    with pytest.raises(fh.InvalidValueError, match="prefix_tokens="):
        pool_positions(tokens, Layout("NLC", 5, None, None), "avg", "x")
    with pytest.raises(fh.InvalidValueError, match="class tokens only"):
        pool_positions(tokens[:, :1], Layout("NLC", 5, None, 1), "avg", "x")
    maps_nchw, prefix = to_nchw(tokens[:, :7], layout, (16, 16), "x")
    assert maps_nchw.shape == (2, 5, 2, 2) and prefix is not None and torch.equal(prefix, tokens[:, :3])


# -- losses on every layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("view", ["NHWC", "NLC"])
@pytest.mark.parametrize("loss_type", ["perceptual", "normalized", "cosine", "style"])
def test_feature_losses_read_channels_from_the_layout(view: str, loss_type: str) -> None:
    """A loss on permuted or token outputs equals the loss on the same features as NCHW maps."""

    def loss_on(model: nn.Module) -> torch.Tensor:
        if loss_type == "style":
            loss = fh.StyleLoss(model, ["out"], weights=None)
        else:
            options = {"normalize_features": True} if loss_type == "normalized" else {}
            distance = "cosine" if loss_type == "cosine" else "mse"
            loss = fh.PerceptualLoss(model, ["out"], weights=None, distance=distance, **options)
        torch.manual_seed(2)
        return loss(torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16))

    reference = loss_on(ConvNet("NCHW"))
    model = ConvNet(view)
    model.num_prefix_tokens = 0  # type: ignore[assignment]
    torch.testing.assert_close(loss_on(model), reference)


def test_style_loss_on_nchw_tokens_leaves_the_class_token_out() -> None:
    images = torch.rand(2, 3, 16, 16)
    with_prefix = fh.FeatureExtractor(ConvNet("NLC", prefix=1), ["out"], weights=None, output_format="nchw")
    plain = fh.FeatureExtractor(ConvNet("NCHW"), ["out"], weights=None)
    loss = fh.StyleLoss(
        fh.FeatureExtractor(ConvNet("NLC", prefix=1), ["out"], weights=None, mode="grad", output_format="nchw"), ["out"]
    )
    reference = fh.StyleLoss(fh.FeatureExtractor(ConvNet("NCHW"), ["out"], weights=None, mode="grad"), ["out"])
    torch.testing.assert_close(with_prefix(images)["out"], plain(images)["out"])
    target = torch.rand(1, 3, 16, 16)
    torch.testing.assert_close(loss(images, target), reference(images, target))


@pytest.mark.parametrize("distance", ["l1", "cosine"])
def test_feature_matching_reads_channels_from_the_layout(distance: str) -> None:
    fake, real = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)
    reference = fh.FeatureMatchingLoss(distance=distance)({"a": fake}, {"a": real})
    nhwc = fh.FeatureMatchingLoss(distance=distance, layout={"a": "NHWC"})
    torch.testing.assert_close(nhwc({"a": fake.permute(0, 2, 3, 1)}, {"a": real.permute(0, 2, 3, 1)}), reference)
    tokens = fh.FeatureMatchingLoss(distance=distance, layout="NLC")
    as_tokens = [fake.flatten(2).transpose(1, 2)], [real.flatten(2).transpose(1, 2)]
    torch.testing.assert_close(tokens(*as_tokens), reference)
    with pytest.raises(fh.InvalidValueError, match="layout must be"):
        fh.FeatureMatchingLoss(layout="CHW")


# -- dumps and CLI -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def photos(png_folder: Callable[..., Path]) -> Path:
    return png_folder(5)


def _tokens(photos: Path) -> torch.Tensor:
    """Native ``blocks.1`` tokens of every image, prepared as the dumps prepare them."""
    native = fh.FeatureExtractor(tiny_vit(), ["blocks.1"], weights=None)
    files = sorted(photos.iterdir())
    batch = torch.cat([fh.prepare_image(path, native, resize_size=36, crop_size=32) for path in files])
    return native(batch)["blocks.1"]


@pytest.mark.parametrize("pool", ["avg", "max", "cls"])
def test_pooled_vit_dump_pools_patch_tokens_or_takes_the_class_token(photos: Path, tmp_path: Path, pool: str) -> None:
    tokens = _tokens(photos)
    ext = fh.FeatureExtractor(tiny_vit(), ["blocks.1"], weights=None)
    result = fh.dump_features(ext, photos, tmp_path, pool=pool, resize_size=36, crop_size=32, num_workers=0)
    dumped = torch.from_numpy(np.array(result.load("blocks.1")))
    expected = {"avg": tokens[:, 3:].mean(1), "max": tokens[:, 3:].amax(1), "cls": tokens[:, 0]}[pool]
    torch.testing.assert_close(dumped, expected, rtol=1e-5, atol=1e-5)


def test_nchw_dump_writes_patch_maps_and_refuses_what_it_cannot_pool(photos: Path, tmp_path: Path) -> None:
    tokens = _tokens(photos)
    ext = fh.FeatureExtractor(tiny_vit(), ["blocks.1"], weights=None, output_format="nchw")
    result = fh.dump_features(ext, photos, tmp_path / "maps", resize_size=36, crop_size=32, num_workers=0)
    expected = tokens[:, 3:].reshape(5, 4, 4, 32).permute(0, 3, 1, 2)
    torch.testing.assert_close(torch.from_numpy(np.array(result.load("blocks.1"))), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(fh.InvalidValueError, match="no class token"):
        fh.dump_features(ext, photos, tmp_path / "cls", pool="cls", resize_size=36, crop_size=32, num_workers=0)
    prefixed = fh.FeatureExtractor(
        tiny_vit(), ["blocks.1"], weights=None, output_format="nchw", return_prefix_tokens=True
    )
    with pytest.raises(fh.InvalidValueError, match="prefix tokens only"):
        fh.dump_features(prefixed, photos, tmp_path / "avg", pool="avg", resize_size=36, crop_size=32, num_workers=0)
    both = fh.dump_features(prefixed, photos, tmp_path / "both", resize_size=36, crop_size=32, num_workers=0)
    prefix = torch.from_numpy(np.array(both.load("blocks.1.prefix")))
    torch.testing.assert_close(prefix, tokens[:, :3], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_cli_extract_takes_output_format_and_cls(photos: Path, tmp_path: Path) -> None:
    common = [
        "--backbone",
        "timm/vit_tiny_patch16_224",
        "--layers",
        "blocks.1",
        "--weights",
        "none",
        "--resize",
        "224",
        "--workers",
        "0",
        "-q",
    ]
    assert main(["extract", str(photos), "--out", str(tmp_path / "maps"), "--output-format", "nchw", *common]) == 0
    assert main(["extract", str(photos), "--out", str(tmp_path / "cls"), "--pool", "cls", *common]) == 0
    maps = np.load(tmp_path / "maps" / "blocks.1.npy")
    cls = np.load(tmp_path / "cls" / "blocks.1.npy")
    assert maps.shape == (5, 192, 14, 14) and cls.shape == (5, 192)


def test_cli_show_draws_vit_tokens_as_maps(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grid.png"
    argv = [
        "show",
        str(photos / "0.png"),
        "--out",
        str(out),
        "--backbone",
        "timm/vit_tiny_patch16_224",
        "--layers",
        "blocks.1",
        "patch_embed",
        "--weights",
        "none",
        "--resize",
        "224",
        "--channels",
        "3",
    ]
    assert main(argv) == 0
    assert Image.open(out).size[0] > 0 and "blocks.1" in capsys.readouterr().out


@pytest.mark.slow
def test_timm_models_with_unsaid_class_tokens_need_prefix_tokens() -> None:
    """CoaT has class tokens but no num_prefix_tokens: pooling or maps ask for prefix_tokens= instead of guessing 0."""
    ext = fh.FeatureExtractor("timm/coat_lite_tiny", ["norm4"], weights=None)
    assert ext.output_layouts["norm4"].prefix_tokens is None
    with pytest.raises(fh.InvalidValueError, match="prefix_tokens="):
        fh.FeatureExtractor("timm/coat_lite_tiny", ["norm4"], weights=None, output_format="nchw")
    maps = fh.FeatureExtractor("timm/coat_lite_tiny", ["norm4"], weights=None, output_format="nchw", prefix_tokens=1)
    assert maps(torch.rand(1, 3, 224, 224))["norm4"].shape == (1, 320, 7, 7)


def test_a_prefix_count_that_leaves_no_patch_tokens_is_named() -> None:
    with pytest.raises(fh.InvalidValueError, match="no patch tokens"):
        fh.FeatureExtractor(tiny_vit(), ["blocks.0"], weights=None, output_format="nchw", prefix_tokens=300)


def test_cli_show_refuses_outputs_that_are_no_maps(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "show",
        str(photos / "0.png"),
        "--out",
        str(tmp_path / "g.png"),
        "--backbone",
        "timm/vit_tiny_patch16_224",
        "--layers",
        "blocks.0.attn.q_norm",
        "--weights",
        "none",
        "--resize",
        "224",
    ]
    assert main(argv) == 2
    assert "not a feature map" in capsys.readouterr().err and not (tmp_path / "g.png").exists()


def test_cli_layers_shows_token_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", "timm/vit_tiny_patch16_224"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["blocks.3"])
    assert "NLC" in row and "192" in row and "16" in row


# -- DINO preset ---------------------------------------------------------------------------------------


def _dino_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return timm.create_model("vit_small_patch16_224.dino", pretrained=False).state_dict()


def _loss_by_hand(state: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The preset's definition computed on timm's own forward_intermediates."""
    model = timm.create_model("vit_small_patch16_224.dino", pretrained=False).eval()
    model.load_state_dict(state)
    mean = torch.tensor(model.pretrained_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    total = torch.zeros(x.shape[0])
    with torch.no_grad():
        maps = [
            model.forward_intermediates((images - mean) / std, indices=[2, 5, 8, 11], intermediates_only=True)
            for images in (x, y)
        ]
    for a, b in zip(*maps):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12)
        total += (2 - 2 * cos).flatten(1).mean(1)
    return total.mean()


@pytest.mark.slow
def test_dino_preset_loads_a_local_file_and_matches_timm(tmp_path: Path) -> None:
    state = _dino_state()
    path = tmp_path / "dino.safetensors"
    save_file(state, str(path))
    loss = fh.losses.dino_vits16(weights=str(path))
    torch.manual_seed(4)
    x, y = torch.rand(1, 3, 224, 224), torch.rand(1, 3, 224, 224)
    torch.testing.assert_close(loss(x, y), _loss_by_hand(state, x, y), rtol=1e-4, atol=1e-5)
    assert loss(x, x).item() == pytest.approx(0.0, abs=1e-5)
    small = torch.rand(1, 3, 96, 128, requires_grad=True)  # resized to 224 inside
    loss(small, torch.rand(1, 3, 96, 128)).backward()
    assert small.grad is not None and torch.isfinite(small.grad).all()


@pytest.mark.slow
def test_dino_preset_loads_from_the_hub_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    state = _dino_state()
    repo = timm.models.get_pretrained_cfg("vit_small_patch16_224.dino").hf_hub_id
    folder = tmp_path / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    save_file(state, str(folder / "snapshots" / commit / "model.safetensors"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    loss = fh.losses.dino_vits16()
    assert torch.equal(loss.extractor.backbone.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])
    with pytest.raises(fh.WeightsUnavailableError):
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
        fh.losses.dino_vits16()
