"""Preparing images (featurehooks.images): range scaling, prepare_image against torchvision's own transforms."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.models import ResNet18_Weights
from torchvision.transforms.functional import pil_to_tensor

from featurehooks import FeatureExtractor, Preprocessing
from featurehooks._stream.sources import TensorRows
from featurehooks.images import from_input_range, prepare_image, read_image, to_input_range, transform_for

import helpers

SAMPLES = helpers.REPO / "examples" / "images"
RANGES = [(0.0, 1.0), (-1.0, 1.0), (0.0, 255.0)]


def tiny_extractor(**kwargs: object) -> FeatureExtractor:
    return helpers.tiny_extractor(["relu1"], channels=(4,), **kwargs)


@pytest.fixture(scope="module")
def resnet(resnet18_cached: Path) -> FeatureExtractor:
    return FeatureExtractor("resnet18", ["layer1"], weights="DEFAULT")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A bundled sample as it is (224 px PNG) and as a non-square JPEG, so the resize and crop both matter."""
    sample = SAMPLES / "sample_00_shapes.png"
    jpeg = tmp_path_factory.mktemp("photos") / "wide.jpg"
    with Image.open(sample) as image:
        image.convert("RGB").resize((300, 260), Image.Resampling.BICUBIC).save(jpeg, quality=90)
    return [sample, jpeg]


@pytest.mark.parametrize("input_range", RANGES)
def test_range_scaling_round_trips(input_range: tuple[float, float]) -> None:
    unit = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    scaled = to_input_range(unit, input_range)
    assert torch.allclose(from_input_range(scaled, input_range), unit, atol=1e-6)
    ends = to_input_range(torch.tensor([0.0, 1.0]), input_range)
    assert ends.tolist() == list(input_range)


@pytest.mark.parametrize("input_range", RANGES)
def test_uint8_pixels_scale_like_floats_in_unit_range(input_range: tuple[float, float]) -> None:
    pixels = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(to_input_range(pixels, input_range), to_input_range(pixels.float() / 255, input_range))


def test_bad_ranges_and_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="low < high"):
        to_input_range(torch.rand(3), (1.0, 1.0))
    with pytest.raises(ValueError, match="low < high"):
        from_input_range(torch.rand(3), (1.0, 0.0))
    with pytest.raises(TypeError, match="int16"):
        to_input_range(torch.zeros(3, dtype=torch.int16), (0.0, 1.0))


@pytest.mark.parametrize("input_range", RANGES)
def test_uint8_dataset_rows_equal_the_file_route_bit_for_bit(input_range: tuple[float, float]) -> None:
    pixels = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    rows = TensorRows([pixels], (3, 8, 8), input_range)  # type: ignore[arg-type]
    by_file = transform_for(Preprocessing(), input_range, None, None)(pixels)
    assert torch.equal(rows[0].image, by_file)


def test_prepare_image_equals_the_weights_own_transforms(resnet: FeatureExtractor, photos: list[Path]) -> None:
    weights = ResNet18_Weights.DEFAULT.transforms()  # resize 256, crop 224, scale, normalize
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (weights.mean, weights.std))
    for photo in photos:
        ours = prepare_image(photo, resnet)
        assert ours.shape == (1, 3, 224, 224) and ours.dtype == torch.float32
        with Image.open(photo) as image:
            theirs = weights(pil_to_tensor(image.convert("RGB"))) * std + mean
        # the same steps on uint8; torchvision's v1 resize may round a pixel to the neighbouring level
        assert (ours[0] - theirs).abs().max() <= 1 / 255 + 1e-5


