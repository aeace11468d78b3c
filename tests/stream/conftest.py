"""Fixtures of the stream tests."""

from __future__ import annotations

import pytest
import torch

import featurehooks as fh
from featurehooks._stream import forward as stream_forward


@pytest.fixture
def micro_batch_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of images of each forward the stream runs (each micro-batch), in order, as they run."""
    sizes: list[int] = []
    part = stream_forward._part_as_arrays

    def counted(extractor: fh.FeatureExtractor, images: torch.Tensor, *rest: object) -> object:
        sizes.append(len(images))
        return part(extractor, images, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(stream_forward, "_part_as_arrays", counted)
    return sizes
