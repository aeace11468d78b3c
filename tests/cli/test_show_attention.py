"""``featurehooks show --attention``: per-head attention maps and their rollout over the image, the refusals, the
``[attention]`` mark of ``featurehooks layers``, and the viz functions the picture is drawn from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks.viz
from featurehooks import FeatureExtractor, prepare_image
from featurehooks.attention import attention_rollout, capture_attention
from featurehooks.cli import main
from featurehooks.errors import InvalidValueError
from featurehooks.viz import add_caption, attention_grid, attention_saliency, rollout_saliency

VIT = "timm/vit_tiny_patch16_224"  # 12 blocks of 3 heads, a class token and 14x14 patches at 224 pixels
CAPTION = "RANDOM weights (seed 0): shows the mechanics, not what trained weights see"


def show(image: Path, out: Path, *flags: str, backbone: str = VIT) -> int:
    return main(["show", str(image), "--backbone", backbone, "--weights", "none", "--out", str(out), *flags])


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: "), stderr
    return lines[0]


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``show --attention`` passed to ``save_attention_grid``: the panels and the image, before drawing."""
    seen: dict[str, Any] = {}
    save = featurehooks.viz.save_attention_grid

    def spy(path: Path, panels: dict[str, torch.Tensor], image: torch.Tensor, **kwargs: Any) -> Path:
        seen.update(panels=panels, image=image)
        return save(path, panels, image, **kwargs)

    monkeypatch.setattr(featurehooks.viz, "save_attention_grid", spy)
    return seen


