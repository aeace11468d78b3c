"""Bad input gets a one-line error (or, for the value range, a warning) naming what would be right."""

from __future__ import annotations

import warnings

import pytest
import torch

import featurehooks as fh


@pytest.fixture(scope="module")
def extractor(vgg16_cached) -> fh.FeatureExtractor:
    return fh.FeatureExtractor("vgg16", ["relu1_2"])


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_not_four_dimensional(extractor: fh.FeatureExtractor) -> None:
    with pytest.raises(ValueError) as info:
        extractor(torch.rand(3, 32, 32))
    assert "(batch, 3, height, width)" in one_line(info) and "(3, 32, 32)" in one_line(info)


def test_wrong_channel_count_and_grayscale_hint(extractor: fh.FeatureExtractor) -> None:
    with pytest.raises(ValueError) as info:
        extractor(torch.rand(1, 1, 32, 32))
    assert "expected 3 channels, got 1" in one_line(info) and "expand(-1, 3, -1, -1)" in one_line(info)
    with pytest.raises(ValueError, match="expected 3 channels, got 4$"):
        extractor(torch.rand(1, 4, 32, 32))


def test_integer_images_are_refused(extractor: fh.FeatureExtractor) -> None:
    with pytest.raises(TypeError) as info:
        extractor(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))
    assert "torch.uint8" in one_line(info) and "float" in one_line(info)


def test_not_a_tensor(extractor: fh.FeatureExtractor) -> None:
    with pytest.raises(TypeError, match="ndarray"):
        extractor(torch.rand(1, 3, 8, 8).numpy())


def test_values_far_outside_input_range_warn_once(vgg16_cached) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu1_2"])
    with pytest.warns(UserWarning, match=r"input_range=\(0.0, 1.0\).*\(0, 255\)"):
        extractor(torch.rand(1, 3, 16, 16) * 255)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extractor(torch.rand(1, 3, 16, 16) * 255)  # checked on the first call only: no sync per step


def test_values_inside_input_range_do_not_warn(vgg16_cached) -> None:
    extractor = fh.FeatureExtractor("vgg16", ["relu1_2"], input_range=(-1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        extractor(torch.rand(1, 3, 16, 16) * 2 - 1)


def test_bad_input_range() -> None:
    with pytest.raises(ValueError, match="low < high"):
        fh.FeatureExtractor("alexnet", ["features.0"], weights=None, input_range=(1, 0))
