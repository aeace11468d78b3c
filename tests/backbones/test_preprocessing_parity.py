"""Parity of preprocessing: prepared pixels and normalization equal timm's eval transform and torchvision's
``weights.transforms()``, for names and model instances alike; other modules get none, and say so."""

from __future__ import annotations

import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.models as tvm
from PIL import Image
from torch import nn
from torchvision.transforms import Compose, Normalize

from featurehooks import FeatureExtractor, Preprocessing, prepare_image, read_image
from featurehooks.backbones import build_architecture, load_backbone
from featurehooks.backbones.torchvision_models import preprocessing_of
from featurehooks.dump import dump_features
from featurehooks.errors import InvalidValueError
from featurehooks.images import transform_for

from helpers import slow_unless

timm = pytest.importorskip("timm")
skdata = pytest.importorskip("skimage.data")

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
# torchvision weights whose normalization is not ImageNet's: an instance of their class cannot be told apart
ODD_NORMALIZATION = {"EfficientNet_V2_L_Weights.IMAGENET1K_V1", "VGG16_Weights.IMAGENET1K_FEATURES"}
TIMM_NAMES = [
    "convnext_tiny",  # crop_pct 0.95: resize floor(235.8) = 235, where rounding gave 236
    "vit_small_patch16_224",  # bicubic, crop_pct 0.9, mean 0.5
    "resnet50",
    "efficientnet_b0",  # crop_pct 0.875
    "resnet18.tv_in1k",  # bilinear
    "deit3_small_patch16_224.fb_in22k_ft_in1k",  # crop_pct 1.0
    "volo_d4_448.sail_in1k",  # crop_pct 1.15: resized to 389, then the 448 crop pads with black
    "dm_nfnet_f0.dm_in1k",  # squash, crop_pct 0.9
    "convnext_tiny.fb_in22k_ft_in1k_384",  # squash, crop_pct 1.0
    "vit_base_patch16_sapiens2.fb",  # non-square (1024, 768), squash
    "deepseek_vit_412m.deepseek_v4_flash_vision_exp",  # border: fit inside, pad with the mean
]
# configs no pretrained tag has: a non-square input in each crop mode, with a crop_pct below 1
OVERLAYS = [
    {"input_size": (3, 256, 192), "crop_pct": 0.9, "crop_mode": "center"},
    {"input_size": (3, 160, 224), "crop_pct": 0.875, "crop_mode": "squash", "interpolation": "bilinear"},
    {"input_size": (3, 256, 192), "crop_pct": 0.9, "crop_mode": "border", "mean": (0.2, 0.5, 0.9)},
    {"input_size": (3, 96, 96), "crop_pct": 1.0, "crop_mode": "border", "interpolation": "lanczos"},
]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Real photos as PNG and JPEG: square, wide, tall, odd sizes, a thin strip, one smaller than any crop, gray."""
    folder = tmp_path_factory.mktemp("parity_photos")
    pictures = {
        "astronaut.png": skdata.astronaut(),  # 512 x 512
        "chelsea.jpg": skdata.chelsea(),  # 300 x 451
        "coffee_tall.png": skdata.coffee()[:, 150:401],  # 400 x 251
        "rocket_odd.jpg": skdata.rocket()[13:396, 7:520],  # 383 x 513
        "astronaut_tall.jpg": skdata.astronaut()[:, 100:397],  # 512 x 297
        "rocket_strip.png": skdata.rocket()[200:261],  # 61 x 640
        "chelsea_small.png": skdata.chelsea()[::4, ::4],  # 75 x 113, upscaled by every model
        "camera_gray.jpg": skdata.camera()[:, 31:480],  # 512 x 449, grayscale
    }
    paths = []
    for name, pixels in pictures.items():
        path = folder / name
        Image.fromarray(np.ascontiguousarray(pixels)).save(path, **({"quality": 90} if name.endswith("jpg") else {}))
        paths.append(path)
    return paths


def timm_eval_pixels(model: nn.Module, preprocessing: Preprocessing) -> Compose:
    """timm's own eval transform for ``model`` without its final Normalize, checked to be ``preprocessing``'s."""
    transform = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    *steps, normalize = transform.transforms
    assert isinstance(normalize, Normalize)
    assert torch.equal(normalize.mean, torch.tensor(preprocessing.mean))
    assert torch.equal(normalize.std, torch.tensor(preprocessing.std))
    return Compose(steps)


def assert_timm_pixels(model: nn.Module, preprocessing: Preprocessing, photos: list[Path]) -> None:
    """Every photo prepared from ``preprocessing`` equals timm's eval transform of the PIL image, bit for bit."""
    reference = timm_eval_pixels(model, preprocessing)
    ours = transform_for(preprocessing, (0.0, 1.0))
    for photo in photos:
        with Image.open(photo) as image:
            theirs = reference(image.convert("RGB"))
        prepared = ours(read_image(photo))
        assert prepared.shape == theirs.shape, photo.name
        assert torch.equal(prepared, theirs), photo.name


