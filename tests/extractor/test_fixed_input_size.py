"""Backbones that take one image size only (timm ViTs with a strict image size, torchvision's ViT): images prepared
to another size are refused before any forward, in one line naming the size to pass, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torchvision
from PIL import Image

from featurehooks import FeatureExtractor, dump_features, prepare_image
from featurehooks.cli import main
from featurehooks.errors import InvalidValueError

from helpers import tiny_extractor

# a torchvision ViT instance has no weights to say its resize and crop: the tests give sizes themselves
pytestmark = pytest.mark.filterwarnings("ignore:VisionTransformer instance gets no resize or crop")


def timm_vit(**kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {"img_size": 32, "patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2, "num_classes": 0}
    return timm.models.VisionTransformer(**{**options, **kwargs})


def torchvision_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32
    )


def test_input_size_is_the_one_size_a_backbone_takes() -> None:
    assert FeatureExtractor(timm_vit(), ["blocks.0"]).input_size == (32, 32)
    assert FeatureExtractor(timm_vit(img_size=(32, 48)), ["blocks.0"]).input_size == (32, 48)
    assert FeatureExtractor(torchvision_vit(), ["encoder"]).input_size == (32, 32)
    assert FeatureExtractor(timm_vit(dynamic_img_size=True), ["blocks.0"]).input_size is None  # takes any size
    assert tiny_extractor().input_size is None


@pytest.mark.parametrize("build", [timm_vit, torchvision_vit])
def test_prepare_image_refuses_another_size_naming_the_crop(build) -> None:
    ext = FeatureExtractor(build(), ["blocks.0" if build is timm_vit else "encoder"])
    pixels = torch.zeros(3, 40, 40, dtype=torch.uint8)
    with pytest.raises(InvalidValueError, match=r"takes 32x32 images only .* prepared to 24x24: pass crop_size=32"):
        prepare_image(pixels, ext, resize_size=None, crop_size=24)
    assert prepare_image(pixels, ext, resize_size=None, crop_size=32).shape == (1, 3, 32, 32)


def test_a_dump_of_another_size_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((40, 40, 3), 60 * i, dtype=np.uint8)).save(folder / f"{i}.png")
    ext = FeatureExtractor(timm_vit(), ["blocks.0"])
    options = {"num_workers": 0, "progress": False, "resize_size": None}
    with pytest.raises(InvalidValueError, match="takes 32x32 images only"):
        dump_features(ext, folder, tmp_path / "bad", crop_size=24, **options)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(InvalidValueError, match="prepared to 40x40"):  # no crop: the images' own size
        dump_features(ext, folder, tmp_path / "bad", crop_size=None, **options)
    dump_features(ext, folder, tmp_path / "good", crop_size=32, **options)
    assert np.load(tmp_path / "good" / "blocks.0.npy").shape[:2] == (2, 17)  # 16 patch tokens and the class token


def test_the_command_line_says_it_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((40, 40, 3), dtype=np.uint8)).save(image)
    model = ["--backbone", "timm/vit_tiny_patch16_224", "--weights", "none", "--layers", "blocks.0"]
    assert main(["show", str(image), *model, "--resize", "64", "--crop", "64", "--out", str(tmp_path / "a.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "featurehooks: error: timm/vit_tiny_patch16_224 takes 224x224 images only (its patch embedding is fixed), and "
        "these are prepared to 64x64: pass crop_size=224 (--crop 224), or leave the resize and crop to the weights"
    ]
