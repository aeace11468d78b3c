"""``.npy`` and ``.npz`` arrays of images as sources: the same features as the same images saved as PNG files, bitwise;
row names that list the same rows again; arrays that are not uint8 images refused in one line, pickles never opened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featurehooks import dump_features, images
from featurehooks._stream import list_images
from featurehooks._stream.arrays import NpzArrays
from featurehooks.errors import InputNotFoundError, InvalidTypeError, InvalidValueError
from featurehooks.metrics import feature_statistics

from helpers import tiny_extractor

OPTIONS = {"batch_size": 3, "num_workers": 0, "progress": False, "resize_size": 36, "crop_size": 32}


@pytest.fixture(scope="module")
def pixels() -> np.ndarray:
    """Five seeded (40, 44, 3) uint8 images, NHWC."""
    return np.random.default_rng(3).integers(0, 256, (5, 40, 44, 3), dtype=np.uint8)


def png_folder(pixels: np.ndarray, folder: Path) -> Path:
    """The images saved as PNG files 0.png ... (grayscale for one channel), in a folder's sorted order."""
    folder.mkdir()
    for row, image in enumerate(pixels):
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(folder / f"{row}.png")
    return folder


def features(source: object, out: Path) -> np.ndarray:
    """The unpooled conv2 maps of a dump of ``source``: any difference in a pixel shows."""
    result = dump_features(tiny_extractor(), source, out, **OPTIONS)
    assert result.skipped == []
    return result.load("conv2")


def write_array(layout: str, pixels: np.ndarray, folder: Path) -> str:
    """``pixels`` saved in ``layout``; returns the source that names them."""
    if layout == "npy NHWC":
        np.save(folder / "x.npy", pixels)
    elif layout == "npy NCHW":
        np.save(folder / "x.npy", pixels.transpose(0, 3, 1, 2))
    elif layout == "npy Fortran order":
        np.save(folder / "x.npy", np.asfortranarray(pixels))
    elif layout == "npz arr_0 (ADM)":  # guided-diffusion's samples: images, then labels
        np.savez(folder / "x.npz", pixels, np.arange(len(pixels)))
        return str(folder / "x.npz")
    else:
        np.savez_compressed(folder / "x.npz", labels=np.arange(len(pixels)), images=pixels)
        return f"{folder}/x.npz/images"
    return str(folder / "x.npy")


