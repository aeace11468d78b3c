"""CLIP image towers: the embedding equals transformers' ``image_embeds`` on the same weights and on cmmd-pytorch's
pixels, weights from a Hugging Face cache layout or a local file, clear errors offline or without transformers."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import featurehooks as fh
from featurehooks.backbones import clip

transformers = pytest.importorskip("transformers")
from clip_reference import REPO, cached_clip, reference_pixels, square_photos  # noqa: E402


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with cached_clip(tmp_path_factory.mktemp("hf_hub")) as snapshot:
        yield snapshot


def test_embedding_equals_transformers_on_cmmd_pixels(snapshot: Path) -> None:
    reference = transformers.CLIPVisionModelWithProjection.from_pretrained(str(snapshot)).eval()
    photos = square_photos()
    with torch.no_grad():
        expected = reference(reference_pixels(photos, 336)).image_embeds
    ext = fh.FeatureExtractor("clip_vit_l14_336", [clip.EMBEDDING_LAYER])
    as_rgb = [torch.from_numpy(np.dstack([p] * 3) if p.ndim == 2 else p).permute(2, 0, 1) for p in photos]
    found = torch.cat([ext(fh.prepare_image(image, ext))[clip.EMBEDDING_LAYER] for image in as_rgb])
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)
    assert ext.weights == f"hf:{REPO}" and found.shape == (3, 16)


def test_loads_the_tower_of_a_clip_checkpoint(snapshot: Path) -> None:
    backbone = clip.load("clip_vit_l14_336")
    reference = transformers.CLIPVisionModelWithProjection.from_pretrained(str(snapshot))
    ours, theirs = backbone.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert backbone.preprocessing == fh.Preprocessing(clip.CLIP_MEAN, clip.CLIP_STD, 336, 336, "bicubic")
    assert backbone.name == "clip_vit_l14_336" and backbone.in_channels == 3
    x = torch.randn(2, 3, 336, 336)
    with torch.no_grad():
        assert torch.equal(backbone.model(x), reference.eval()(x).image_embeds)


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_loads_a_local_file(snapshot: Path, tmp_path: Path, suffix: str) -> None:
    reference = transformers.CLIPVisionModelWithProjection.from_pretrained(str(snapshot))
    path = tmp_path / f"tower{suffix}"
    state = {key: value.clone() for key, value in reference.state_dict().items()}
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    backbone = clip.load("clip_vit_l14_336", weights=path)
    assert backbone.weights == str(path)
    assert torch.equal(backbone.model.visual_projection.weight, state["visual_projection.weight"])


def test_architecture_is_the_loaded_model_on_the_meta_device(snapshot: Path) -> None:
    meta = clip.architecture("clip_vit_l14_336")
    loaded = clip.load("clip_vit_l14_336")
    assert all(p.is_meta for p in meta.model.parameters())
    shapes = {key: value.shape for key, value in loaded.model.state_dict().items()}
    assert {key: value.shape for key, value in meta.model.state_dict().items()} == shapes
    assert (meta.weights, meta.preprocessing) == (loaded.weights, loaded.preprocessing)


def test_real_towers_without_a_cached_config_have_openais_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing cached, the architecture is the values written in the module: the parameter counts of OpenAI's
    image towers (ViT-L/14@336: 304M) and their embedding widths."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    backbone = clip.architecture("clip_vit_l14_336")
    assert sum(p.numel() for p in backbone.model.parameters()) == 304_293_888
    assert backbone.model.visual_projection.out_features == 768 and backbone.preprocessing.crop_size == 336
    openai = {"clip_vit_b32": (87_849_216, 512), "clip_vit_b16": (86_192_640, 512), "clip_vit_l14": (303_966_208, 768)}
    for name, (params, dim) in openai.items():
        tower = clip.architecture(name).model
        assert (sum(p.numel() for p in tower.parameters()), tower.visual_projection.out_features) == (params, dim)
        assert clip.architecture(name).preprocessing.resize_size == 224


def test_layers_of_the_tower_are_tappable(snapshot: Path) -> None:
    ext = fh.FeatureExtractor("clip_vit_l14_336", ["vision_model.encoder.layers.1", clip.EMBEDDING_LAYER])
    found = ext(torch.rand(2, 3, 336, 336))
    assert found["vision_model.encoder.layers.1"].shape == (2, 50, 32) and found[clip.EMBEDDING_LAYER].shape == (2, 16)


@pytest.mark.slow
def test_vit_l14_336_equals_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ViT-L/14@336 architecture (random weights copied into transformers' model) at its resolution."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached: the module's config values
    torch.manual_seed(0)
    backbone = clip.load("clip_vit_l14_336", weights=None)
    config = transformers.CLIPVisionConfig(**clip.CLIP_TOWERS["clip_vit_l14_336"].config_values())
    reference = transformers.CLIPVisionModelWithProjection(config).eval()
    reference.load_state_dict(backbone.model.state_dict())
    pixels = reference_pixels(square_photos()[:1], 336)
    with torch.no_grad():
        torch.testing.assert_close(backbone.model(pixels), reference(pixels).image_embeds, rtol=1e-5, atol=1e-6)


# -- errors ---------------------------------------------------------------------------------------------------
def test_uncached_weights_say_where_they_were_looked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(fh.WeightsUnavailableError) as info:
        clip.load("clip_vit_b32")
    message = str(info.value)
    where = ("openai/clip-vit-base-patch32", "model.safetensors", str(tmp_path / "empty"), "from_pretrained")
    for part in (*where, "weights=None"):
        assert part in message


def test_bad_weights_are_refused_clearly(snapshot: Path, tmp_path: Path) -> None:
    with pytest.raises(fh.WeightsUnavailableError, match="not found"):
        clip.load("clip_vit_l14_336", weights=tmp_path / "missing.safetensors")
    text_only = tmp_path / "text.safetensors"
    save_file({"text_projection.weight": torch.zeros(4, 4)}, str(text_only))
    with pytest.raises(fh.WeightsUnavailableError, match="holds no CLIP image tower"):
        clip.load("clip_vit_l14_336", weights=text_only)
    wrong = tmp_path / "b32.safetensors"
    save_file({"vision_model.post_layernorm.weight": torch.zeros(7)}, str(wrong))
    with pytest.raises(fh.WeightsUnavailableError, match="do not fit"):
        clip.load("clip_vit_l14_336", weights=wrong)
    with pytest.raises(fh.WeightsUnavailableError, match="'DEFAULT'"):
        clip.load("clip_vit_l14_336", weights="IMAGENET1K_V1")


def test_unknown_tower_names_the_closest() -> None:
    with pytest.raises(fh.BackboneNotFoundError, match="clip_vit_l14_336"):
        clip.load("clip_vit_l14_338")


def test_missing_transformers_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets where it is absent
    for build in (clip.load, clip.architecture):
        with pytest.raises(fh.MissingDependencyError, match="pip install transformers"):
            build("clip_vit_l14_336")
