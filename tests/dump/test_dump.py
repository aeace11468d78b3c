"""dump_features: rows equal direct FeatureExtractor outputs; manifest, index, sources, overwrite rules."""

from __future__ import annotations

import importlib.metadata
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision.models import ResNet18_Weights
from torchvision.transforms.functional import pil_to_tensor

import featurehooks
from featurehooks import FeatureExtractor
from featurehooks.dump import dump_features, list_images, read_manifest
from featurehooks.images import read_image, transform_for

CROP = 32
RESIZE = 36


def make_images(folder: Path, count: int, *, seed: int = 0) -> list[Path]:
    """``count`` small RGB PNGs of varying sizes (so the resize and crop matter), some in a subfolder."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        sub = folder / ("nested" if i % 3 == 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        height, width = 40 + (i % 4) * 6, 48 - (i % 3) * 4
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        path = sub / f"img_{i:03d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def resnet(resnet18_cached: Path) -> FeatureExtractor:
    """The real path: torchvision resnet18 with (seeded) pretrained weights from the hub cache."""
    return FeatureExtractor("resnet18", ["layer1", "layer3"], weights="DEFAULT")


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 8, 3, stride=2), relu1=nn.ReLU(), conv2=nn.Conv2d(8, 16, 3, stride=2), relu2=nn.ReLU()
        )
    )


@pytest.fixture(scope="module")
def extractor() -> FeatureExtractor:
    """A tiny conv net (fast on a busy CPU) for the logic of the dump; layers named like resnet's."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    return FeatureExtractor(tiny_net(), {"relu1": "layer1", "conv2": "layer3"}, mean=mean, std=std)


def expected(ext: FeatureExtractor, paths: list[str], pool: str | None = None) -> dict[str, np.ndarray]:
    transform = transform_for(ext.preprocessing, ext.input_range, RESIZE, CROP)
    batch = torch.stack([transform(read_image(p)) for p in paths])
    with torch.no_grad():
        feats = ext(batch)
    if pool == "avg":
        feats = {k: v.mean(dim=(2, 3)) for k, v in feats.items()}
    elif pool == "max":
        feats = {k: v.amax(dim=(2, 3)) for k, v in feats.items()}
    return {k: v.numpy() for k, v in feats.items()}


def dump(ext: FeatureExtractor, source: object, out: Path, **kwargs: object):
    options = {"batch_size": 4, "num_workers": 0, "progress": False, "resize_size": RESIZE, "crop_size": CROP}
    options.update(kwargs)
    return dump_features(ext, source, out, **options)


def test_rows_equal_direct_outputs_of_a_pretrained_backbone(resnet: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 5)
    result = dump(resnet, tmp_path / "imgs", tmp_path / "out", batch_size=3)
    reference = expected(resnet, list_images(tmp_path / "imgs"))
    for layer in ["layer1", "layer3"]:
        np.testing.assert_allclose(result.load(layer), reference[layer], rtol=1e-5, atol=1e-6)
    assert result.manifest.settings.backbone == "resnet18"
    assert result.manifest.settings.weights == resnet.weights == "ResNet18_Weights.IMAGENET1K_V1"


@pytest.mark.parametrize("pool", [None, "avg", "max"])
def test_rows_equal_direct_extractor_outputs(extractor: FeatureExtractor, tmp_path: Path, pool: str | None) -> None:
    make_images(tmp_path / "imgs", 7)
    result = dump(extractor, tmp_path / "imgs", tmp_path / "out", pool=pool)
    names = list_images(tmp_path / "imgs")
    reference = expected(extractor, names, pool)
    for layer in ["layer1", "layer3"]:
        stored = np.load(tmp_path / "out" / f"{layer}.npy")
        assert stored.dtype == np.float32
        assert stored.shape == reference[layer].shape
        np.testing.assert_allclose(stored, reference[layer], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result.load(layer), stored)
    assert result.num_rows == 7 and result.skipped == []