# -- timm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TIMM_NAMES)
def test_timm_names_prepare_timms_eval_pixels(name: str, photos: list[Path]) -> None:
    built = build_architecture(f"timm/{name}")
    assert_timm_pixels(built.model, built.preprocessing, photos)


def test_timm_resize_floors_as_timm_does() -> None:
    """The issue's example: convnext_tiny resizes to 235 (224 / 0.95 = 235.8), not 236."""
    assert build_architecture("timm/convnext_tiny").preprocessing.resize_size == 235


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[f"{o['crop_mode']}-{o['input_size'][1:]}" for o in OVERLAYS])
def test_timm_instances_prepare_timms_eval_pixels(overlay: dict, photos: list[Path]) -> None:
    model = timm.create_model("test_resnet", pretrained=False, pretrained_cfg_overlay=overlay)
    backbone = load_backbone(model)
    assert backbone.in_channels == 3
    assert_timm_pixels(model, backbone.preprocessing, photos)


@pytest.mark.parametrize("name", ["convnext_tiny", "vit_small_patch16_224", "deepseek_vit_412m"])
def test_a_timm_instance_gets_what_its_name_gets(name: str) -> None:
    built = build_architecture(f"timm/{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        instance = load_backbone(built.model)
    assert instance.preprocessing == built.preprocessing
    assert instance.in_channels == built.in_channels


def test_the_extractor_on_a_timm_instance_equals_timms_own_pipeline(photos: list[Path]) -> None:
    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False).eval()
    layer = "layer2"
    ext = FeatureExtractor(model, [layer])
    reference = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    outputs: list[torch.Tensor] = []
    handle = model.get_submodule(layer).register_forward_hook(lambda module, args, out: outputs.append(out))
    try:
        for photo in photos[:3]:
            with Image.open(photo) as image, torch.no_grad():
                model(reference(image.convert("RGB"))[None])
                ours = ext(prepare_image(photo, ext))[layer]
            torch.testing.assert_close(ours, outputs[-1], rtol=0, atol=1e-6)
    finally:
        handle.remove()


# -- torchvision -----------------------------------------------------------------------------------------


def classification_weights() -> list[tvm.WeightsEnum]:
    return [member for name in tvm.list_models(module=tvm) for member in tvm.get_model_weights(name)]


def test_every_torchvision_weight_normalizes_as_imagenet_but_two() -> None:
    """Instances get a mean and std only where all weights of their class share them: these are the exceptions."""
    odd = set()
    for member in classification_weights():
        transforms = member.transforms()
        if (tuple(transforms.mean), tuple(transforms.std)) != IMAGENET:
            odd.add(str(member))
    assert odd == ODD_NORMALIZATION


def test_torchvision_pixels_equal_the_weights_transforms_of_each_kind(photos: list[Path]) -> None:
    """The largest weights of each interpolation, with and without a resize beyond the crop; pixels bit for bit."""
    kinds: dict[tuple[str, bool], tvm.WeightsEnum] = {}
    for member in sorted(classification_weights(), key=lambda m: preprocessing_of(m).crop_size or 0):
        pre = preprocessing_of(member)
        kinds[(pre.interpolation, pre.resize_size == pre.crop_size)] = member
    assert set(kinds) == {("bilinear", False), ("bilinear", True), ("bicubic", False), ("bicubic", True)}
    for member in kinds.values():
        ours = transform_for(preprocessing_of(member), (0.0, 1.0))
        reference = member.transforms(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))  # the same steps, unnormalized
        for photo in photos:
            with Image.open(photo) as image:
                theirs = reference(image.convert("RGB"))
            assert torch.equal(ours(read_image(photo)), theirs), (str(member), photo.name)


# make test-fast: names whose DEFAULT preprocessing differs (resize, crop, interpolation, mean), and a wide ResNet
# told apart from its plain sibling by its shapes alone
FAST_INSTANCES = (
    "alexnet", "efficientnet_b0", "efficientnet_v2_s", "inception_v3", "resnet50", "swin_v2_s", "vit_b_16",
    "wide_resnet50_2",
)  # fmt: skip


