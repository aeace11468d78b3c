"""Dumps of archives and arrays end to end: a killed dump of a ZIP or of tar shards resumes to the bytes of one run,
a replaced archive is noticed on resume, rows decode from their names alone (decoding workers, other torchrun
ranks), and the command line takes an ``.npz`` and a ``.zip`` where it takes a folder."""

from __future__ import annotations

import io
import os
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks import dump_features
from featurehooks._stream import members, resolve_inputs
from featurehooks._stream.sources import _SharedInputs
from featurehooks.cli import main
from featurehooks.metrics import FeatureStatistics

from dump_helpers import mark_unfinished, scribble
from helpers import TINY_CLI_MODEL, tiny_extractor

OPTIONS = {"batch_size": 2, "num_workers": 0, "progress": False, "resize_size": 36, "crop_size": 32}
CLI = [*TINY_CLI_MODEL, "--workers", "0", "-q"]


def pixels(count: int = 5, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 40, 44, 3), dtype=np.uint8)


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def write_zip(path: Path, images: np.ndarray) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for row, image in enumerate(images):
            archive.writestr(f"samples/{row:02d}.png", png(image))
    return path


def write_shards(folder: Path, images: np.ndarray) -> str:
    """Two WebDataset shards of the images (3 + 2 samples); returns their brace pattern."""
    folder.mkdir()
    for shard, rows in enumerate([range(3), range(3, len(images))]):
        with tarfile.open(folder / f"{shard:06d}.tar", "w") as tar:
            for row in rows:
                data = png(images[row])
                info = tarfile.TarInfo(f"{row:06d}.png")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return f"{folder}/{{000000..000001}}.tar"


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"index.csv", "inputs.npy", "manifest.json", "conv2.npy"} <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("kind", ["zip", "tar shards"])
def test_a_killed_dump_of_an_archive_resumes_to_the_bytes_of_one_run(tmp_path: Path, kind: str) -> None:
    source = write_zip(tmp_path / "x.zip", pixels()) if kind == "zip" else write_shards(tmp_path / "s", pixels())
    ext = tiny_extractor()
    reference = dump_features(ext, source, tmp_path / "ref", **OPTIONS)
    index = (tmp_path / "ref" / "index.csv").read_text().splitlines()
    inside = "x.zip/samples/00.png" if kind == "zip" else "000000.tar/000000"
    assert reference.skipped == [] and index[1] == f"0,1,{tmp_path}/{'' if kind == 'zip' else 's/'}{inside}"
    out = tmp_path / "out"
    dump_features(ext, source, out, **OPTIONS)
    store = mark_unfinished(out, [(1, 2, 4)])  # a kill after chunk 1: chunks 0 and 2 hold garbage
    scribble(store, 0, 2, 5.0)
    scribble(store, 4, 5, -3.0)
    store.close_arrays()
    resumed = dump_features(ext, source, out, resume=True, **OPTIONS)
    assert resumed.rows_computed == 3
    same_files(tmp_path / "ref", out)


def test_a_resume_refuses_an_archive_replaced_since(tmp_path: Path) -> None:
    write_zip(tmp_path / "x.zip", pixels())
    ext = tiny_extractor()
    dump_features(ext, tmp_path / "x.zip", tmp_path / "out", **OPTIONS)
    mark_unfinished(tmp_path / "out", [(0, 0, 2)]).close_arrays()
    identity = np.load(tmp_path / "out" / "inputs.npy")
    stat = os.stat(tmp_path / "x.zip")
    assert (identity == [stat.st_size, stat.st_mtime_ns]).all()  # every row stands for its archive
    write_zip(tmp_path / "x.zip", pixels(seed=1))  # the same names, other pixels
    os.utime(tmp_path / "x.zip", ns=(1, 1))
    with pytest.raises(ValueError, match=r"5 input file\(s\) changed .*x.zip/samples/00.png"):
        dump_features(ext, tmp_path / "x.zip", tmp_path / "out", resume=True, **OPTIONS)


def test_rows_decode_from_their_names_alone(tmp_path: Path) -> None:
    """What torchrun's other ranks and forked decoding workers have: the names rank 0 listed, nothing open."""
    np.savez_compressed(tmp_path / "a.npz", pixels())
    sources = [
        write_zip(tmp_path / "x.zip", pixels(seed=1)),
        tmp_path / "a.npz",
        write_shards(tmp_path / "s", pixels()),
    ]
    ext = tiny_extractor()
    planned = resolve_inputs(ext, sources, 36, 32, None)
    shared = _SharedInputs(planned.names, planned.image_shape, planned.transform, False, False)
    members._open.clear()  # a rank holds no archive open
    theirs = shared.inputs(sources).rows(ext.input_range)
    mine = planned.rows(ext.input_range)
    assert len(theirs) == 15
    for row in range(15):
        assert theirs[row].reason == "" and torch.equal(theirs[row].image, mine[row].image)


def test_decoding_workers_read_archives_as_one_process_does(tmp_path: Path) -> None:
    source = write_shards(tmp_path / "s", pixels())
    ext = tiny_extractor()
    dump_features(ext, source, tmp_path / "one", **OPTIONS)
    dump_features(ext, source, tmp_path / "two", **{**OPTIONS, "num_workers": 2})
    same_files(tmp_path / "one", tmp_path / "two")


def test_the_command_line_takes_an_npz_and_a_zip(tmp_path: Path) -> None:
    images = pixels()
    (tmp_path / "folder").mkdir()
    for row, image in enumerate(images):
        (tmp_path / "folder" / f"{row}.png").write_bytes(png(image))
    np.savez(tmp_path / "samples.npz", images)
    write_zip(tmp_path / "x.zip", images)
    for source in ("folder", "samples.npz", "x.zip"):
        assert main(["extract", str(tmp_path / source), "--out", str(tmp_path / f"dump-{source}"), *CLI]) == 0
    reference = np.load(tmp_path / "dump-folder" / "layer1.npy")
    for source in ("samples.npz", "x.zip"):
        np.testing.assert_array_equal(np.load(tmp_path / f"dump-{source}" / "layer1.npy"), reference)
    rows = (tmp_path / "dump-samples.npz" / "index.csv").read_text().splitlines()[1:]
    assert rows[-1] == f"4,1,{tmp_path}/samples.npz/arr_0/4"
    assert main(["stats", str(tmp_path / "x.zip"), "--out", str(tmp_path / "x.stats.npz"), *CLI]) == 0
    assert FeatureStatistics.load(tmp_path / "x.stats.npz").count == 5
