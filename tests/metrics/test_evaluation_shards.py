"""Parts of a statistics set (``evaluate(real, None, shard=(i, n))``: one job of a job array each) and
``merge_statistics_sets``: the parts, as mappings or files, join into the set one process computes (moments to
float64 rounding, counts exact, every kept vector in row order); parts that cannot give it are refused, naming them,
and a shard never stands for a whole set where two sets are compared."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from featurehooks.errors import FeatureHooksError, InvalidTypeError
from featurehooks.metrics import (
    FeatureStatistics,
    evaluate,
    feature_statistics_by_layer,
    load_statistics,
    merge_statistics,
    save_statistics,
)
from featurehooks.metrics.merge import merge_statistics_sets
from featurehooks.metrics.statistics import KEEP_ALL

from helpers import tiny_extractor

pytestmark = pytest.mark.filterwarnings("ignore:.*feature vectors in .* dimensions:UserWarning")
OPTIONS = {"num_workers": 0, "batch_size": 2, "progress": False}
Sets = dict[str, FeatureStatistics]
Pick = Callable[[list[Sets], Sets], list[Sets]]


def relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max())


def check_equal(merged: Sets, expected: Sets) -> None:
    """``merged`` is the set ``expected`` of one process: the same names in order, counts, origins and kept vectors
    (bitwise, in row order), moments to 1e-12."""
    assert list(merged) == list(expected)
    for name, stats in merged.items():
        one = expected[name]
        assert stats.count == one.count and stats.shard is None and stats.origin == one.origin
        assert relative(stats.mean, one.mean) < 1e-12
        assert relative(stats.covariance, one.covariance) < 1e-12
        assert stats.keep == one.keep
        if one.keep:
            assert torch.equal(stats.features, one.features)


@pytest.fixture(scope="module")
def folder(png_folder: Callable[..., Path]) -> Path:
    return png_folder(7, (20, 24), seed=3)


def layer_sets(folder: Path, shard: tuple[int, int] | None = None) -> Sets:
    """A set of two named statistics (layers of a tiny extractor) keeping every vector, as evaluate's do."""
    options = {**OPTIONS, "resize_size": 16, "crop_size": 16, **({"shard": shard} if shard else {})}
    return feature_statistics_by_layer(tiny_extractor(), folder, layers=["relu1", "conv2"], keep=KEEP_ALL, **options)


@pytest.fixture(scope="module")
def whole(folder: Path) -> Sets:
    return layer_sets(folder)


@pytest.fixture(scope="module")
def parts(folder: Path) -> list[Sets]:
    return [layer_sets(folder, (i, 3)) for i in range(3)]


def test_parts_of_a_set_merge_into_the_set_of_one_process(whole: Sets, parts: list[Sets], tmp_path: Path) -> None:
    files = [save_statistics(tmp_path / f"part{i}.npz", parts[i]) for i in (2, 0, 1)]  # files, in any order
    assert str(load_statistics(files[0])["conv2"].shard) == "shard 2/3 (rows 6:7 of 7)"  # whole batches of 2
    check_equal(merge_statistics_sets(parts), whole)
    saved = load_statistics(save_statistics(tmp_path / "whole.npz", whole))  # float32 is not written: unknown
    check_equal(merge_statistics_sets(files), saved)
    assert all(stats.shard is not None for part in parts for stats in part.values())  # the caller's, unchanged


def other_origin(part: Sets) -> Sets:
    changed = copy.copy(part["conv2"])
    changed.origin = replace(changed.origin, pool="max")  # type: ignore[arg-type]
    return {**part, "conv2": changed}