def test_manifest_and_index_describe_the_dump(extractor: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 5)
    dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg", dtype="float16")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["backbone"] == "Sequential" and manifest["weights"] is None
    assert manifest["layers"] == ["layer1", "layer3"]
    assert manifest["shapes"] == {"layer1": [5, 8], "layer3": [5, 16]}
    assert manifest["dtype"] == "float16" and manifest["pool"] == "avg"
    pre = manifest["preprocessing"]
    assert pre["resize_size"] == RESIZE and pre["crop_size"] == CROP and pre["input_range"] == [0.0, 1.0]
    assert pre["mean"] == pytest.approx(list(extractor.preprocessing.mean))
    assert set(manifest["versions"]) >= {"featurehooks", "torch", "torchvision", "numpy", "pillow", "python"}
    # the installed distribution's version (pyproject.toml reads featurehooks/_version.py) is the package's
    installed = importlib.metadata.version("featurehooks")
    assert manifest["versions"]["featurehooks"] == featurehooks.__version__ == installed
    assert manifest["num_rows"] == manifest["num_valid"] == 5 and manifest["skipped"] == []
    assert np.load(tmp_path / "out" / "layer3.npy").dtype == np.float16
    lines = (tmp_path / "out" / "index.csv").read_text().splitlines()
    assert lines[0] == "row,valid,path"
    assert [line.split(",", 2)[2] for line in lines[1:]] == list_images(tmp_path / "imgs")
    assert not (tmp_path / "out" / ".journal").exists()
    assert read_manifest(tmp_path / "out").to_dict() == manifest  # the typed manifest gives back the JSON


def test_default_preprocessing_follows_the_weights_own_transforms(resnet: FeatureExtractor, tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i, size in enumerate([(300, 260), (240, 320)]):
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{i}.png")
    result = dump_features(resnet, folder, tmp_path / "out", num_workers=0, progress=False)
    pre = result.manifest.settings.preprocessing
    assert (pre["resize_size"], pre["crop_size"], pre["image_shape"]) == (256, 224, [3, 224, 224])
    transform = transform_for(resnet.preprocessing, resnet.input_range)
    ours = torch.stack([transform(read_image(p)) for p in list_images(folder)])
    with torch.no_grad():
        np.testing.assert_allclose(result.load("layer3"), resnet(ours)["layer3"].numpy(), rtol=1e-5, atol=1e-6)
    weights = ResNet18_Weights.DEFAULT.transforms()  # resize 256, crop 224, scale, normalize
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (weights.mean, weights.std))
    theirs = torch.stack([weights(pil_to_tensor(Image.open(p).convert("RGB"))) for p in list_images(folder)])
    # the same steps on uint8; torchvision's v1 resize may round a pixel to the neighbouring level
    assert (ours - (theirs * std + mean)).abs().max() <= 1 / 255 + 1e-5


def test_sources_folder_glob_and_list_agree(extractor: FeatureExtractor, tmp_path: Path) -> None:
    paths = make_images(tmp_path / "imgs", 6)
    (tmp_path / "imgs" / "notes.txt").write_text("not an image")  # ignored in folders: not an image suffix
    by_folder = dump(extractor, tmp_path / "imgs", tmp_path / "a", pool="avg")
    by_glob = dump(extractor, str(tmp_path / "imgs" / "**" / "*.png"), tmp_path / "b", pool="avg")
    by_list = dump(extractor, sorted(str(p) for p in paths), tmp_path / "c", pool="avg")
    assert by_folder.num_rows == by_glob.num_rows == by_list.num_rows == 6
    for other in ("b", "c"):
        assert (tmp_path / "a" / "layer3.npy").read_bytes() == (tmp_path / other / "layer3.npy").read_bytes()


