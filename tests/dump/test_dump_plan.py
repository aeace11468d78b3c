"""Dump planning and running: bounded workers, changed inputs refused, best-effort progress, errors across ranks."""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from featurehooks import FeatureExtractor, dump_features
from featurehooks._stream import loader
from featurehooks._stream.sharding import Distributed
from featurehooks.errors import LayerNotFoundError

from dump_helpers import mark_unfinished
from helpers import write_pngs

SIZE = 16


def extractor() -> FeatureExtractor:
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3, stride=2), relu=nn.ReLU()))
    return FeatureExtractor(net, ["relu"])


def images(folder: Path, count: int = 6) -> Path:
    return write_pngs(folder, count, (SIZE, SIZE))


def dump(source: object, out: Path, **kwargs: object):
    options = {"batch_size": 2, "num_workers": 0, "progress": False, "resize_size": SIZE, "crop_size": SIZE}
    return dump_features(extractor(), source, out, **{**options, **kwargs})


def test_workers_are_bounded_by_cores_and_batches() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    assert loader.loader_workers(100_000, 3) == 3
    assert loader.loader_workers(100_000, 10_000) == 4 * cores
    assert loader.loader_workers(0, 5) == 0
    assert loader.loader_workers(None, 0) == 0


def test_an_absurd_worker_count_still_dumps(tmp_path: Path) -> None:
    result = dump(images(tmp_path / "in", 4), tmp_path / "out", num_workers=100_000)
    assert result.manifest.status == "complete" and result.num_rows == 4


def test_resume_refuses_input_files_changed_since_the_dump_began(tmp_path: Path) -> None:
    folder = images(tmp_path / "in")
    out = tmp_path / "out"
    dump(folder, out)
    assert (out / "inputs.npy").is_file()
    mark_unfinished(out, [(0, 0, 2)]).close_arrays()
    replaced = folder / "1.png"
    buffer = io.BytesIO()
    Image.new("RGB", (SIZE + 4, SIZE)).save(buffer, format="PNG")
    replaced.write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match=r"1 input file\(s\) changed .*1\.png"):
        dump(folder, out, resume=True)
    touched = folder / "4.png"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    with pytest.raises(ValueError, match=r"2 input file\(s\) changed .*1\.png, .*4\.png"):
        dump(folder, out, resume=True)


def test_resume_with_unchanged_inputs_is_byte_identical(tmp_path: Path) -> None:
    folder = images(tmp_path / "in")
    whole = dump(folder, tmp_path / "whole")
    out = tmp_path / "out"
    dump(folder, out)
    store = mark_unfinished(out, [(1, 2, 4)])
    store.close_arrays()
    resumed = dump(folder, out, resume=True)
    assert resumed.manifest.status == "complete"
    assert resumed.path("relu").read_bytes() == whole.path("relu").read_bytes()


class _ClosedStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.close()


def test_a_closed_stderr_never_stops_a_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _ClosedStream())
    result = dump(images(tmp_path / "in"), tmp_path / "out", progress=True)
    assert result.manifest.status == "complete"


class _Failing(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_failing_stderr_never_stops_a_dump(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", _Failing())
    result = dump(images(tmp_path / "in"), tmp_path / "out", progress=True)
    assert result.manifest.status == "complete"


class _Unusual(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def _fail(error: Exception) -> None:
    raise error


def test_errors_keep_their_type_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # rank 0 of two, planning: what broadcast_object_list does to what it sends is a pickle round trip
    monkeypatch.setattr(Distributed, "broadcast", lambda self, value: pickle.loads(pickle.dumps(value)))
    ranks = Distributed(rank=0, world_size=2)
    for error in (FileExistsError("taken"), LayerNotFoundError("no such layer"), OSError(28, "No space left")):
        with pytest.raises(Exception) as caught:
            ranks.from_main(partial(_fail, error))
        assert type(caught.value) is type(error) and str(caught.value) == str(error)
    with pytest.raises((RuntimeError, _Unusual), match="3: x"):  # an exception that does not unpickle
        ranks.from_main(partial(_fail, _Unusual(3, "x")))


def test_the_result_says_how_many_rows_this_call_computed(tmp_path: Path) -> None:
    folder = images(tmp_path / "in", 5)
    out = tmp_path / "out"
    assert dump(folder, out).rows_computed == 5
    assert dump(folder, out, resume=True).rows_computed == 0
    mark_unfinished(out, [(0, 0, 2), (2, 4, 5)]).close_arrays()
    assert dump(folder, out, resume=True).rows_computed == 2


class Labelled(torch.utils.data.Dataset):
    """(image, label) items; item 2 cannot be read."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if index == 2:
            raise OSError("cannot read item 2")
        return torch.full((3, SIZE, SIZE), index / 10), 10 + index


def test_labels_of_an_image_label_dataset_are_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = dump(Labelled(), out)
    assert result.labels().tolist() == [10, 11, -1, 13, 14]
    assert result.manifest.settings.inputs.labelled and result.manifest.to_dict()["labels"] == "labels.npy"
    mark_unfinished(out, [(0, 0, 2)]).close_arrays()
    resumed = dump(Labelled(), out, resume=True)
    assert resumed.labels().tolist() == [10, 11, -1, 13, 14]
    plain = dump(torch.rand(3, 3, SIZE, SIZE), tmp_path / "plain")
    assert not plain.manifest.settings.inputs.labelled and "labels" not in plain.manifest.to_dict()
    assert not (tmp_path / "plain" / "labels.npy").exists()
    with pytest.raises(FileNotFoundError, match="no labels"):
        plain.labels()


def _sized(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i, (width, height) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def test_pooled_features_of_images_of_different_sizes_are_each_computed(tmp_path: Path) -> None:
    from featurehooks.images import read_image, transform_for

    folder = _sized(tmp_path / "in", [(16, 16), (24, 16), (16, 32), (16, 16), (20, 28)])
    result = dump(folder, tmp_path / "out", pool="avg", resize_size=None, crop_size=None, batch_size=3)
    assert result.skipped == [] and result.num_rows == 5
    ext = extractor()
    transform = transform_for(ext.preprocessing, ext.input_range, None, None)
    for row in range(5):
        image = transform(read_image(folder / f"{row}.png"))[None]
        expected = ext(image)["relu"].mean(dim=(2, 3))[0].numpy()
        np.testing.assert_allclose(result.load("relu")[row], expected, rtol=1e-5, atol=1e-6)


def test_feature_maps_of_images_of_different_sizes_are_refused_while_planning(tmp_path: Path) -> None:
    folder = _sized(tmp_path / "in", [(16, 16), (16, 16), (24, 16)])
    with pytest.raises(ValueError, match=r"different sizes .*0\.png is 16x16 and .*2\.png is 24x16"):
        dump(folder, tmp_path / "out", resize_size=None, crop_size=None)
    assert not (tmp_path / "out" / "relu.npy").exists()
    same = dump(_sized(tmp_path / "same", [(16, 16), (16, 16)]), tmp_path / "ok", resize_size=None, crop_size=None)
    assert same.load("relu").shape == (2, 4, 7, 7)
