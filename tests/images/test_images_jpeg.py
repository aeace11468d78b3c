"""JPEGs decoded by torchvision's decode_jpeg (featurehooks.images.read_image, through featurehooks._decode): Pillow's
pixels, Pillow's failures."""

from __future__ import annotations

import io
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image, ImageFile, ImageOps
from torch import Tensor
from torchvision.models import EfficientNet_B0_Weights, ResNet18_Weights

from featurehooks import Preprocessing, _decode
from featurehooks.errors import InvalidValueError
from featurehooks.images import image_size, read_image, transform_for

# JPEG settings a camera, a website or a dataset tool may have used
KINDS: dict[str, dict[str, object]] = {
    "q90-420": {"quality": 90, "subsampling": 2},
    "q90-422": {"quality": 90, "subsampling": 1},
    "q90-444": {"quality": 90, "subsampling": 0},
    "q75-420": {"quality": 75},
    "progressive": {"quality": 90, "progressive": True},
}
SIZES = [None, (301, 227), (123, 517)]  # (width, height): as shipped, odd sizes, a tall one
PHOTOS = ["astronaut", "coffee", "chelsea"]


def pillow_pixels(path: Path) -> Tensor:
    """What the Pillow route makes of a file: open, EXIF transpose, RGB, (3, H, W) ``uint8``."""
    with Image.open(path) as image:
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    return torch.from_numpy(np.asarray(rgb).transpose(2, 0, 1).copy())