def test_dataset_source_of_prepared_tensors(extractor: FeatureExtractor, tmp_path: Path) -> None:
    images = torch.rand(6, 3, CROP, CROP, generator=torch.Generator().manual_seed(3))
    dataset = torch.utils.data.TensorDataset(images, torch.arange(6))  # (image, label) items
    result = dump(extractor, dataset, tmp_path / "out", batch_size=4)
    with torch.no_grad():
        reference = extractor(images)
    np.testing.assert_allclose(result.load("layer3"), reference["layer3"].numpy(), rtol=1e-5, atol=1e-6)
    assert result.manifest.settings.inputs.kind == "dataset"
    assert (tmp_path / "out" / "index.csv").read_text().splitlines()[1] == "0,1,dataset[0]"


def test_decoding_workers_do_not_change_the_bytes(extractor: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 9)
    dump(extractor, tmp_path / "imgs", tmp_path / "a", num_workers=0, batch_size=4)
    dump(extractor, tmp_path / "imgs", tmp_path / "b", num_workers=2, batch_size=4)
    for name in ("layer1.npy", "layer3.npy", "index.csv", "manifest.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_complete_output_is_not_overwritten_without_overwrite(extractor: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 3)
    dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg")
    before = (tmp_path / "out" / "layer3.npy").read_bytes()
    with pytest.raises(FileExistsError, match="complete dump.*overwrite"):
        dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg")
    assert (tmp_path / "out" / "layer3.npy").read_bytes() == before
    # resume on a complete dump with the same settings is a no-op
    again = dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg", resume=True)
    assert again.manifest.status == "complete"
    # overwrite replaces it, here with different settings; files of the old layers are removed
    other = FeatureExtractor(tiny_net(), {"relu2": "layer2"})
    replaced = dump(other, tmp_path / "imgs", tmp_path / "out", overwrite=True)
    assert replaced.manifest.settings.layers == ("layer2",)
    assert not (tmp_path / "out" / "layer3.npy").exists()


def test_resume_refuses_different_settings(extractor: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 3)
    dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg")
    with pytest.raises(ValueError, match="pool differ"):
        dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="max", resume=True)
    make_images(tmp_path / "imgs", 4, seed=1)  # one more input
    with pytest.raises(ValueError, match="inputs"):
        dump(extractor, tmp_path / "imgs", tmp_path / "out", pool="avg", resume=True)


def test_stray_outputs_without_manifest_are_protected(extractor: FeatureExtractor, tmp_path: Path) -> None:
    make_images(tmp_path / "imgs", 2)
    (tmp_path / "out").mkdir()
    np.save(tmp_path / "out" / "layer3.npy", np.zeros(3))
    with pytest.raises(FileExistsError, match="layer3.npy"):
        dump(extractor, tmp_path / "imgs", tmp_path / "out")
    assert dump(extractor, tmp_path / "imgs", tmp_path / "out", overwrite=True).num_rows == 2


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pool": "mean"}, "pool"),
        ({"dtype": "int8"}, "dtype"),
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"resume": True, "overwrite": True}, "not both"),
        ({"crop_size": 0}, "crop_size"),
    ],
)
def test_bad_options_are_value_errors(extractor: FeatureExtractor, tmp_path: Path, options: dict, message: str) -> None:
    make_images(tmp_path / "imgs", 1)
    with pytest.raises(ValueError, match=message):
        dump(extractor, tmp_path / "imgs", tmp_path / "out", **options)


