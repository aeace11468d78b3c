"""The streaming options (``StreamOptions``): one set of defaults and one check, taken by every streaming entry
point and declared once on the command line."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import featurehooks as fh
from featurehooks._stream import Streaming
from featurehooks.cli import build_parser
from featurehooks.cli._common import stream_options
from featurehooks.errors import InvalidTypeError, InvalidValueError
from featurehooks.metrics import (
    feature_statistics,
    feature_statistics_by_layer,
    fid_extractor,
    fid_statistics,
    score_pairs,
)

from helpers import tiny_extractor, write_pngs

OPTIONS = ("batch_size", "num_workers", "resize_size", "crop_size", "progress")


@pytest.fixture(scope="module")
def models() -> tuple[fh.FeatureExtractor, fh.FeatureExtractor]:
    return tiny_extractor(), fid_extractor(weights=None, dims=64, device="cpu")


def _entry_points(
    tmp_path: Path, models: tuple[fh.FeatureExtractor, fh.FeatureExtractor]
) -> dict[str, Callable[..., Any]]:
    """Each streaming entry point, called on a source that does not exist: options are checked before it is read."""
    extractor, fid = models
    missing = str(tmp_path / "no such folder")
    return {
        "dump_features": lambda **options: fh.dump_features(extractor, missing, tmp_path / "out", **options),
        "feature_statistics": lambda **options: feature_statistics(extractor, missing, pool="avg", **options),
        "feature_statistics_by_layer": lambda **options: feature_statistics_by_layer(
            extractor, missing, pool="avg", **options
        ),
        "fid_statistics": lambda **options: fid_statistics(missing, extractor=fid, **options),
        "score_pairs": lambda **options: score_pairs(
            lambda a, b: (a - b).abs().mean((1, 2, 3)), [("x", "y")], **options
        ),
    }


@pytest.mark.parametrize(
    "name", ["dump_features", "feature_statistics", "feature_statistics_by_layer", "fid_statistics", "score_pairs"]
)
def test_every_entry_point_takes_the_options_and_nothing_else(name: str) -> None:
    function = {
        "dump_features": fh.dump_features,
        "feature_statistics": feature_statistics,
        "feature_statistics_by_layer": feature_statistics_by_layer,
        "fid_statistics": fid_statistics,
        "score_pairs": score_pairs,
    }[name]
    parameters = inspect.signature(function).parameters
    assert not set(OPTIONS) & set(parameters)  # no entry point restates an option with a default of its own
    assert parameters["options"].kind is inspect.Parameter.VAR_KEYWORD


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"batchsize": 8}, InvalidTypeError, "did you mean 'batch_size'"),
        ({"workers": 2}, InvalidTypeError, "did you mean 'num_workers'"),
        ({"frobnicate": 1}, InvalidTypeError, "the streaming options are batch_size, num_workers"),
        ({"batch_size": 0}, InvalidValueError, "batch_size must be a positive int"),
        ({"batch_size": True}, InvalidValueError, "batch_size must be a positive int"),
        ({"batch_size": "8"}, InvalidValueError, "batch_size must be a positive int"),
        ({"num_workers": -1}, InvalidValueError, "num_workers must be an int >= 0"),
        ({"num_workers": False}, InvalidValueError, "num_workers must be an int >= 0"),
        ({"resize_size": 0}, InvalidValueError, "resize_size must be a positive int, None or 'weights'"),
        ({"crop_size": "center"}, InvalidValueError, "crop_size must be a positive int, None or 'weights'"),
        ({"crop_size": 2.5}, InvalidValueError, "crop_size must be a positive int, None or 'weights'"),
        ({"progress": "yes"}, InvalidTypeError, "progress must be True or False"),
        ({"batch_pixels": 0}, InvalidValueError, "batch_pixels must be a positive int"),
        ({"batch_pixels": 2.5}, InvalidValueError, "batch_pixels must be a positive int"),
    ],
)
def test_a_bad_option_is_refused_alike_by_every_entry_point_before_any_input_is_read(
    tmp_path: Path,
    models: tuple[fh.FeatureExtractor, fh.FeatureExtractor],
    options: dict[str, Any],
    error: type[Exception],
    words: str,
) -> None:
    for name, call in _entry_points(tmp_path, models).items():
        with pytest.raises(error, match=words.replace("(", r"\(")):
            call(**options)
        assert not (tmp_path / "out").exists(), name


def test_one_set_of_defaults() -> None:
    assert Streaming.of({}) == Streaming(64, None, "weights", "weights", False)
    assert Streaming.of({"resize_size": None, "progress": True}) == Streaming(resize_size=None, progress=True)


def _parsed(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["extract", "x", "--out", "o", "--backbone", "vgg16", "--layers", "relu1_1"],
        ["stats", "x", "--out", "o.npz", "--backbone", "vgg16", "--layers", "relu1_1"],
        ["fd", "a", "b", "--backbone", "vgg16", "--layers", "relu1_1"],
        ["fid", "a", "b"],
        ["lpips", "a", "b"],
        ["dists", "a", "b"],
    ],
)
def test_the_command_line_defaults_are_the_librarys(argv: list[str]) -> None:
    args = _parsed(argv)
    assert (args.batch_size, args.workers, args.quiet, args.seed, args.device) == (64, None, False, 0, "auto")
    given = _parsed([*argv, "--batch-size", "3", "--num-workers", "2", "-q"])
    assert (given.batch_size, given.workers, given.quiet) == (3, 2, True)
    if argv[0] != "fid":  # FID resizes inside its network only
        assert (args.resize, args.crop) == (..., ...)  # not given: the library's "weights"
        given = _parsed([*argv, "--resize", "none", "--crop", "8"])
        assert (given.resize, given.crop) == (None, 8)


@pytest.mark.parametrize("argv", [["extract", "x", "--out", "o"], ["stats", "x", "--out", "o.npz"], ["fd", "a", "b"]])
def test_every_image_streaming_command_takes_a_pixel_budget(argv: list[str]) -> None:
    model = ["--backbone", "vgg16", "--layers", "relu1_1"]
    for command in ([*argv, *model], ["fid", "a", "b"]):
        assert stream_options(_parsed(command))["batch_pixels"] == Streaming.batch_pixels == 2**24
        assert stream_options(_parsed([*command, "--batch-pixels", "1000"]))["batch_pixels"] == 1000
        assert stream_options(_parsed([*command, "--batch-pixels", "none"]))["batch_pixels"] is None


def test_pairs_keep_their_size_by_default_and_resize_on_request(tmp_path: Path) -> None:
    folder = write_pngs(tmp_path / "a", count=2, size=(40, 44))
    files = sorted(str(path) for path in folder.iterdir())
    seen: list[tuple[int, ...]] = []

    def metric(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(a.shape))
        return (a - b).abs().flatten(1).mean(1)

    pairs = [(files[0], files[1])]
    score_pairs(metric, pairs, num_workers=0)
    score_pairs(metric, pairs, num_workers=0, resize_size=20, crop_size=16)
    assert seen == [(1, 3, 40, 44), (1, 3, 16, 16)]


def test_a_module_without_preprocessing_streams_at_the_images_size(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    extractor = fh.FeatureExtractor(net, ["2"], mode="detach")
    images = torch.rand(5, 3, 12, 12)
    stats = feature_statistics(extractor, images, pool=None, batch_size=2, num_workers=0)
    with torch.no_grad():
        expected = net(images).double()
    torch.testing.assert_close(stats.mean, expected.mean(0), rtol=0, atol=1e-7)


def test_a_precision_the_device_cannot_run_is_refused_before_any_input_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from featurehooks import _precision

    monkeypatch.setattr(_precision, "unsupported", lambda precision, kind, index: "no bfloat16 here")
    bf16 = tiny_extractor(precision="bf16")
    fid = fid_extractor(weights=None, dims=64, device="cpu", precision="bf16")
    missing = str(tmp_path / "no such folder")  # listed first, it would raise InputNotFoundError
    calls = [
        lambda: fh.dump_features(bf16, missing, tmp_path / "out"),
        lambda: feature_statistics(bf16, missing, layer="relu1"),
        lambda: feature_statistics_by_layer(bf16, missing),
        lambda: fid_statistics(missing, extractor=fid),
    ]
    for call in calls:
        with pytest.raises(InvalidValueError, match="precision='bf16' cannot run on cpu: no bfloat16 here"):
            call()
    assert not (tmp_path / "out").exists()
