"""The input side of dumps: pixel budgets, special files, datasets that fail or carry labels, torchvision's pixels."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
import torchvision.transforms.v2.functional as F
from PIL import Image
from torch.utils.data import Dataset, TensorDataset
from torchvision.models import EfficientNet_B0_Weights, ResNet18_Weights, ResNet50_Weights

import featurehooks.images as images
from featurehooks import FeatureExtractor, Preprocessing
from featurehooks._stream.loader import collate_batch
from featurehooks._stream.sources import TensorRows, dataset_layout, item_label
from featurehooks.dump import dump_features, list_images
from featurehooks.errors import InvalidTypeError, InvalidValueError
from featurehooks.images import prepare_image, read_image, resized_size, transform_for

import helpers

CROP = 32
SAMPLES = helpers.REPO / "examples" / "images"
# size (width, height) of variants of a real photo: odd sizes, both orientations, panorama, up- and downscaled
VARIANTS = [(601, 333), (255, 300), (1001, 97), (100, 80), (224, 224), (256, 300), (300, 256), (383, 517)]
posix_only = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs and /dev")


def tiny_extractor() -> FeatureExtractor:
    return helpers.tiny_extractor(["relu1"], channels=(4,), stride=4)


def dump(source: object, out: Path, **kwargs: object):
    options = {"batch_size": 4, "num_workers": 0, "progress": False, "pool": "avg", "resize_size": CROP}
    options.update({"crop_size": CROP, **kwargs})
    return dump_features(tiny_extractor(), source, out, **options)


def reasons(result) -> dict[str, str]:
    """File name -> reason of every invalid row."""
    return {Path(item["path"]).name: item["reason"] for item in result.skipped}


def run_script(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (its own peak memory, its own CPU capability); returns its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A real photo (matplotlib's sample of Grace Hopper) as it is and re-encoded at odd sizes and modes."""
    cbook = pytest.importorskip("matplotlib.cbook")
    original = Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
    folder = tmp_path_factory.mktemp("photos")
    paths = [original, SAMPLES / "sample_05_texture.png"]
    with Image.open(original) as image:
        photo = image.convert("RGB")
    for width, height in VARIANTS:
        paths.append(folder / f"{width}x{height}.jpg")
        photo.resize((width, height), Image.Resampling.LANCZOS).save(paths[-1], quality=90)
    photo.crop((13, 7, 424, 396)).save(folder / "crop.png")
    photo.convert("L").resize((517, 383)).save(folder / "gray.jpg")
    photo.convert("CMYK").resize((320, 241)).save(folder / "cmyk.jpg")
    return [*paths, folder / "crop.png", folder / "gray.jpg", folder / "cmyk.jpg"]


def weights_preprocessing(reference) -> Preprocessing:
    """The resize, crop and interpolation of a torchvision ``ImageClassification`` transform."""
    return Preprocessing(
        resize_size=reference.resize_size[0],
        crop_size=reference.crop_size[0],
        interpolation=reference.interpolation.value,
    )


# -- 12: the pixels of torchvision's own weights.transforms() -------------------------------------------------


@pytest.mark.parametrize(
    "weights",
    [ResNet18_Weights.IMAGENET1K_V1, ResNet50_Weights.IMAGENET1K_V2, EfficientNet_B0_Weights.IMAGENET1K_V1],
    ids=["resnet18-bilinear-256", "resnet50-bilinear-232", "efficientnet-bicubic-256"],
)
def test_real_photos_equal_the_weights_own_transforms_exactly(photos: list[Path], weights) -> None:
    reference = weights.transforms()  # on a PIL image: Pillow resize, crop, /255, normalize
    transform = transform_for(weights_preprocessing(reference), (0.0, 1.0))
    for photo in photos:
        with Image.open(photo) as image:
            theirs = reference(image.convert("RGB"))
        ours = TF.normalize(transform(read_image(photo)), reference.mean, reference.std)
        assert torch.equal(ours, theirs), photo.name