def test_missing_inputs_are_file_not_found(extractor: FeatureExtractor, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        dump(extractor, tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        dump(extractor, tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no files match"):
        dump(extractor, str(tmp_path / "*.jpg"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_crop_only_feature_maps_need_one_size(extractor: FeatureExtractor, tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, size in enumerate([(40, 40), (40, 40), (50, 40)]):
        Image.new("RGB", size, (i * 40, 0, 0)).save(folder / f"{i}.png")
    result = dump(extractor, folder, tmp_path / "out", resize_size=None, crop_size=None, pool="avg")
    assert result.manifest.settings.preprocessing["image_shape"] == [3, 40, 40]  # the first image probes the shapes
    assert result.skipped == []  # pooled features need no common size: every image is computed
    with pytest.raises(ValueError, match="different sizes"):
        dump(extractor, folder, tmp_path / "maps", resize_size=None, crop_size=None)


def test_paths_with_glob_characters_are_taken_literally(extractor: FeatureExtractor, tmp_path: Path) -> None:
    folder = tmp_path / "shots [2024]"  # an existing folder or file is never a pattern
    folder.mkdir()
    for name in ("a [1].png", "b.png"):
        Image.new("RGB", (40, 40), (200, 10, 10)).save(folder / name)
    assert [Path(p).name for p in list_images(folder)] == ["a [1].png", "b.png"]
    assert list_images([folder / "a [1].png"]) == [str(folder / "a [1].png")]
    result = dump(extractor, list_images(folder), tmp_path / "out", pool="avg")  # what the CLI passes
    assert result.num_rows == 2 and result.skipped == []


def test_uint8_dataset_is_scaled_like_image_files(tmp_path: Path) -> None:
    pixels = torch.randint(0, 256, (3, 3, CROP, CROP), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    ext = FeatureExtractor(tiny_net(), ["relu2"], input_range=(-1.0, 1.0))
    as_uint8 = dump(ext, torch.utils.data.TensorDataset(pixels), tmp_path / "u8", pool="avg")
    as_float = dump(ext, pixels.float() / 255 * 2 - 1, tmp_path / "f32", pool="avg")
    np.testing.assert_allclose(as_uint8.load("relu2"), as_float.load("relu2"), rtol=1e-5, atol=1e-6)


def test_out_of_range_dataset_still_warns(tmp_path: Path) -> None:
    ext = FeatureExtractor(tiny_net(), ["relu2"])  # input_range (0, 1); the shape probe must not use up the check
    with pytest.warns(UserWarning, match="input_range"):
        dump(ext, torch.rand(2, 3, CROP, CROP) * 255, tmp_path / "out", pool="avg")


def test_resume_refuses_other_weights_of_the_same_module(tmp_path: Path) -> None:
    items = torch.rand(3, 3, CROP, CROP, generator=torch.Generator().manual_seed(4))
    first = dump(FeatureExtractor(tiny_net(), ["relu2"]), items, tmp_path / "out", pool="avg")
    sha256 = first.manifest.settings.weights_sha256
    assert isinstance(sha256, str) and len(sha256) == 64
    retrained = tiny_net()
    with torch.no_grad():
        retrained.conv2.weight.add_(0.01)  # another checkpoint: same class, same weights=None
    with pytest.raises(ValueError, match="weights_sha256 differ"):
        dump(FeatureExtractor(retrained, ["relu2"]), items, tmp_path / "out", pool="avg", resume=True)
    # a dump written before the digest existed is still compared on the rest
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    del manifest["weights_sha256"]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert dump(FeatureExtractor(tiny_net(), ["relu2"]), items, tmp_path / "out", pool="avg", resume=True).num_rows == 3


def test_layers_that_would_share_a_file_are_refused(tmp_path: Path) -> None:
    ext = FeatureExtractor(tiny_net(), {"relu1": "a/b", "relu2": "a_b"})
    with pytest.raises(ValueError, match="'a/b' and 'a_b' would both be written to a_b.npy"):
        dump(ext, torch.rand(2, 3, CROP, CROP), tmp_path / "out", pool="avg")
    assert not (tmp_path / "out").exists()


def test_reduced_precision_extractor_gets_images_in_its_dtype(tmp_path: Path) -> None:
    ext = FeatureExtractor(tiny_net(), ["relu2"]).to(torch.bfloat16)
    images = torch.rand(3, 3, CROP, CROP, generator=torch.Generator().manual_seed(6))
    result = dump(ext, images, tmp_path / "out", pool="avg")
    with torch.no_grad():
        reference = ext(images.to(torch.bfloat16))["relu2"].mean(dim=(2, 3)).float().numpy()
    np.testing.assert_array_equal(result.load("relu2"), reference)