@pytest.mark.parametrize("name", slow_unless(sorted(tvm.list_models(module=tvm)), FAST_INSTANCES))
def test_every_torchvision_instance_gets_the_preprocessing_of_its_name(name: str) -> None:
    """An instance (on the meta device: its architecture is all that counts) prepares images as its name does."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stated = load_backbone(build_architecture(name).model).preprocessing
    assert stated == preprocessing_of(tvm.get_model_weights(name).DEFAULT)


def test_an_instance_no_builder_matches_gets_what_its_class_shares() -> None:
    with torch.device("meta"):
        resnet = tvm.resnet50(num_classes=10)  # another head: no builder's DEFAULT architecture
    with pytest.warns(UserWarning, match="ResNet instance gets no resize or crop.*pass resize_size= and crop_size="):
        pre = load_backbone(resnet).preprocessing
    assert (pre.mean, pre.std) == IMAGENET
    assert (pre.resize_size, pre.crop_size) == (None, None)  # resnet18 resizes to 256, resnet50 V2 to 232
    with torch.device("meta"):
        alexnet = tvm.alexnet(num_classes=10)
    assert load_backbone(alexnet).preprocessing == preprocessing_of(tvm.AlexNet_Weights.IMAGENET1K_V1)


@pytest.mark.slow
def test_a_vgg16_instance_runs_as_its_name(vgg16_cached: object) -> None:
    """The issue's case: torchvision.models.vgg16(weights=...) passed as an instance normalizes as "vgg16" does."""
    model = tvm.vgg16(weights="IMAGENET1K_V1")
    by_instance = FeatureExtractor(model, ["relu3_3"])
    by_name = FeatureExtractor("vgg16", ["relu3_3"])
    assert by_instance.preprocessing == by_name.preprocessing
    images = torch.rand(1, 3, 64, 64)
    assert torch.equal(by_instance(images)["relu3_3"], by_name(images)["relu3_3"])


def test_an_efficientnet_no_builder_matches_gets_no_normalization_and_a_warning() -> None:
    with torch.device("meta"):
        model = tvm.efficientnet_b0(num_classes=10)  # efficientnet_v2_l's DEFAULT uses mean 0.5: no shared mean
    with pytest.warns(UserWarning, match="EfficientNet instances get no normalization.*pass mean= and std="):
        backbone = load_backbone(model)
    assert backbone.preprocessing.mean is None and backbone.preprocessing.std is None
    with pytest.warns(UserWarning, match="EfficientNet instance gets no resize or crop") as given_warnings:
        given = load_backbone(model, mean=(0.5, 0.5, 0.5), std=(0.2, 0.2, 0.2))  # the sizes are still unknown
    assert len(given_warnings) == 1
    assert (given.preprocessing.mean, given.preprocessing.std) == ((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))


def test_given_mean_and_std_override_an_instances_own() -> None:
    model = timm.create_model("test_resnet", pretrained=False)
    backbone = load_backbone(model, mean=(0.1, 0.2, 0.3), std=(0.4, 0.5, 0.6))
    own = load_backbone(model).preprocessing
    assert backbone.preprocessing == Preprocessing(
        (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), own.resize_size, own.crop_size, own.interpolation, own.crop_mode
    )


# -- other modules ---------------------------------------------------------------------------------------


class OwnResNet(tvm.ResNet):
    """A user's subclass: its forward may differ, so torchvision's facts are not claimed for it."""


class NotTimm(nn.Module):
    """A module with a ``pretrained_cfg`` that timm did not build."""

    pretrained_cfg = {"input_size": (3, 64, 64), "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}


@pytest.mark.parametrize(
    "module",
    [
        nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 4, 3), relu1=nn.ReLU())),
        OwnResNet(tvm.resnet.BasicBlock, [1, 1, 1, 1]),
        tvm.quantization.resnet18(weights=None, quantize=False),
        NotTimm(),
        timm.models.resnet.ResNet(timm.models.resnet.BasicBlock, [1, 1, 1, 1]),  # built without create_model
    ],
    ids=["sequential", "subclass", "quantizable", "pretrained_cfg-attribute", "timm-class-without-config"],
)
def test_other_modules_get_no_preprocessing(module: nn.Module) -> None:
    backbone = load_backbone(module)
    assert backbone.preprocessing == Preprocessing()
    assert backbone.in_channels is None


def test_an_own_modules_images_keep_their_size_as_its_preprocessing_says(photos: list[Path], tmp_path: Path) -> None:
    torch.manual_seed(0)
    ext = FeatureExtractor(nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 4, 3, stride=8))), ["conv1"])
    assert (ext.preprocessing.resize_size, ext.preprocessing.crop_size, ext.preprocessing.mean) == (None, None, None)
    for photo in photos[:3]:
        pixels = read_image(photo)
        assert torch.equal(prepare_image(photo, ext)[0], pixels.float() / 255)
    with pytest.raises(InvalidValueError, match="different sizes.*crop_size="):
        dump_features(ext, photos[:2], tmp_path / "out", num_workers=0, progress=False)
    sized = dump_features(
        ext, photos[:2], tmp_path / "sized", num_workers=0, progress=False, resize_size=64, crop_size=64
    )
    assert sized.manifest.settings.preprocessing["image_shape"] == [3, 64, 64]


def test_unknown_crop_modes_are_refused() -> None:
    with pytest.raises(InvalidValueError, match="crop_mode"):
        Preprocessing(crop_mode="pad")
