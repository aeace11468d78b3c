"""Pairs of images inside archives (ZIP, tar shards, .npy/.npz arrays): paired by inner name, scored as the same
images in folders are."""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.cli import main
from featurehooks.errors import InputNotFoundError
from featurehooks.metrics import pair_files, pairs_within, score_pairs

from helpers import SEED

OPTIONS = {"num_workers": 0, "batch_size": 4}


def mean_abs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs().mean(dim=(1, 2, 3))


def pixels(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 32, 36, 3), dtype=np.uint8)


def folder_of(images: np.ndarray, root: Path) -> Path:
    root.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(root / f"{i:02d}.png")
    return root


def zip_of(folder: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for file in sorted(folder.iterdir()):
            archive.write(file, file.name)
    return path


@pytest.fixture
def sets(tmp_path: Path) -> tuple[Path, Path]:
    return folder_of(pixels(5, SEED), tmp_path / "a"), folder_of(pixels(5, SEED + 1), tmp_path / "b")


def test_two_zips_pair_and_score_as_their_folders(sets: tuple[Path, Path], tmp_path: Path) -> None:
    zips = [zip_of(folder, tmp_path / f"{folder.name}.zip") for folder in sets]
    expected, _, _ = pair_files(*sets)
    found, only_a, only_b = pair_files(*zips)
    assert [pair.name for pair in found] == [pair.name for pair in expected] and not only_a and not only_b
    assert found[0].a == f"{zips[0]}/00.png"
    assert score_pairs(mean_abs, found, **OPTIONS) == score_pairs(mean_abs, expected, **OPTIONS)


def test_every_pair_of_an_array_and_a_tar_shard_score_as_the_folders(sets: tuple[Path, Path], tmp_path: Path) -> None:
    folder = sets[0]
    expected = score_pairs(mean_abs, pairs_within(folder), **OPTIONS)
    array = tmp_path / "samples.npz"
    np.savez(array, arr_0=np.stack([np.asarray(Image.open(file)) for file in sorted(folder.iterdir())]))
    shard = tmp_path / "shard.tar"
    with tarfile.open(shard, "w") as tar:
        for file in sorted(folder.iterdir()):
            tar.add(file, f"{file.stem}.png")
    for archive in (array, shard):
        pairs = pairs_within(archive)
        assert len(pairs) == 10
        assert score_pairs(mean_abs, pairs, **OPTIONS) == expected


def test_a_folder_pairs_with_an_archive_of_the_same_names(sets: tuple[Path, Path], tmp_path: Path) -> None:
    archive = zip_of(sets[1], tmp_path / "b.zip")
    pairs, _, _ = pair_files(sets[0], archive)
    assert score_pairs(mean_abs, pairs, **OPTIONS) == score_pairs(mean_abs, pair_files(*sets)[0], **OPTIONS)


def test_a_plain_file_is_not_a_set_of_images(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("no images")
    with pytest.raises(InputNotFoundError, match="is not a folder or an archive"):
        pairs_within(text)


def test_the_command_scores_every_pair_of_a_zip_as_of_its_folder(
    lpips_trunks: None, sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = zip_of(sets[0], tmp_path / "a.zip")
    lines = []
    for source in (sets[0], archive):
        assert main(["lpips", str(source), "--all-pairs", "--workers", "0", "--device", "cpu", "-q"]) == 0
        lines.append(capsys.readouterr().out.strip().splitlines()[-1])
    assert lines[0] == lines[1] and lines[0].endswith(" over 10 pairs")
