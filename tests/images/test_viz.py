"""Feature-map grids: layout, channel choice, token maps, errors, PNG output; caption bands, and the caption line
with which the examples say that random weights drew a picture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.errors import InvalidValueError, RunFailedError
from featurehooks.viz import add_caption, feature_grid, save_feature_grid, top_channels

from helpers import REPO, load_script

LABEL = 14
GAP = 2
CAPTION_LINE = 12
CAPTION_MARGIN = 3


def band(lines: int) -> int:
    """Height of a caption band of ``lines`` lines."""
    return 2 * CAPTION_MARGIN + CAPTION_LINE * lines


def test_grid_layout_one_row_per_layer() -> None:
    feats = {"a": torch.rand(2, 6, 8, 8), "b": torch.rand(2, 3, 4, 4)}
    grid = feature_grid(feats, torch.rand(2, 3, 16, 16), channels=4, tile_size=24)
    columns = 1 + 4  # the image, then at most 4 maps (layer b has only 3: its last cell stays white)
    assert grid.dtype == np.uint8
    assert grid.shape == (2 * (LABEL + 24) + GAP, columns * 24 + (columns - 1) * GAP, 3)
    last_cell_of_b = grid[LABEL + 24 + GAP + LABEL :, -24:]
    assert (last_cell_of_b == 255).all()


def test_top_channels_are_the_most_active_first() -> None:
    fmap = torch.zeros(5, 4, 4)
    for channel, level in enumerate([0.1, 3.0, -1.0, 2.0, 0.5]):
        fmap[channel] = level
    assert top_channels(fmap, 3) == [1, 3, 4]


def test_constant_maps_and_the_input_image_draw_without_nan() -> None:
    image = torch.zeros(1, 3, 16, 16)
    image[:, 0] = 1.0  # red
    grid = feature_grid({"flat": torch.ones(1, 2, 4, 4)}, image, channels=2, tile_size=16)
    np.testing.assert_array_equal(grid[LABEL + 8, 8], [255, 0, 0])  # the image tile
    assert len(np.unique(grid[LABEL + 8 :, 18 + 8 :].reshape(-1, 3), axis=0)) <= 3  # flat map: one color (+ label)


def test_image_in_another_range_is_rescaled() -> None:
    image = torch.full((1, 3, 8, 8), 1.0)  # white in (-1, 1)
    grid = feature_grid({"x": torch.rand(1, 1, 4, 4)}, image, channels=1, tile_size=16, input_range=(-1.0, 1.0))
    np.testing.assert_array_equal(grid[LABEL + 8, 8], [255, 255, 255])


def test_token_features_fold_into_maps() -> None:
    tokens = torch.rand(1, 1 + 16, 8)  # class token + 4x4 patches, 8 channels
    grid = feature_grid({"blocks.3": tokens}, channels=2, tile_size=16)
    assert grid.shape == (LABEL + 16, 2 * 16 + GAP, 3)


@pytest.mark.parametrize("shape", [(1, 512), (1, 7, 8)])
def test_features_that_are_not_maps_are_explained(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="not a feature map"):
        feature_grid({"fc": torch.rand(*shape)})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no features"):
        feature_grid({})
    with pytest.raises(ValueError, match="channels"):
        feature_grid({"a": torch.rand(1, 2, 4, 4)}, channels=0)


def test_save_writes_a_png(tmp_path: Path) -> None:
    path = save_feature_grid(tmp_path / "sub" / "grid.png", {"a": torch.rand(1, 4, 8, 8)}, channels=3, tile_size=16)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (3 * 16 + 2 * GAP, LABEL + 16)


def test_infinite_and_nan_values_do_not_break_the_colormap() -> None:
    fmap = torch.rand(1, 2, 4, 4)
    fmap[0, 0, 0, 0] = float("inf")  # an fp16 overflow
    fmap[0, 1, 1, 1] = float("nan")
    fmap[0, 1, 2, 2] = float("-inf")
    grid = feature_grid({"a": fmap}, channels=2, tile_size=16)
    assert grid.shape == (LABEL + 16, 2 * 16 + GAP, 3)


def test_save_without_a_suffix_writes_a_png(tmp_path: Path) -> None:
    path = save_feature_grid(tmp_path / "grid", {"a": torch.rand(1, 4, 8, 8)}, channels=2, tile_size=16)
    with Image.open(path) as image:
        assert image.format == "PNG"


def test_caption_goes_in_a_band_above_an_unchanged_grid() -> None:
    feats, image = {"a": torch.rand(1, 6, 8, 8)}, torch.rand(1, 3, 16, 16)
    plain = feature_grid(feats, image, channels=4, tile_size=48)
    captioned = feature_grid(feats, image, channels=4, tile_size=48, caption="resnet18 a\nRANDOM weights (seed 0)")
    assert captioned.shape == (band(2) + plain.shape[0], plain.shape[1], 3)
    np.testing.assert_array_equal(captioned[band(2) :], plain)  # the layout below the band is the grid's
    for line in range(2):  # each line of the band has dark text on the white background
        rows = captioned[CAPTION_MARGIN + CAPTION_LINE * line : CAPTION_MARGIN + CAPTION_LINE * (line + 1)]
        assert (rows < 128).all(axis=-1).any(), f"line {line} of the caption is empty"
    assert (captioned[: band(2), -8:] == 255).all()  # text starts at the left; the band's background is white


def test_add_caption_wraps_long_lines_to_the_picture_and_copies_it() -> None:
    picture = np.full((10, 120, 3), 7, dtype=np.uint8)
    text = "RANDOM weights (seed 0): shows the mechanics, not what a trained VGG16 sees"
    wide, narrow = add_caption(np.zeros((10, 800, 3), dtype=np.uint8), text), add_caption(picture, text)
    assert wide.shape[0] == band(1) + 10
    assert narrow.shape[0] > band(2) + 10 and narrow.shape[1] == 120  # wrapped into more lines, never wider
    assert (narrow[: narrow.shape[0] - 10, -3:] == 255).all()  # wrapped text stays inside the picture
    np.testing.assert_array_equal(narrow[-10:], picture)
    assert (picture == 7).all()  # the caller's array is not touched


@pytest.mark.parametrize(
    ("picture", "caption", "match"),
    [
        (np.zeros((8, 8, 3), dtype=np.uint8), "  ", "blank"),
        (np.zeros((8, 8), dtype=np.uint8), "x", "RGB uint8"),
        (np.zeros((8, 8, 3), dtype=np.float32), "x", "RGB uint8"),
    ],
)
def test_add_caption_refuses_bad_input(picture: np.ndarray, caption: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        add_caption(picture, caption)


def test_save_forwards_the_caption(tmp_path: Path) -> None:
    path = save_feature_grid(
        tmp_path / "grid.png", {"a": torch.rand(1, 4, 8, 8)}, channels=3, tile_size=16, caption="x"
    )
    with Image.open(path) as image:
        assert image.size == (3 * 16 + 2 * GAP, band(1) + LABEL + 16)


def test_the_examples_caption_says_when_the_weights_are_random() -> None:
    weights_caption = load_script("examples/_common.py").weights_caption
    random = weights_caption("VGG16", None, seed=3)
    assert "RANDOM weights (seed 3)" in random and "not what a trained VGG16 sees" in random
    assert weights_caption("VGG16", "VGG16_Weights.IMAGENET1K_V1") == "weights VGG16_Weights.IMAGENET1K_V1"


def _raise(error: BaseException) -> None:
    raise error


def test_the_examples_end_bad_input_and_failed_runs_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """As the featurehooks command: bad input exits 2, a failed run 1, each with one line; a bug keeps its traceback."""
    run = load_script("examples/_common.py").run
    cases = [
        (
            InvalidValueError("precision='fp16' cannot run on cpu: ..."),
            2,
            "error: precision='fp16' cannot run on cpu: ...",
        ),
        (
            FileNotFoundError(2, "No such file or directory", "style.jpg"),
            1,
            "error: [Errno 2] No such file or directory",
        ),
        (RunFailedError("1 of 2 ranks failed"), 1, "error: 1 of 2 ranks failed"),
    ]
    for error, status, line in cases:
        with pytest.raises(SystemExit) as exited:
            run(lambda error=error: _raise(error))
        err = capsys.readouterr().err
        assert exited.value.code == status and err.startswith(line) and err.count("\n") == 1, (error, err)
    with pytest.raises(ZeroDivisionError):
        run(lambda: 1 / 0)
    for name in ("grad_cam", "style_transfer", "train_with_perceptual_loss"):  # the examples that take arguments
        script = (REPO / "examples" / f"{name}.py").read_text()
        assert script.endswith('if __name__ == "__main__":\n    run(main)\n'), name