@pytest.mark.parametrize(
    ("pick", "message"),
    [
        (lambda p, w: [p[0], p[1]], r"rows 6:7 of the 7 are in no part; missing: shard 2/3"),
        (lambda p, w: [p[0], p[1], p[2], p[1]], r"parts\[1\]\['relu1'\] and parts\[3\]\['relu1'\] are both shard 1/3"),
        (lambda p, w: [p[0], {"relu1": p[1]["relu1"]}, p[2]], r"parts\[1\] holds the statistics of relu1, parts\[0\]"),
        (lambda p, w: [p[0], other_origin(p[1]), p[2]], r"parts\[1\]\['conv2'\] was computed otherwise .*pool 'max'"),
        (lambda p, w: [w, p[1], p[2]], r"parts\[0\]\['relu1'\] holds the statistics of a whole set, not of a shard"),
        (lambda p, w: [p[0], {"relu1": 1}], r"parts\[1\]\['relu1'\] is a int, not FeatureStatistics"),
        (lambda p, w: p[0], r"parts must be a list of statistics-set files or mappings"),
    ],
)
def test_parts_that_do_not_make_the_set_are_refused_naming_them(
    parts: list[Sets], whole: Sets, pick: Pick, message: str
) -> None:
    with pytest.raises(FeatureHooksError, match=message):
        merge_statistics_sets(pick(parts, whole))


def test_a_file_of_one_statistics_and_a_set_are_merged_each_by_its_own_function(
    parts: list[Sets], tmp_path: Path
) -> None:
    single = parts[0]["relu1"].save(tmp_path / "single.npz")
    set_file = save_statistics(tmp_path / "set.npz", parts[1])
    with pytest.raises(FeatureHooksError, match=f"{single} holds one statistics .* merge_statistics joins"):
        merge_statistics_sets([set_file, single])
    with pytest.raises(FeatureHooksError, match=f"{set_file} holds a set of named statistics .* merge_statistics_sets"):
        merge_statistics([single, set_file])
    with pytest.raises(FeatureHooksError, match="a statistics file is given twice"):
        merge_statistics_sets([set_file, set_file])
    with pytest.raises(InvalidTypeError, match="parts must be a list"):
        merge_statistics_sets(str(set_file))  # type: ignore[arg-type]


def test_shards_are_refused_where_two_sets_are_compared(folder: Path, parts: list[Sets]) -> None:
    with pytest.raises(FeatureHooksError, match="metrics compare two whole sets: shard= is for evaluate"):
        evaluate(folder, folder, ["fd_dinov2"], shard=(0, 2))
    reference = {"dinov2": merge_statistics([part["conv2"] for part in parts])}
    with pytest.raises(FeatureHooksError, match="real is statistics already: pass the images"):
        evaluate(reference, None, ["fd_dinov2"], shard=(0, 2))
    with pytest.raises(FeatureHooksError, match=r"one holds shard 0/3 \(rows 0:4 of 7\) only; join the shards"):
        evaluate({"dinov2": parts[0]["conv2"]}, reference, ["fd_dinov2"])


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A tiny seeded CLIP tower where CLIP ViT-L/14@336's weights are cached."""
    pytest.importorskip("transformers")
    from clip_reference import cached_clip

    with cached_clip(tmp_path_factory.mktemp("hub")):
        yield


@pytest.mark.parametrize(
    "metrics",
    [["cmmd"], pytest.param(["cmmd", "fd_dinov2"], marks=pytest.mark.slow)],  # CLIP's every embedding; DINOv2's moments
)
def test_evaluate_parts_merge_into_the_reference_set_of_one_process(
    folder: Path, clip: None, metrics: list[str], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if "fd_dinov2" in metrics:
        request.getfixturevalue("dinov2_vits14_cached")  # seeded DINOv2 ViT-S/14 weights where evaluate reads them
    options = {**OPTIONS, "dinov2_model": "vits14", "device": "cpu"}
    whole = evaluate(folder, None, metrics, **options).real  # type: ignore[arg-type]
    found = [evaluate(folder, None, metrics, shard=(i, 3), **options).real for i in range(3)]  # type: ignore[arg-type]
    assert {str(stats.shard) for stats in found[1].values()} == {"shard 1/3 (rows 4:6 of 7)"}
    merged = load_statistics(save_statistics(tmp_path / "merged.npz", merge_statistics_sets(found)))
    check_equal(merged, load_statistics(save_statistics(tmp_path / "whole.npz", whole)))
    assert evaluate(merged, whole, metrics, **options).numbers["cmmd"] == 0.0  # type: ignore[arg-type]