def jpeg_bytes(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def noise(width: int = 64, height: int = 48, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """scikit-image's sample photos at several sizes, in every JPEG kind of ``KINDS`` and in grayscale."""
    data = pytest.importorskip("skimage.data")
    folder = tmp_path_factory.mktemp("jpeg")
    paths = []
    for name in PHOTOS:
        photo = Image.fromarray(getattr(data, name)())
        for size in SIZES:
            picture = photo if size is None else photo.resize(size, Image.Resampling.LANCZOS)
            stem = f"{name}-{picture.width}x{picture.height}"
            for kind, options in KINDS.items():
                paths.append(folder / f"{stem}-{kind}.jpg")
                picture.save(paths[-1], **options)
            paths.append(folder / f"{stem}-gray.jpg")
            picture.convert("L").save(paths[-1], quality=90)
            paths.append(folder / f"{stem}-gray-progressive.jpg")
            picture.convert("L").save(paths[-1], quality=90, progressive=True)
    return paths


@pytest.fixture(scope="module")
def turned(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A non-square photo with every EXIF orientation 1..8, as 4:2:0, progressive 4:4:4 and grayscale JPEGs."""
    data = pytest.importorskip("skimage.data")
    folder = tmp_path_factory.mktemp("turned")
    photo = Image.fromarray(data.chelsea()).resize((205, 131), Image.Resampling.LANCZOS)
    paths = []
    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        for kind, picture, options in [
            ("q90-420", photo, {"quality": 90}),
            ("progressive-444", photo, {"quality": 90, "subsampling": 0, "progressive": True}),
            ("gray", photo.convert("L"), {"quality": 90}),
        ]:
            paths.append(folder / f"{orientation}-{kind}.jpg")
            picture.save(paths[-1], exif=exif, **options)
    return paths


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the files ``read_image`` hands to ``decode_jpeg`` (the one-time self-check done beforehand)."""
    if not _decode.decode_jpeg_is_pillows():  # the wheels have libjpeg-turbo on both sides
        pytest.skip("this torchvision's decode_jpeg gives other pixels than Pillow: every JPEG is Pillow's")
    calls: list[int] = []
    real: Callable[..., Tensor] = _decode.decode_jpeg

    def spy(data: Tensor, *args: object, **kwargs: object) -> Tensor:
        calls.append(data.numel())
        return real(data, *args, **kwargs)

    monkeypatch.setattr(_decode, "decode_jpeg", spy)
    return calls


def test_photos_equal_the_pillow_route(photos: list[Path], decoded: list[int]) -> None:
    for photo in photos:
        pixels = read_image(photo)
        assert pixels.dtype == torch.uint8 and pixels.permute(1, 2, 0).is_contiguous(), photo.name
        assert torch.equal(pixels, pillow_pixels(photo)), photo.name
        assert image_size(photo) == tuple(pixels.shape[1:]), photo.name
    assert len(decoded) == len(photos)  # all of them went through decode_jpeg


def test_every_exif_orientation_equals_the_pillow_route(turned: list[Path], decoded: list[int]) -> None:
    for path in turned:
        pixels = read_image(path)
        assert torch.equal(pixels, pillow_pixels(path)), path.name
        assert pixels.permute(1, 2, 0).is_contiguous() and image_size(path) == tuple(pixels.shape[1:]), path.name
    assert len(decoded) == len(turned)


def test_an_xmp_orientation_is_followed_as_pillow_follows_it(tmp_path: Path, decoded: list[int]) -> None:
    """torchvision's own apply_exif_orientation reads EXIF only; Pillow (and image_size) read XMP too."""
    xmp = (
        b'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="6"/></rdf:RDF></x:xmpmeta>'
    )
    path = tmp_path / "xmp.jpg"
    path.write_bytes(jpeg_bytes(noise(40, 24), quality=90, xmp=xmp))
    pixels = read_image(path)
    assert pixels.shape == (3, 40, 24) and image_size(path) == (40, 24)
    assert torch.equal(pixels, pillow_pixels(path)) and decoded


@pytest.mark.parametrize(
    "weights",
    [ResNet18_Weights.IMAGENET1K_V1, EfficientNet_B0_Weights.IMAGENET1K_V1],
    ids=["resnet18-bilinear-256", "efficientnet-bicubic-256"],
)
def test_prepared_photos_equal_the_weights_own_transforms(photos: list[Path], turned: list[Path], weights) -> None:
    reference = weights.transforms()  # on a PIL image: Pillow resize, crop, /255, normalize
    pre = Preprocessing(
        resize_size=reference.resize_size[0],
        crop_size=reference.crop_size[0],
        interpolation=reference.interpolation.value,
    )
    transform = transform_for(pre, (0.0, 1.0))
    for path in [*photos[:: len(KINDS) + 2], *photos[1:8], *turned]:  # each size and photo, each kind, each turn
        with Image.open(path) as image:
            theirs = reference(ImageOps.exif_transpose(image).convert("RGB"))
        ours = TF.normalize(transform(read_image(path)), reference.mean, reference.std)
        assert torch.equal(ours, theirs), path.name


def test_other_files_stay_with_pillow(tmp_path: Path, decoded: list[int]) -> None:
    picture = noise()
    picture.convert("CMYK").save(tmp_path / "cmyk.jpg", quality=90)
    picture.save(tmp_path / "picture.png")
    picture.save(tmp_path / "png-named.jpg", format="PNG")  # the content decides, not the name
    for name in ("cmyk.jpg", "picture.png", "png-named.jpg"):
        assert torch.equal(read_image(tmp_path / name), pillow_pixels(tmp_path / name)), name
    assert torch.equal(read_image(tmp_path / "png-named.jpg"), read_image(tmp_path / "picture.png"))
    assert decoded == []


def test_jpegs_stay_with_pillow_where_decode_jpeg_would_differ(
    tmp_path: Path, decoded: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_decode, "decode_jpeg_is_pillows", lambda: False)  # a torchvision on IJG libjpeg 9
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(noise(), quality=90))
    assert torch.equal(read_image(tmp_path / "a.jpg"), pillow_pixels(tmp_path / "a.jpg"))
    assert decoded == []


def test_a_truncated_jpeg_still_fails_as_with_pillow(tmp_path: Path, decoded: list[int]) -> None:
    full = jpeg_bytes(noise(), quality=90)
    (tmp_path / "cut.jpg").write_bytes(full[: len(full) // 2])
    with pytest.raises(OSError, match="truncated"):
        read_image(tmp_path / "cut.jpg")
    assert decoded == [len(full) // 2]  # decode_jpeg refused it, then Pillow decided


def test_a_truncated_jpeg_loads_where_pillow_is_told_to_load_it(
    tmp_path: Path, decoded: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    full = jpeg_bytes(noise(), quality=90)
    (tmp_path / "cut.jpg").write_bytes(full[: len(full) // 2])
    assert torch.equal(read_image(tmp_path / "cut.jpg"), pillow_pixels(tmp_path / "cut.jpg"))
    assert decoded


@pytest.mark.parametrize("seed", range(6))
def test_corrupt_jpegs_end_as_with_pillow(tmp_path: Path, seed: int) -> None:
    """Damaged entropy-coded data: the same recovered pixels as Pillow, or the same kind of error."""
    data = bytearray(jpeg_bytes(noise(seed=seed), quality=90))
    rng = np.random.default_rng(seed)
    start = data.index(b"\xff\xda") + 20  # inside the scan, past its header
    for at in rng.integers(start, len(data) - 2, 5):
        data[at] = int(rng.integers(0, 256))
    path = tmp_path / "corrupt.jpg"
    path.write_bytes(bytes(data))
    try:
        expected: Tensor | type[Exception] = pillow_pixels(path)
    except Exception as error:  # whatever Pillow raises, read_image must raise too
        expected = type(error)
    if isinstance(expected, Tensor):
        assert torch.equal(read_image(path), expected)
    else:
        with pytest.raises(expected):
            read_image(path)


def test_an_oversized_jpeg_header_is_refused_before_decoding(tmp_path: Path, decoded: list[int]) -> None:
    data = jpeg_bytes(noise(), quality=90)
    at = data.index(b"\xff\xc0")  # baseline SOF0: marker, length, precision, height, width
    claimed = data[: at + 5] + struct.pack(">HH", 8000, 9000) + data[at + 9 :]
    (tmp_path / "huge.jpg").write_bytes(claimed)
    with pytest.raises(InvalidValueError, match="9000x8000 pixels is over MAX_DECODED_PIXELS"):
        read_image(tmp_path / "huge.jpg")
    assert decoded == []


def test_torchvisions_deprecation_of_its_decoders_does_not_reach_the_user(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(noise(), quality=90))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error
        assert read_image(tmp_path / "a.jpg").shape == (3, 48, 64)