LAYOUTS = ["npy NHWC", "npy NCHW", "npy Fortran order", "npz arr_0 (ADM)", "npz compressed, named"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_array_rows_are_the_png_files_features_bitwise(pixels: np.ndarray, tmp_path: Path, layout: str) -> None:
    reference = features(png_folder(pixels, tmp_path / "png"), tmp_path / "ref")
    source = write_array(layout, pixels, tmp_path)
    np.testing.assert_array_equal(features(source, tmp_path / "out"), reference)


def test_one_channel_arrays_are_grayscale_pngs(pixels: np.ndarray, tmp_path: Path) -> None:
    gray = pixels[..., :1]
    np.save(tmp_path / "gray.npy", gray)
    reference = features(png_folder(gray, tmp_path / "png"), tmp_path / "ref")
    np.testing.assert_array_equal(features(tmp_path / "gray.npy", tmp_path / "out"), reference)


def test_statistics_of_an_npz_are_the_png_folders(pixels: np.ndarray, tmp_path: Path) -> None:
    np.savez(tmp_path / "samples.npz", pixels)
    ext = tiny_extractor(["conv2"])
    mine = feature_statistics(ext, tmp_path / "samples.npz", **OPTIONS)
    theirs = feature_statistics(ext, png_folder(pixels, tmp_path / "png"), **OPTIONS)
    assert mine.count == theirs.count == 5
    np.testing.assert_array_equal(mine.mean.numpy(), theirs.mean.numpy())
    np.testing.assert_array_equal(mine.covariance.numpy(), theirs.covariance.numpy())


def test_row_names_list_the_same_rows_again(pixels: np.ndarray, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", pixels)
    np.savez(tmp_path / "y.npz", pixels[:2], images=pixels[:3])
    rows = list_images([tmp_path / "x.npy", tmp_path / "y.npz", tmp_path / "y.npz/images", f"{tmp_path}/x.npy/4"])
    x, y = tmp_path / "x.npy", tmp_path / "y.npz"
    expected = [f"{x}/{i}" for i in range(5)] + [f"{y}/arr_0/{i}" for i in range(2)]
    expected += [f"{y}/images/{i}" for i in range(3)] + [f"{x}/4"]
    assert rows == expected
    assert list_images(rows) == rows  # what the CLI does: list, then pass the names on


def test_compressed_rows_read_in_any_order(pixels: np.ndarray, tmp_path: Path) -> None:
    np.savez_compressed(tmp_path / "c.npz", pixels)
    arrays = NpzArrays(str(tmp_path / "c.npz"))
    try:
        for row in (3, 4, 0, 2):  # forward, then back to the start
            np.testing.assert_array_equal(arrays.read(f"arr_0/{row}").permute(1, 2, 0).numpy(), pixels[row])
    finally:
        arrays.close()


class Trap:
    """Unpickling this would create ``marker`` (pickle calls ``os.mkdir``): it must never happen."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.mkdir, (str(self.marker),)


def test_a_pickled_object_array_is_refused_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    trap = np.empty(2, dtype=object)
    trap[:] = [Trap(marker), Trap(marker)]
    np.savez(tmp_path / "evil.npz", trap)
    np.save(tmp_path / "evil.npy", trap, allow_pickle=True)
    for name in ("evil.npz", "evil.npy"):
        with pytest.raises(InvalidTypeError, match="Python objects.*never unpickled"):
            list_images(tmp_path / name)
        with pytest.raises(InvalidTypeError, match="never unpickled"):
            dump_features(tiny_extractor(), tmp_path / name, tmp_path / "out", **OPTIONS)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()  # refused while listing, before the output exists


@pytest.mark.parametrize(
    ("array", "error", "message"),
    [
        (np.zeros((2, 8, 8, 3), np.float32), InvalidTypeError, "holds float32; images must be uint8"),
        (np.zeros((2, 8, 8, 3), np.uint16), InvalidTypeError, "holds uint16"),
        (np.zeros((8, 8, 3), np.uint8), InvalidValueError, r"shape \(8, 8, 3\); images must be \(N, H, W, C\)"),
        (np.zeros((2, 3, 8, 3), np.uint8), InvalidValueError, "could be"),  # (N, H=3, W, C=3) or (N, C=3, H, W=3)?
        (np.zeros((2, 8, 8, 4), np.uint8), InvalidValueError, "has neither"),
        (np.zeros((0, 8, 8, 3), np.uint8), InputNotFoundError, "0 rows"),
    ],
    ids=["float32", "uint16", "3-d", "ambiguous", "4 channels", "empty"],
)
def test_arrays_that_are_not_images_are_one_line_errors(
    tmp_path: Path, array: np.ndarray, error: type[Exception], message: str
) -> None:
    np.save(tmp_path / "bad.npy", array)
    np.savez(tmp_path / "bad.npz", array)
    for name in ("bad.npy", "bad.npz"):
        with pytest.raises(error, match=message) as caught:
            list_images(tmp_path / name)
        assert "\n" not in str(caught.value) and name in str(caught.value)


def test_what_an_npz_lacks_is_named(pixels: np.ndarray, tmp_path: Path) -> None:
    np.savez(tmp_path / "keyed.npz", images=pixels, labels=np.arange(5, dtype=np.uint8))
    with pytest.raises(InputNotFoundError, match=r"no array 'arr_0' .*its arrays: images, labels"):
        list_images(tmp_path / "keyed.npz")
    with pytest.raises(InputNotFoundError, match="no array 'pics'"):
        list_images(tmp_path / "keyed.npz/pics")
    with pytest.raises(InputNotFoundError, match=r"no row '05' .*rows 0\.\.4"):
        list_images(tmp_path / "keyed.npz/images/05")  # one name a row: "5", never "05"
    (tmp_path / "text.npy").write_text("not an array")
    with pytest.raises(InvalidValueError, match="text.npy is not a NumPy array file"):
        list_images(tmp_path / "text.npy")
    (tmp_path / "text.npz").write_text("not a zip")
    with pytest.raises(InvalidValueError, match=r"text.npz is not an \.npz file"):
        list_images(tmp_path / "text.npz")


def test_images_over_the_pixel_limit_are_refused(
    pixels: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "big.npy", pixels)
    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 40 * 44 - 1)
    with pytest.raises(InvalidValueError, match="44x40 pixels, over MAX_DECODED_PIXELS"):
        list_images(tmp_path / "big.npy")