@pytest.mark.slow
def test_equal_on_cpus_without_avx2_where_torchs_uint8_resize_differs(photos: list[Path]) -> None:
    """The issue's 18%: without AVX2, torch resizes uint8 through floats and rounds a level off."""
    out = run_script(
        f"""
        import torch, torchvision.transforms.v2.functional as F
        from PIL import Image
        from torchvision.models import ResNet18_Weights
        from featurehooks import Preprocessing
        from featurehooks.images import read_image, transform_for
        reference = ResNet18_Weights.IMAGENET1K_V1.transforms()
        ours = transform_for(Preprocessing(resize_size=256, crop_size=224), (0.0, 1.0))
        mismatched = 0.0
        for path in {[str(p) for p in photos[:4]]!r}:
            pixels = read_image(path)
            with Image.open(path) as image:
                pil = image.convert("RGB")
            theirs = F.pil_to_tensor(F.center_crop(F.resize(pil, [256]), [224, 224]))
            assert torch.equal(ours(pixels), theirs.float() / 255), path
            torch_kernel = F.center_crop(F.resize(pixels, [256], antialias=True), [224, 224])
            mismatched = max(mismatched, (torch_kernel != theirs).float().mean().item())
        print(torch.backends.cpu.get_cpu_capability(), mismatched)
        """,
        ATEN_CPU_CAPABILITY="default",
    )
    capability, mismatched = out.split()
    assert capability == "DEFAULT" and float(mismatched) > 0.05  # what the resize was before, on such a CPU


def test_resized_size_is_torchvisions() -> None:
    for height, width in [(1, 1), (1, 1000), (1000, 1), (333, 601), (601, 333), (255, 300), (97, 1001), (7, 7)]:
        for size in (1, 224, 232, 256, 518):
            empty = torch.empty(0, height, width)  # torchvision computes the size without resizing anything
            assert resized_size(height, width, size) == tuple(F.resize(empty, [size]).shape[-2:])
    with pytest.raises(InvalidValueError, match="empty image of 0x5"):
        transform_for(Preprocessing(), (0.0, 1.0))(torch.zeros(3, 0, 5, dtype=torch.uint8))


