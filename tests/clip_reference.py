"""A tiny seeded CLIP cached as ``openai/clip-vit-large-patch14-336`` is, and cmmd-pytorch's pixels: the references
of ``tests/backbones/test_clip.py``, ``tests/metrics/test_cmmd.py`` and ``tests/metrics/test_evaluation.py``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

REPO = "openai/clip-vit-large-patch14-336"
# A tiny tower at CMMD's resolution (336): 7x7 patches of 48, so the reference's pixels are made at the real size.
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 48,
    "image_size": 336,
    "projection_dim": 16,
}
TINY_TEXT = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}


def write_clip_cache(root: Path, seed: int = 0) -> Path:
    """A seeded tiny ``CLIPModel`` (text tower included, plus the ``position_ids`` older checkpoints hold) laid out
    as huggingface_hub caches ``config.json`` and ``model.safetensors`` of ``REPO``; returns the snapshot folder."""
    config = transformers.CLIPConfig(text_config=TINY_TEXT, vision_config=TINY_VISION, projection_dim=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = transformers.CLIPModel(config).state_dict()
    state["vision_model.embeddings.position_ids"] = torch.arange(50)[None]
    commit = "0" * 40
    folder = root / f"models--{REPO.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    config.to_json_file(str(snapshot / "config.json"))
    save_file({key: value.contiguous() for key, value in state.items()}, str(snapshot / "model.safetensors"))
    return snapshot


@contextmanager
def cached_clip(root: Path) -> Iterator[Path]:
    """Within the block: the tiny tower cached as ``REPO`` under ``root`` and the Hugging Face cache pointed there;
    yields the snapshot folder."""
    from huggingface_hub import constants

    snapshot = write_clip_cache(root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_CACHE", str(root))
        yield snapshot


def reference_pixels(images: list[np.ndarray], size: int) -> torch.Tensor:
    """cmmd-pytorch's pixels: center-crop the largest square, Pillow bicubic to ``size`` (io_util), float32 / 255,
    torch bicubic to ``size`` (embedding), then ``CLIPImageProcessor`` normalizing only."""
    batch = []
    for array in images:
        image = Image.fromarray(array)
        width, height = image.size
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        image = image.crop((left, top, left + side, top + side)).resize((size, size), resample=Image.BICUBIC)
        pixels = np.asarray(image).astype(np.float32)
        batch.append(np.tile(pixels[..., None], (1, 1, 3)) if pixels.ndim == 2 else pixels)
    floats = torch.from_numpy(np.stack(batch) / np.float32(255.0)).permute(0, 3, 1, 2)
    resized = torch.nn.functional.interpolate(floats, size=(size, size), mode="bicubic").permute(0, 2, 3, 1)
    processor = transformers.CLIPImageProcessor(crop_size={"height": size, "width": size})
    only_normalize = {"do_normalize": True, "do_center_crop": False, "do_resize": False, "do_rescale": False}
    return processor(images=resized.numpy(), return_tensors="pt", **only_normalize)["pixel_values"]


def square_photos() -> list[np.ndarray]:
    """Square uint8 photos (a downscale, grayscale, an upscale), where CLIP's resize and crop equal CMMD's."""
    data = pytest.importorskip("skimage.data")
    return [data.astronaut(), data.camera(), data.coffee()[100:300, 200:400]]
