"""Statistics of shards (``shard=(i, n)``: jobs that share nothing) and ``merge_statistics``: the parts of a job
array, as objects or files, join into one process's statistics to float64 rounding; a shard records itself in its
file, is never compared as a whole set, and a merge that cannot give the whole set's statistics is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from featurehooks.errors import FeatureHooksError, InvalidTypeError
from featurehooks.metrics import (
    FeatureStatistics,
    feature_statistics,
    feature_statistics_by_layer,
    frechet_distance,
    merge_statistics,
)

from helpers import tiny_extractor

OPTIONS = {"batch_size": 2, "num_workers": 0, "resize_size": 16, "crop_size": 16}


def relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def folder(png_folder: Callable[..., Path]) -> Path:
    return png_folder(11, size=(20, 24))


def parts(folder: Path, count: int = 3, **kwargs: object) -> list[FeatureStatistics]:
    ext = tiny_extractor()
    options = {**OPTIONS, **kwargs}
    return [feature_statistics(ext, folder, layer="relu1", keep=5, shard=(i, count), **options) for i in range(count)]


def test_parts_merge_into_the_statistics_of_one_process(folder: Path, tmp_path: Path) -> None:
    whole = feature_statistics(tiny_extractor(), folder, layer="relu1", keep=5, **OPTIONS)
    found = parts(folder)
    assert [(p.count, p.shard.start, p.shard.stop) for p in found] == [(4, 0, 4), (4, 4, 8), (3, 8, 11)]  # type: ignore[union-attr]
    files = [found[i].save(tmp_path / f"part{i}.npz") for i in (2, 0, 1)]  # files, in any order
    assert str(FeatureStatistics.load(files[0]).shard) == "shard 2/3 (rows 8:11 of 11)"
    saved = FeatureStatistics.load(whole.save(tmp_path / "whole.npz"))  # float32 is not written: read as unknown
    for merged, origin in ((merge_statistics(found), whole.origin), (merge_statistics(files), saved.origin)):
        assert merged.count == whole.count == 11 and merged.shard is None and merged.origin == origin
        assert relative(merged.mean, whole.mean) < 1e-12
        assert relative(merged.covariance, whole.covariance) < 1e-12
        assert merged.features.shape == (5, whole.dim)
        assert frechet_distance(merged, whole) < 1e-9  # a whole set again: comparable
    assert all(part.shard is not None for part in found)  # the caller's parts are left as they were


def test_every_layer_of_one_pass_records_the_shard(folder: Path) -> None:
    found = feature_statistics_by_layer(tiny_extractor(), folder, layers=["relu1", "conv2"], shard=(1, 2), **OPTIONS)
    assert {str(stats.shard) for stats in found.values()} == {"shard 1/2 (rows 6:11 of 11)"}


def test_a_shard_is_never_compared_or_merged_as_a_whole_set(folder: Path) -> None:
    first, second = parts(folder, count=2)
    with pytest.raises(FeatureHooksError, match=r"one holds shard 0/2 \(rows 0:6 of 11\) only; join the shards"):
        frechet_distance(first, second)
    with pytest.raises(FeatureHooksError, match="joined by merge_statistics"):
        first.merge(second)


@pytest.fixture(scope="module")
def refused(folder: Path, png_folder: Callable[..., Path]) -> dict[str, FeatureStatistics]:
    """Parts for the refusals: the shards of 3 and of 2, shard 1/3 pooled otherwise, of another set, and a whole set."""
    found = dict(zip(("0/3", "1/3", "2/3"), parts(folder)))
    found |= dict(zip(("0/2", "1/2"), parts(folder, count=2)))
    ext = tiny_extractor()
    found["max"] = feature_statistics(ext, folder, layer="relu1", pool="max", keep=5, shard=(1, 3), **OPTIONS)
    found["other set"] = parts(png_folder(12, size=(20, 24)))[1]
    found["whole"] = feature_statistics(ext, folder, layer="relu1", keep=5, **OPTIONS)
    return found


REFUSALS = {
    "overlap": (["0/2", "1/3", "2/3"], r"parts\[0\] \(shard 0/2 \(rows 0:6 of 11\)\) and parts\[1\] .* overlap"),
    "missing": (["0/3", "2/3"], r"rows 4:8 of the 11 are in no part; missing: shard 1/3"),
    "twice": (["0/3", "1/3", "1/3", "2/3"], r"parts\[1\] and parts\[2\] are both shard 1/3"),
    "settings": (["0/3", "max", "2/3"], r"parts\[1\] was computed otherwise than parts\[0\] \(pool 'max' vs 'avg'\)"),
    "other set": (
        ["0/3", "other set", "2/3"],
        r"parts\[1\] is a shard of another image set than parts\[0\] \(12 images",
    ),
    "whole": (["0/3", "whole"], r"parts\[1\] holds the statistics of a whole set, not of a shard"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_merge_that_cannot_give_the_whole_set_is_refused_in_one_line(
    refused: dict[str, FeatureStatistics], case: str
) -> None:
    names, expected = REFUSALS[case]
    with pytest.raises(FeatureHooksError, match=expected) as info:
        merge_statistics([refused[name] for name in names])
    assert "\n" not in str(info.value)


def test_a_statistics_file_given_twice_or_no_parts_are_refused(
    refused: dict[str, FeatureStatistics], tmp_path: Path
) -> None:
    path = refused["0/3"].save(tmp_path / "part0.npz")
    with pytest.raises(FeatureHooksError, match="given twice"):
        merge_statistics([path, path, refused["1/3"], refused["2/3"]])
    with pytest.raises(FeatureHooksError, match="no parts given"):
        merge_statistics([])
    with pytest.raises(InvalidTypeError, match="a list of statistics files"):
        merge_statistics(path)  # type: ignore[arg-type]


def test_a_file_with_an_unfit_shard_is_refused(refused: dict[str, FeatureStatistics], tmp_path: Path) -> None:
    path = refused["1/3"].save(tmp_path / "part1.npz")
    with np.load(path) as archive:
        members = {name: archive[name] for name in archive.files}
    members["meta"] = np.array(str(members["meta"]).replace('"rows": [4, 8]', '"rows": [8, 4]'))
    np.savez(path, **members)
    with pytest.raises(FeatureHooksError, match="meta is malformed .*shard .* out of range"):
        FeatureStatistics.load(path)