def test_uint8_channels_and_batches_resize_alike() -> None:
    """RGB goes through Pillow as one picture, other channel counts plane by plane (alpha not premultiplied)."""
    pixels = torch.randint(0, 256, (2, 4, 37, 53), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    transform = transform_for(Preprocessing(), (0.0, 1.0), resize_size=29, crop_size=None)
    batch = transform(pixels)
    assert batch.shape == (2, 4, 29, 41)
    for image, resized in zip(pixels, batch):
        assert torch.equal(transform(image), resized)
        assert torch.equal(transform(image[:3]), resized[:3])
        for channel in range(4):
            assert torch.equal(transform(image[channel : channel + 1])[0], resized[channel])


# -- 3: decompression bombs by aspect ratio or by size ------------------------------------------------------


def write_thin(folder: Path) -> list[Path]:
    """A photo-like image and three tiny PNGs whose resize to 256 would be enormous."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (260, 300, 3), dtype=np.uint8)).save(folder / "a_photo.png")
    for name, size in (("b_wide.png", (1000, 1)), ("c_wider.png", (100000, 1)), ("d_tall.png", (1, 100000))):
        Image.new("L", size).save(folder / name)
    return sorted(folder.iterdir())


def test_thin_images_are_invalid_rows_with_the_reason(tmp_path: Path) -> None:
    paths = write_thin(tmp_path / "imgs")
    assert max(p.stat().st_size for p in paths[1:]) < 400  # bytes on disk; gigabytes once resized
    result = dump(tmp_path / "imgs", tmp_path / "out", resize_size=256, crop_size=224)
    assert sorted(reasons(result)) == ["b_wide.png", "c_wider.png", "d_tall.png"]
    wide = reasons(result)["b_wide.png"]
    assert "1000x1 pixels would be resized to 256000x256" in wide and "MAX_RESIZED_PIXELS" in wide
    assert result.manifest.num_valid == 1
    ext = tiny_extractor()
    with pytest.raises(InvalidValueError, match="MAX_RESIZED_PIXELS"):
        prepare_image(paths[2], ext, resize_size=256)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_thin_images_cost_no_memory(tmp_path: Path) -> None:
    """Before the budget, the 1000x1 PNG took +457 MiB and the 100000x1 one asked for about 20 GB."""
    paths = [str(p) for p in write_thin(tmp_path / "imgs")]
    out = run_script(
        f"""
        import resource
        from featurehooks import Preprocessing
        from featurehooks.images import read_image, transform_for
        transform = transform_for(Preprocessing(resize_size=256, crop_size=224), (0.0, 1.0))
        paths = {paths!r}
        transform(read_image(paths[0]))  # warm up: the allocator, Pillow's and torch's first calls
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for path in paths[1:]:
            try:
                transform(read_image(path))
            except ValueError:
                pass
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    assert int(out) < 32 * 1024  # KiB


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels and holds one row: decoding it would fail as truncated."""
    header = png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + header + png_chunk(b"IDAT", zlib.compress(bytes(1 + 3 * width)))


def test_decoded_pixels_are_checked_from_the_header_before_decoding(tmp_path: Path) -> None:
    (tmp_path / "huge.png").write_bytes(png_header(9000, 8000))  # 72 M pixels: under Pillow's own warning
    with pytest.raises(InvalidValueError, match="9000x8000 pixels is over MAX_DECODED_PIXELS"):
        read_image(tmp_path / "huge.png")
    result = dump([tmp_path / "huge.png", SAMPLES / "sample_00_shapes.png"], tmp_path / "out")
    assert "MAX_DECODED_PIXELS" in reasons(result)["huge.png"] and result.manifest.num_valid == 1


def test_budgets_are_module_constants_a_user_can_raise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Image.new("RGB", (20, 10)).save(tmp_path / "small.png")
    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 199)
    with pytest.raises(InvalidValueError, match="20x10 pixels is over MAX_DECODED_PIXELS = 199"):
        read_image(tmp_path / "small.png")
    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 200)
    pixels = read_image(tmp_path / "small.png")
    transform = transform_for(Preprocessing(), (0.0, 1.0), resize_size=30, crop_size=None)
    monkeypatch.setattr(images, "MAX_RESIZED_PIXELS", 60 * 30 - 1)
    with pytest.raises(InvalidValueError, match="resized to 60x30, over MAX_RESIZED_PIXELS = 1799"):
        transform(pixels)
    monkeypatch.setattr(images, "MAX_RESIZED_PIXELS", 60 * 30)
    assert transform(pixels).shape == (3, 30, 60)


# -- 9: FIFOs, devices and folders are never opened as images ----------------------------------------------


@posix_only
def test_fifos_and_devices_are_invalid_rows_not_a_hang(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe.png")
    sources = [SAMPLES / "sample_00_shapes.png", tmp_path / "pipe.png", "/dev/zero"]
    with helpers.deadline(30):
        result = dump(sources, tmp_path / "out")
    assert reasons(result) == {
        "pipe.png": "OSError: not a regular file: fifo",
        "zero": "OSError: not a regular file: character device",
    }
    with pytest.raises(OSError, match="not a regular file: directory"):
        read_image(tmp_path)


@posix_only
@pytest.mark.parametrize("pattern", [False, True])
def test_special_files_in_a_folder_or_glob_are_invalid_rows_not_dropped(tmp_path: Path, pattern: bool) -> None:
    folder = tmp_path / "in"
    (folder / "sub").mkdir(parents=True)
    Image.open(SAMPLES / "sample_00_shapes.png").save(folder / "a.png")
    os.mkfifo(folder / "sub" / "pipe.png")
    (folder / "gone.jpg").symlink_to(tmp_path / "missing.jpg")
    (folder / "notes.png").mkdir()  # a folder with an image suffix is no input
    source = str(folder / "**" / "*.*") if pattern else folder
    assert [Path(p).relative_to(folder).as_posix() for p in list_images(source)] == [
        "a.png",
        "gone.jpg",
        "sub/pipe.png",
    ]
    with helpers.deadline(30):
        result = dump(source, tmp_path / "out")
    assert result.num_rows == 3
    assert reasons(result)["pipe.png"] == "OSError: not a regular file: fifo"
    assert reasons(result)["gone.jpg"].startswith("FileNotFoundError")
    assert len(reasons(result)) == 2


@posix_only
def test_a_fifo_swapped_in_after_the_check_does_not_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    os.mkfifo(tmp_path / "pipe.png")
    regular = os.stat(SAMPLES / "sample_00_shapes.png")
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: regular if Path(path).name == "pipe.png" else real_stat(path))
    with helpers.deadline(10), pytest.raises(OSError, match="not a regular file: fifo"):
        read_image(tmp_path / "pipe.png")


# -- 11: datasets whose items fail, and (image, label) items -----------------------------------------------


class Flaky(Dataset):
    """Labelled images; the items in ``broken`` raise, as a dataset reading a bad file would."""

    def __init__(self, count: int, broken: tuple[int, ...] = (0,)) -> None:
        self.count, self.broken = count, broken

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index in self.broken:
            raise OSError(f"cannot read item {index}")
        return torch.full((3, CROP, CROP), index / 10), 10 + index


def test_a_first_item_that_raises_does_not_decide_the_layout() -> None:
    assert dataset_layout(Flaky(4)) == dataset_layout(Flaky(4, broken=()))
    assert dataset_layout(Flaky(4)).shape == (3, CROP, CROP)
    rows = TensorRows(Flaky(4), (3, CROP, CROP), labelled=True)
    assert rows[0].reason == "OSError: cannot read item 0" and rows[0].label is None and not rows[0].image.any()
    assert rows[1].reason == "" and rows[1].label == 11
    with pytest.raises(InvalidValueError, match=r"none of the first 3 dataset items .*item 0: OSError"):
        dataset_layout(Flaky(3, broken=(0, 1, 2)))
    with pytest.raises(InvalidValueError, match="empty"):
        dataset_layout(Flaky(0))


def test_a_dump_whose_first_item_raises_completes(tmp_path: Path) -> None:
    result = dump(Flaky(5), tmp_path / "out")
    assert result.skipped == [{"row": 0, "path": "dataset[0]", "reason": "OSError: cannot read item 0"}]


def test_items_of_the_wrong_kind_are_refused_at_once() -> None:
    pictures = [Image.new("RGB", (8, 8))] * 3
    with pytest.raises(InvalidTypeError, match="got Image"):
        dataset_layout(pictures)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="uint8 pixels or floats.*torch.int64"):
        dataset_layout(TensorDataset(torch.zeros(3, 3, 8, 8, dtype=torch.int64)))
    rows = TensorRows([torch.zeros(3, 8, 8), torch.zeros(3, 8, 8, dtype=torch.int16)], (3, 8, 8))  # type: ignore[arg-type]
    assert rows[0].reason == "" and "torch.int16" in rows[1].reason


def test_integer_labels_travel_with_their_rows() -> None:
    pictures = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    dataset = TensorDataset(pictures, torch.arange(5) * 7)
    layout = dataset_layout(dataset)
    assert layout.labelled
    rows = TensorRows(dataset, layout.shape, labelled=layout.labelled)
    batch = collate_batch([rows[i] for i in range(5)])
    assert batch.labels == [0, 7, 14, 21, 28] and batch.reasons == [""] * 5
    assert torch.equal(batch.images, pictures)


@pytest.mark.parametrize(
    ("item", "labelled"),
    [
        ((torch.zeros(3, 8, 8),), False),
        (torch.zeros(3, 8, 8), False),
        ((torch.zeros(3, 8, 8), {"boxes": torch.zeros(0, 4)}), False),  # a detection target is not a label
        ((torch.zeros(3, 8, 8), "cat"), False),
        ((torch.zeros(3, 8, 8), 3), True),
        ((torch.zeros(3, 8, 8), np.int64(3)), True),
        ((torch.zeros(3, 8, 8), torch.tensor([3])), True),
    ],
)
def test_which_items_carry_a_label(item: object, labelled: bool) -> None:
    assert dataset_layout([item]).labelled is labelled  # type: ignore[arg-type]


def test_labels_are_validated() -> None:
    image = torch.zeros(3, 8, 8)
    assert item_label((image, torch.tensor(5, dtype=torch.uint8))) == 5 and item_label((image, True)) == 1
    for bad, message in [
        ((image,), "has no label"),
        ((image, 2.0), "got float"),
        ((image, torch.tensor(2.0)), "got Tensor"),
        ((image, torch.tensor([1, 2])), "got Tensor"),
        ((image, 2**63), "does not fit in int64"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            item_label(bad)
    rows = TensorRows([(image, 1), (image, "dog")], (3, 8, 8), labelled=True)  # type: ignore[arg-type]
    assert (rows[0].reason, rows[0].label) == ("", 1)
    assert "got str" in rows[1].reason and rows[1].label is None


# -- the rest of its kind: truncated, broken and rotated files, glob loops ----------------------------------


def jpeg_bytes(image: Image.Image, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def test_truncated_jpeg_and_nan_tiff_are_invalid_rows(tmp_path: Path) -> None:
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    full = jpeg_bytes(noise)
    (tmp_path / "cut.jpg").write_bytes(full[: len(full) // 2])
    values = np.full((40, 40), 0.5, dtype=np.float32)
    values[3, 4] = np.nan
    Image.fromarray(values).save(tmp_path / "nan.tif")
    (tmp_path / "ok.jpg").write_bytes(full)
    result = dump(tmp_path, tmp_path / "out")
    found = reasons(result)
    assert sorted(found) == ["cut.jpg", "nan.tif"]
    assert "truncated" in found["cut.jpg"] and "NaN" in found["nan.tif"]


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: show rotated 90 degrees clockwise
    (tmp_path / "turned.jpg").write_bytes(jpeg_bytes(picture, exif=exif.tobytes(), quality=95))
    with Image.open(tmp_path / "turned.jpg") as image:
        expected = F.pil_to_tensor(image.convert("RGB").transpose(Image.Transpose.ROTATE_270))
    pixels = read_image(tmp_path / "turned.jpg")
    assert pixels.shape == (3, 50, 30) and torch.equal(pixels, expected)


@posix_only
def test_globs_do_not_follow_symlink_cycles(tmp_path: Path) -> None:
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    for name in ("imgs/a.png", "imgs/sub/b.png", "imgs/.hidden.png", "imgs/sub/.c.png"):
        Image.new("RGB", (4, 4)).save(tmp_path / name)
    (tmp_path / "imgs" / "sub" / "up").symlink_to("..")  # two cycles: glob.glob's ** would run for ever
    (tmp_path / "imgs" / "again").symlink_to(".")
    expected = [str(tmp_path / "imgs" / "a.png"), str(tmp_path / "imgs" / "sub" / "b.png")]
    with helpers.deadline(20):
        assert list_images(str(tmp_path / "imgs" / "**" / "*.png")) == expected
        assert list_images(str(tmp_path / "imgs" / "**")) == expected
        assert len(list_images(tmp_path / "imgs")) == 4  # a folder lists hidden files too, each once
        assert list_images(str(tmp_path / "imgs" / ".*.png")) == [str(tmp_path / "imgs" / ".hidden.png")]
