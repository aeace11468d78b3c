"""DINOv2 backbones: features equal DINOv2's own forward (written here from its definitions) on dgm-eval's inputs.

The oracle is facebookresearch/dinov2's ``DinoVisionTransformer`` as its hub entries build it (patch embedding,
class token, ``interpolate_pos_encoding`` with ``interpolate_offset=0.1`` and no antialiasing, blocks with
LayerScale, the final LayerNorm, ``x_norm_clstoken``), fed images prepared by dgm-eval's ``DINOv2Encoder.transform``
(``Resize((224, 224), BICUBIC)`` on the PIL image, ``ToTensor``, ImageNet ``Normalize``), on the same seeded
weights written in the hub release's key layout where ``torch.hub`` caches them.
"""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest
import timm
import torch
import torchvision.transforms as TF
from PIL import Image
from safetensors.torch import save_file
from torch import Tensor

import featurehooks as fh
from featurehooks.backbones import dinov2
from featurehooks.backbones._meta import meta_parameters
from featurehooks.backbones.timm_models import model_facts

from dinov2_reference import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    dgm_eval_transform,
    dinov2_oracle,
    hub_state,
    interpolate_pos_encoding,
    relative_error,
    write_photos,
)


# -- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vits14(dinov2_vits14_cached: dict[str, Tensor]) -> dict[str, Tensor]:
    return dinov2_vits14_cached


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def oracle_features(vits14: dict[str, Tensor], photos: list[Path]) -> Tensor:
    with torch.no_grad():
        return dinov2_oracle(vits14, torch.stack([dgm_eval_transform(path) for path in photos]), heads=6)


# -- (a) the features ----------------------------------------------------------------------------------------
def test_features_equal_dinov2_on_dgm_eval_inputs(oracle_features: Tensor, photos: list[Path]) -> None:
    extractor = fh.FeatureExtractor("dinov2_vits14", [dinov2.DINOV2_LAYER])
    batch = torch.cat([fh.prepare_image(path, extractor) for path in photos])
    for path, prepared in zip(photos, batch):  # Pillow's bicubic 224x224, as dgm-eval's Resize: the same pixels
        pixels = TF.Compose([TF.Resize((224, 224), TF.InterpolationMode.BICUBIC), TF.ToTensor()])(Image.open(path))
        assert torch.equal(prepared, pixels)
    features = extractor(batch)[dinov2.DINOV2_LAYER][:, 0]  # the class token of the final norm
    assert features.shape == (3, 384)
    assert relative_error(features, oracle_features) < 1e-5


def test_pos_embed_is_dinov2s_interpolation_not_timms(
    vits14: dict[str, Tensor], oracle_features: Tensor, photos: list[Path]
) -> None:
    """timm's resampling of the same tensors (a target size, antialiased) gives other features: this test would
    see the difference. The measured gap is printed for the docs (``pytest -s``)."""
    backbone = dinov2.load("dinov2_vits14")
    expected = interpolate_pos_encoding(vits14["pos_embed"], torch.zeros(1, 257, 384), 224, 224, 14)
    assert torch.equal(backbone.model.state_dict()["pos_embed"], expected)
    resampled = timm.create_model("vit_small_patch14_dinov2", img_size=518, dynamic_img_size=True).eval()
    resampled.load_state_dict(dinov2.hub_to_timm(vits14))
    batch = torch.stack([dgm_eval_transform(path) for path in photos])
    with torch.no_grad():
        timm_features = resampled(batch)
    gap = relative_error(timm_features, oracle_features)
    print(f"timm's resampling vs DINOv2's interpolation: {gap:.2e} of the feature scale")
    assert gap > 1e-3


# -- (b) the weights -----------------------------------------------------------------------------------------
def test_every_hub_tensor_arrives_unchanged(vits14: dict[str, Tensor], tmp_path: Path) -> None:
    """At the trained size (518: no interpolation) the model holds every tensor of the release bitwise, under
    timm's names (here the same); only ``mask_token``, used in masked training alone, is left out."""
    backbone = dinov2.load("dinov2_vits14", image_size=518)
    held = backbone.model.state_dict()
    assert set(held) == set(vits14) - {"mask_token"}
    assert all(torch.equal(held[key], vits14[key]) for key in held)
    # the same keys timm's own checkpoint filter gives for a release file
    with meta_parameters():
        model = timm.models.vision_transformer.vit_small_patch14_dinov2(img_size=518)
    filtered = timm.models.vision_transformer.checkpoint_filter_fn(dict(vits14), model)
    assert set(filtered) == set(dinov2.hub_to_timm(vits14))
    # a file in timm's layout (e.g. timm's safetensors) loads the same tensors
    path = tmp_path / "timm_layout.safetensors"
    save_file({key: value.contiguous() for key, value in held.items()}, str(path))
    again = dinov2.load("dinov2_vits14", weights=path, image_size=518).model.state_dict()
    assert all(torch.equal(again[key], held[key]) for key in held)


