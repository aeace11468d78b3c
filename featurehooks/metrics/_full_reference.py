"""What the calibrated full-reference metrics (``LPIPS``, ``DISTS``) share: where their learned weights come from,
their extractor, and the features of an image pair."""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union

import torch
from torch import Tensor

from ..backbones import BackboneSpec
from ..errors import InvalidTypeError, InvalidValueError
from ..extractor import FeatureExtractor, LayerSpec

T = TypeVar("T")
CalibrationFile = Union[str, "os.PathLike[str]", Mapping[str, Tensor]]
Features = dict[str, Tensor]
# FeatureExtractor options a metric sets itself: its calibration was fitted on NCHW maps of its own layers, of images
# normalized its way, with gradients through them.
_SET_BY_THE_METRIC = ("mode", "mean", "std", "normalize", "output_format", "return_prefix_tokens", "prefix_tokens")


def package_dir(name: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it; None when it is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


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


def metric_extractor(
    metric: str, backbone: BackboneSpec, layers: LayerSpec, options: Mapping[str, Any], **settings: Any
) -> FeatureExtractor:
    """The frozen ``mode="grad"`` extractor of ``metric``: its own ``settings``, then the user's ``FeatureExtractor``
    ``options`` (``memory_format``, ``precision``, ...), refusing by name any that would change the features."""
    keywords = [p.name for p in inspect.signature(FeatureExtractor).parameters.values() if p.kind is p.KEYWORD_ONLY]
    forwarded = [name for name in keywords if name not in _SET_BY_THE_METRIC and name not in settings]
    for name in options:
        if name in _SET_BY_THE_METRIC or name in settings:
            raise InvalidTypeError(
                f"{metric} sets {name}= itself (its calibration was fitted on the features it computes); drop it"
            )
        if name not in forwarded:
            raise InvalidTypeError(
                f"{metric} takes no option {name}=; the FeatureExtractor options it passes on are {forwarded}"
            )
    return FeatureExtractor(backbone, layers, mode="grad", **settings, **options)


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
