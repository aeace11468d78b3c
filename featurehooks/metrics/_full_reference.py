"""What the calibrated full-reference metrics (``LPIPS``, ``DISTS``) share: where their learned weights come from,
and the features of an image pair."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar, Union

import torch
from torch import Tensor

from ..errors import InvalidTypeError, InvalidValueError
from ..extractor import FeatureExtractor

T = TypeVar("T")
CalibrationFile = Union[str, "os.PathLike[str]", Mapping[str, Tensor]]
Features = dict[str, Tensor]


def calibration(
    calibrated: bool,
    given: object,
    argument: str,
    *,
    ones: Callable[[], T],
    bundled: Callable[[], tuple[T, str]],
    load: Callable[[CalibrationFile], T],
) -> tuple[T, str]:
    """A metric's learned weights and where they come from: all ones (``calibrated=False``), the file an installed
    package bundles (``given`` is None), or ``given``, a file or state dict; ``argument`` is ``given``'s name."""
    if not calibrated:
        if given is not None:
            raise InvalidValueError(f"{argument}= was given with calibrated=False; the uncalibrated baseline uses none")
        return ones(), "uncalibrated (all ones)"
    if given is None:
        return bundled()
    if isinstance(given, (str, os.PathLike, Mapping)):
        return load(given), "a state dict" if isinstance(given, Mapping) else str(given)
    raise InvalidTypeError(f"{argument} must be a path, a state dict or None, not {type(given).__name__}")


def concatenation_pays(images: Tensor) -> bool:
    """Whether a pair that needs no graph (or two) runs as one concatenated batch: on accelerators only (on the CPU
    two forwards take about as long and less memory; see ``LPIPS``)."""
    return images.device.type != "cpu"


def pair_features(
    extractor: FeatureExtractor, input: Tensor, target: Tensor, concatenate: bool
) -> tuple[Features, Features]:
    """Features of both images: one concatenated forward when ``concatenate`` and both or neither need a graph (and
    the batches match), else two, the one without a graph computed without one."""
    grad = torch.is_grad_enabled()
    input_graph, target_graph = grad and input.requires_grad, grad and target.requires_grad
    same_batch = input.shape[0] == target.shape[0]
    if input_graph == target_graph and same_batch and concatenate:
        both = extractor(torch.cat([input, target.to(input.dtype)]))
        split = {name: value.chunk(2) for name, value in both.items()}
        return {k: v[0] for k, v in split.items()}, {k: v[1] for k, v in split.items()}
    with torch.set_grad_enabled(input_graph):
        first = extractor(input)
    with torch.set_grad_enabled(target_graph):
        second = extractor(target)
    return first, second