def test_giant_swiglu_keys_map_onto_timms_architecture() -> None:
    """ViT-g/14's SwiGLU (``mlp.w12``, ``mlp.w3``) lands on timm's packed GLU (``mlp.fc1``, ``mlp.fc2``): every
    tensor finds a parameter of its shape (checked on the meta device, nothing computed)."""
    with meta_parameters():
        model = timm.create_model("vit_giant_patch14_dinov2", img_size=518)
    expected = {key: value.shape for key, value in model.state_dict().items()}
    release = {
        key.replace("mlp.fc1.", "mlp.w12.").replace("mlp.fc2.", "mlp.w3."): torch.empty(shape, device="meta")
        for key, shape in expected.items()
    }
    release["mask_token"] = torch.empty(1, 1536, device="meta")
    converted = dinov2.hub_to_timm(release)
    assert {key: value.shape for key, value in converted.items()} == expected
    assert any(".mlp.w12." in key for key in release)


# -- the backbone --------------------------------------------------------------------------------------------
def test_preprocessing_architecture_and_instance_agree(vits14: dict[str, Tensor]) -> None:
    loaded = dinov2.load("dinov2_vits14")
    assert loaded.preprocessing == fh.Preprocessing(
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        resize_size=224,
        crop_size=224,
        interpolation="bicubic",
        crop_mode="squash",
    )
    assert (loaded.name, loaded.weights, loaded.in_channels) == ("dinov2_vits14", "dinov2_vits14_pretrain", 3)
    assert model_facts(loaded.model) == (loaded.preprocessing, 3)  # the same as a timm instance given to an extractor
    meta = dinov2.architecture("dinov2_vits14")
    assert (meta.preprocessing, meta.weights) == (loaded.preprocessing, loaded.weights)
    assert {k: v.shape for k, v in meta.model.state_dict().items()} == {
        k: v.shape for k, v in loaded.model.state_dict().items()
    }
    assert dinov2.load("dinov2_vits14", weights=None).weights is None


def test_bad_names_sizes_and_weights() -> None:
    with pytest.raises(fh.BackboneNotFoundError, match="dinov2_vitl14"):
        dinov2.load("dinov2_vitl16")
    with pytest.raises(fh.errors.InvalidValueError, match="multiple of 14"):
        dinov2.load("dinov2_vits14", weights=None, image_size=256)
    with pytest.raises(fh.WeightsUnavailableError, match="'DEFAULT'"):
        dinov2.load("dinov2_vits14", weights="LVD142M")


# -- (d) offline ---------------------------------------------------------------------------------------------
def test_missing_weights_name_the_file_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, dst: str, *args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(fh.WeightsUnavailableError) as info:
        dinov2.load("dinov2_vitl14")
    message = str(info.value)
    assert "dinov2_vitl14_pretrain.pth" in message
    assert str(tmp_path / "empty" / "hub" / "checkpoints") in message
    assert dinov2.weights_url("dinov2_vitl14") in message and "weights=None" in message


# -- the real configuration ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_vitl14_equals_dinov2(torch_home: Path, photos: list[Path]) -> None:
    """ViT-L/14, FD_DINOv2's backbone, at its real configuration (24 blocks, 16 heads, 1024 wide)."""
    state = hub_state("dinov2_vitl14", seed=1, dtype=torch.float16)  # half the file; the model holds float32
    path = Path(dinov2.weights_path("dinov2_vitl14"))
    path.parent.mkdir(parents=True, exist_ok=True)  # the first test of its worker to write there
    torch.save(state, path)
    try:
        extractor = fh.FeatureExtractor("dinov2_vitl14", [dinov2.DINOV2_LAYER])
        features = extractor(torch.cat([fh.prepare_image(p, extractor) for p in photos[:2]]))["norm"][:, 0]
        with torch.no_grad():
            expected = dinov2_oracle(state, torch.stack([dgm_eval_transform(p) for p in photos[:2]]), heads=16)
    finally:
        path.unlink()
    assert features.shape == (2, 1024)
    assert relative_error(features, expected) < 1e-5