def test_rollout_and_heads_equal_the_library_on_the_same_model(
    images: Path, tmp_path: Path, drawn: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "attention.png"
    assert show(images / "0.png", out, "--attention", "--rollout", "--heads", "2", "--tile-size", "16") == 0
    assert "attention per head of blocks.11.attn; the rollout of 12 attention modules" in capsys.readouterr().out
    # the oracle: the same seeded model through the extractor's own forward (not the command's), every block captured
    torch.manual_seed(0)
    with FeatureExtractor(VIT, ["blocks.11.attn"], weights=None, early_exit=False) as extractor:
        image = prepare_image(images / "0.png", extractor)
        with torch.no_grad(), capture_attention(extractor.backbone) as maps:
            extractor(image)
    assert len(maps) == 12
    torch.testing.assert_close(drawn["image"], image)
    panels = drawn["panels"]
    assert list(panels) == ["blocks.11.attn", "rollout"]
    expected_rollout = attention_rollout(maps, prefix_tokens=1)[0].reshape(1, 14, 14)
    torch.testing.assert_close(panels["rollout"], expected_rollout, rtol=1e-5, atol=1e-7)
    expected_heads = maps["blocks.11.attn"][0, :2, 0, 1:].reshape(2, 14, 14)  # the class token's row, heads 0 and 1
    torch.testing.assert_close(panels["blocks.11.attn"], expected_heads, rtol=1e-5, atol=1e-7)
    # the picture: a caption band for random weights, then two rows (image + 2 heads; image + rollout)
    width, height = 3 * 16 + 2 * 2, 2 * (14 + 16) + 2
    band = add_caption(np.zeros((height, width, 3), np.uint8), CAPTION)[:-height]
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size == (width, len(band) + height)
        pixels = np.asarray(picture)
    np.testing.assert_array_equal(pixels[: len(band)], band)
    np.testing.assert_array_equal(pixels[len(band) :], attention_grid(panels, image, tile_size=16))


def test_layers_patterns_choose_the_rows_in_module_order(
    images: Path, tmp_path: Path, drawn: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "attention.png"
    flags = ["--attention", "--layers", "blocks.1?.attn", "blocks.0.attn", "--tile-size", "8", "--resize", "224"]
    assert show(images / "1.png", out, *flags) == 0
    assert "attention per head of blocks.0.attn, blocks.10.attn, blocks.11.attn" in capsys.readouterr().out
    assert {name: tuple(value.shape) for name, value in drawn["panels"].items()} == {
        "blocks.0.attn": (3, 14, 14),
        "blocks.10.attn": (3, 14, 14),
        "blocks.11.attn": (3, 14, 14),
    }
    with Image.open(out) as picture:
        assert picture.width == 4 * 8 + 3 * 2  # the image and 3 heads


@pytest.mark.parametrize(
    ("backbone", "flags", "message"),
    [
        ("resnet18", ["--attention"], "resnet18 has no attention module whose maps featurehooks reads"),
        (VIT, ["--attention", "--layers", "blocks.0"], "'blocks.0' is a timm.models.vision_transformer.Block"),
        (VIT, ["--rollout", "--layers", "blocks.0.attn"], "--rollout draws attention: add --attention"),
        (VIT, ["--heads", "2", "--layers", "blocks.0.attn"], "--heads draws attention: add --attention"),
        (VIT, [], "--layers is required (or --attention"),
    ],
)
def test_errors_exit_2_with_one_line(
    images: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    backbone: str,
    flags: list[str],
    message: str,
) -> None:
    assert show(images / "0.png", tmp_path / "a.png", *flags, backbone=backbone) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "a.png").exists()


def test_heads_zero_is_a_usage_error(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        show(images / "0.png", tmp_path / "a.png", "--attention", "--heads", "0")
    assert exit_info.value.code == 2
    assert "argument --heads: expected an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.slow  # a Swin-T of random weights, built and run at 224 pixels
def test_window_attention_is_refused(images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert show(images / "0.png", tmp_path / "a.png", "--attention", backbone="timm/swin_tiny_patch4_window7_224") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "attends to 49 keys" in line and "window attention (Swin)" in line


def test_layers_marks_attention_modules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layers", VIT]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["blocks.0.attn"][3:5] == ["Attention", "[attention]"]
    assert rows["blocks.0.attn.qkv"][3:5] == ["Linear", "NLC+1"]
    assert sum("[attention]" in row for row in rows.values()) == 12


def test_saliency_without_a_class_token_is_the_attention_each_patch_receives() -> None:
    generator = torch.Generator().manual_seed(0)
    maps = [torch.rand(2, 3, 6, 6, generator=generator).softmax(-1) for _ in range(3)]  # 2x3 patches, no prefix
    saliency = attention_saliency(maps[0], (2, 3), prefix_tokens=0)
    torch.testing.assert_close(saliency, maps[0].mean(-2).reshape(2, 3, 2, 3))
    rollout = rollout_saliency(maps, (2, 3), prefix_tokens=0, head_fusion="max")
    torch.testing.assert_close(rollout, attention_rollout(maps, head_fusion="max").mean(1).reshape(2, 2, 3))


def test_saliency_refuses_keys_that_are_not_the_grid() -> None:
    windows = torch.rand(4, 2, 9, 9).softmax(-1)  # 4 windows of 3x3 tokens of a 6x6 grid
    with pytest.raises(InvalidValueError, match="window attention"):
        attention_saliency(windows, (6, 6), prefix_tokens=0)
    with pytest.raises(InvalidValueError, match="not a 2x2 grid"):
        rollout_saliency([windows], (2, 2), prefix_tokens=1)


def test_attention_grid_blends_each_map_over_the_image() -> None:
    image = torch.zeros(3, 64, 64)  # black
    panels = {"a": torch.stack([torch.zeros(2, 2), torch.eye(2)])}
    grid = attention_grid(panels, image, tile_size=32, alpha=1.0)
    assert grid.shape == (14 + 32, 3 * 32 + 2 * 2, 3)
    picture, constant, eye = grid[14:, :32], grid[14:, 34:66], grid[14:, 68:100]
    assert picture.max() == 0
    assert (constant[16:] == [68, 1, 84]).all()  # a constant map: viridis' low end (above: the label "0")
    assert tuple(eye[31, 31]) == (253, 231, 37) and tuple(eye[31, 0]) == tuple(eye[0, 31]) == (68, 1, 84)
    hidden = attention_grid(panels, image, tile_size=32, alpha=0.0)
    assert hidden[14 + 16 :, 34:66].max() == hidden[14 + 16 :, 68:100].max() == 0  # alpha 0: the image alone
