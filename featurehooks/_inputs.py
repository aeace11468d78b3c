"""What a ``FeatureExtractor`` does to images before its backbone: the checks no cast can fix, the one-time
range check, and the normalization buffers that map ``input_range`` to what the weights expect."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .errors import InvalidTypeError, InvalidValueError

__all__ = ["RangeCheck", "check_channels", "check_images", "normalization"]

# Values this far outside input_range (as a fraction of its width) are almost surely the wrong scale.
_RANGE_SLACK = 0.1


class RangeCheck:
    """The check that images lie in ``input_range``: it looks at the first non-empty batch only (each call would
    sync the device) and warns when values lie far outside; ``deferred`` leaves it to a later batch."""

    def __init__(self, input_range: tuple[float, float]) -> None:
        self.input_range = input_range
        self.done = False

    def __call__(self, images: Tensor) -> None:
        if not self.done and images.numel() and not torch.compiler.is_compiling():
            self.done = True  # checked once: a per-call check would sync the device every step
            low, high = self.input_range
            slack = _RANGE_SLACK * (high - low)
            found_low, found_high = (float(v) for v in torch.aminmax(images.detach()))
            if found_low < low - slack or found_high > high + slack:
                warnings.warn(
                    f"images span [{found_low:.3g}, {found_high:.3g}] but input_range={self.input_range}; "
                    "pass the range your images use, e.g. input_range=(0, 255) or (-1, 1)",
                    stacklevel=2,  # called by the extractor's forward: the warning points there
                )

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Forwards inside the block are not the sample: the check stays as it was before the block."""
        done, self.done = self.done, True
        try:
            yield
        finally:
            self.done = done


def check_images(
    images: Tensor, in_channels: int | None, input_range: tuple[float, float], device: torch.device
) -> None:
    """Raise before any compute for what no cast can fix: not a tensor, shape, integer dtype, channels, device."""
    if not isinstance(images, Tensor):
        raise InvalidTypeError(f"expected a torch.Tensor of images, got {type(images).__name__}")
    if images.dim() != 4:
        raise InvalidValueError(
            f"expected images of shape (batch, {in_channels or 'channels'}, height, width), "
            f"got shape {tuple(images.shape)}"
        )
    if not images.is_floating_point():
        raise InvalidTypeError(
            f"expected floating-point images in input_range={input_range}, got {images.dtype}; "
            "convert with images.float() (and divide uint8 by 255 for input_range=(0, 1))"
        )
    check_channels(images.shape[1], in_channels)
    if images.device != device:
        raise InvalidValueError(
            f"images are on {images.device} but the extractor is on {device}; "
            "move one of them, e.g. images.to(extractor.mean.device)"
        )


def check_channels(channels: int, in_channels: int | None) -> None:
    """Refuse images whose channel count is not the backbone's (``None``: any), with a hint for grayscale."""
    if in_channels is not None and channels != in_channels:
        hint = "; repeat grayscale with images.expand(-1, 3, -1, -1)" if channels == 1 else ""
        raise InvalidValueError(f"expected {in_channels} channels, got {channels}{hint}")


def normalization(
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    channels: int,
    input_range: tuple[float, float],
    like: Tensor,
) -> tuple[Tensor, Tensor]:
    """``(mean, std)`` of shape ``(1, C, 1, 1)`` in the units of ``input_range``, so that normalizing is one
    ``(x - mean) / std``, with ``like``'s dtype and device; 0 and 1 over ``channels`` where none is given."""
    low, high = input_range
    mean_t = torch.tensor(mean if mean is not None else [0.0] * channels).to(like)
    std_t = torch.tensor(std if std is not None else [1.0] * channels).to(like)
    return (low + mean_t * (high - low)).view(1, -1, 1, 1), (std_t * (high - low)).view(1, -1, 1, 1)
