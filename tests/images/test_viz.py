"""Feature-map grids: layout, channel choice, token maps, errors, PNG output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.viz import feature_grid, save_feature_grid, top_channels

LABEL = 14
GAP = 2


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