def test_prepare_image_follows_input_range(resnet: FeatureExtractor, photos: list[Path]) -> None:
    signed = FeatureExtractor("resnet18", ["layer1"], weights="DEFAULT", input_range=(-1, 1))
    unit = prepare_image(photos[1], resnet)
    assert torch.allclose(prepare_image(photos[1], signed), to_input_range(unit, (-1.0, 1.0)), atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(signed(prepare_image(photos[1], signed))["layer1"], resnet(unit)["layer1"], atol=1e-4)


def test_prepare_image_takes_paths_tensors_and_batches(photos: list[Path]) -> None:
    ext = tiny_extractor()
    from_path = prepare_image(photos[1], ext, resize_size=40, crop_size=32)
    pixels = read_image(photos[1])
    assert torch.equal(prepare_image(pixels, ext, resize_size=40, crop_size=32), from_path)
    assert torch.equal(prepare_image(str(photos[1]), ext, resize_size=40, crop_size=32), from_path)
    batch = prepare_image(torch.stack([pixels, pixels]), ext, resize_size=40, crop_size=32)
    assert batch.shape == (2, 3, 32, 32) and torch.equal(batch[1:], from_path)
    assert prepare_image(pixels, ext, resize_size=None, crop_size=None).shape == (1, 3, *pixels.shape[1:])


def test_prepare_image_refuses_what_is_not_an_image() -> None:
    ext = tiny_extractor()
    with pytest.raises(TypeError, match="list"):
        prepare_image([1, 2, 3], ext)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(8, 8\)"):
        prepare_image(torch.rand(8, 8), ext)
    with pytest.raises(FileNotFoundError):
        prepare_image(Path("no/such/image.png"), ext)


def test_prepare_image_follows_the_extractors_dtype(photos: list[Path]) -> None:
    ext = tiny_extractor(input_range=(0, 255))
    single = prepare_image(photos[0], ext, crop_size=32)
    ext.double()
    image = prepare_image(photos[0], ext, crop_size=32)
    assert image.dtype == torch.float64 and image.device == ext.mean.device
    assert torch.equal(image, single.double())
    with torch.no_grad():
        assert ext(image)["relu1"].dtype == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepare_image_follows_the_extractors_device(photos: list[Path]) -> None:
    ext = tiny_extractor().cuda().half()
    image = prepare_image(photos[0], ext, crop_size=32)
    assert image.device == ext.mean.device and image.dtype == torch.float16
    with torch.no_grad():
        assert ext(image)["relu1"].device.type == "cuda"


def test_manifest_description_is_unchanged() -> None:
    pre = Preprocessing(mean=(0.5,), std=(0.5,), resize_size=232, crop_size=224, interpolation="bicubic")
    transform = transform_for(pre, (-1, 1))
    assert transform.describe() == {
        "resize_size": 232,
        "crop_size": 224,
        "interpolation": "bicubic",
        "input_range": [-1.0, 1.0],
    }
    assert transform_for(Preprocessing(), (0, 1), resize_size=256, crop_size=None).describe() == {
        "resize_size": 256,
        "crop_size": None,
        "interpolation": "bilinear",
        "input_range": [0.0, 1.0],
    }


def _gray_file(path: Path, header: bytes, pixels: object) -> Path:
    """``path`` written as ``header`` followed by the raw bytes of ``pixels`` (a numpy array)."""
    path.write_bytes(header + pixels.tobytes())  # type: ignore[attr-defined]
    return path


@pytest.mark.parametrize("value", [200, 1000, 65535])
def test_a_32_bit_mode_image_of_16_bit_data_scales_by_the_files_16_bits(tmp_path: Path, value: int) -> None:
    """A 16-bit PGM opens in Pillow's 32-bit mode "I": it scales by its declared 16 bits (as a 16-bit PNG does),
    whatever its content; a dark one (every pixel at most 255) was once divided by 255, 257 times too bright."""
    import numpy as np

    path = _gray_file(tmp_path / "gray.pgm", b"P5 4 3 65535\n", np.full((3, 4), value, dtype=">u2"))
    with Image.open(path) as image:
        assert image.mode == "I"  # the case: 16-bit data in the 32-bit mode
    assert torch.equal(read_image(path), torch.full((3, 3, 4), value / 65535.0))


@pytest.mark.parametrize("value", [200, 1 << 20, (1 << 31) - 1])
def test_a_32_bit_integer_image_scales_by_its_32_bits(tmp_path: Path, value: int) -> None:
    """A 32-bit integer TIFF scales by the range of its 32 bits, never by its content (it was divided by 255 or
    65535 depending on its brightest pixel, and clipped)."""
    import numpy as np

    path = tmp_path / "gray32.tif"
    Image.fromarray(np.full((3, 4), value, dtype=np.int32), mode="I").save(path)
    expected = torch.full((3, 3, 4), value / float((1 << 31) - 1))
    assert torch.allclose(read_image(path), expected, rtol=1e-6, atol=0)
