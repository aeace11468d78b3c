"""The three FID lineages: how an image of any size becomes the FID Inception's 299x299 input in [-1, 1].

Papers report FID on the same network and weights (TensorFlow's 2015 Inception) but with one of three
preprocessings, whose numbers differ:

- ``"legacy_pytorch"`` (pytorch-fid): ``F.interpolate(..., mode="bilinear", align_corners=False)`` of the
  [0, 1] image (half-pixel centers, no antialiasing), then ``2x - 1``.
- ``"legacy_tensorflow"`` (TensorFlow's original code, StyleGAN, ADM, EDM, torch-fidelity, torchmetrics,
  clean-fid's ``mode="legacy_tensorflow"``): the ``uint8`` levels 0..255 as floats, resized by TensorFlow 1's
  bilinear rule (source pixel = destination pixel x in / out, no half-pixel offset, no antialiasing), then
  ``(x - 128) / 128``.
- ``"clean"`` (clean-fid's default): the levels 0..255 resized by Pillow's bicubic filter on each channel as a
  float32 ``"F"`` image (antialiased when downscaling), clipped to [0, 255], then ``(x - 128) / 128``.

Images arrive in [0, 1] (``uint8`` pixels divided by 255, which ``x * 255`` gives back exactly in float32). The
two lineages whose reference tools take ``uint8`` only (``legacy_tensorflow``) round other floats to the nearest
level first; ``clean`` takes floats as they are, as clean-fid does for a generator's output.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from ..errors import InvalidValueError, did_you_mean

__all__ = ["DEFAULT_LINEAGE", "FID_SIZE", "LINEAGES", "check_lineage", "fid_input"]

LINEAGES = ("legacy_pytorch", "legacy_tensorflow", "clean")
"""The names of the three FID lineages, as clean-fid names them (``mode=``)."""

DEFAULT_LINEAGE = "legacy_pytorch"
"""pytorch-fid's: the lineage of ``fid_statistics`` by default, and of statistics files that record none."""

FID_SIZE = 299
_LEVELS = 255.0


def check_lineage(name: object) -> str:
    """``name`` if it is one of ``LINEAGES``; else ``InvalidValueError`` naming them and the closest.

    Examples:
        >>> from featurehooks.backbones._fid_resize import check_lineage
        >>> check_lineage("clean")
        'clean'
    """
    if not isinstance(name, str) or name not in LINEAGES:
        hint = did_you_mean(name, LINEAGES) if isinstance(name, str) else ""
        raise InvalidValueError(
            f"unknown FID mode {name!r}: the lineages are {', '.join(map(repr, LINEAGES))}"
            + (f"; {hint}" if hint else "")
        )
    return name


def fid_input(images: Tensor, lineage: str) -> Tensor:
    """The network's input of ``lineage``: ``images`` in [0, 1] resized to 299x299 and scaled to [-1, 1].

    ``legacy_pytorch`` computes in the images' dtype, as pytorch-fid does; the others in float32 (or float64
    for float64 images), returned in the images' dtype.

    Shape:
        images: ``(B, 3, H, W)``; output: ``(B, 3, 299, 299)``.

    Examples:
        >>> import torch
        >>> from featurehooks.backbones._fid_resize import fid_input
        >>> x = torch.full((1, 3, 20, 30), 128 / 255)
        >>> [round(fid_input(x, mode).mean().item(), 4) for mode in ("legacy_tensorflow", "clean")]
        [0.0, 0.0]
    """
    if lineage == "legacy_pytorch":
        resized = F.interpolate(images, size=(FID_SIZE, FID_SIZE), mode="bilinear", align_corners=False)
        return 2 * resized - 1
    wide = images.to(torch.promote_types(images.dtype, torch.float32))
    levels = wide * _LEVELS
    if lineage == "legacy_tensorflow":
        resized = resize_like_tensorflow1(levels.round().clamp(0.0, _LEVELS), FID_SIZE)
    elif lineage == "clean":
        resized = resize_like_clean_fid(levels, FID_SIZE)
    else:
        check_lineage(lineage)
    return ((resized - 128) / 128).to(images.dtype)


def _tensorflow1_grid(size_in: int, size_out: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """TensorFlow 1's source positions for ``align_corners=False``: ``i * in / out`` in float32 (no half-pixel
    offset); the pixel below, the one above (clamped to the edge) and the weight of the one above."""
    position = torch.arange(size_out, dtype=torch.float32, device=device) * torch.tensor(
        size_in / size_out, dtype=torch.float32, device=device
    )
    low = position.long()
    high = (low + 1).clamp_max(size_in - 1)
    return low, high, position - low.float()


def resize_like_tensorflow1(images: Tensor, size: int) -> Tensor:
    """TensorFlow 1's ``tf.image.resize_bilinear(..., align_corners=False)`` of ``(B, C, H, W)`` floats to
    ``size`` x ``size``: interpolated along the width first, then the height, weights in float32.

    The same arithmetic as torch-fidelity's ``interpolate_bilinear_2d_like_tensorflow1x`` (its exact "slow"
    method), which equals TensorFlow's kernel on the CPU.
    """
    height, width = images.shape[-2:]
    rows_low, rows_high, dy = _tensorflow1_grid(height, size, images.device)
    cols_low, cols_high, dx = _tensorflow1_grid(width, size, images.device)
    dx, dy = dx.to(images.dtype), dy.to(images.dtype)

    def along_width(rows: Tensor) -> Tensor:
        left, right = rows.index_select(-1, cols_low), rows.index_select(-1, cols_high)
        return left + (right - left) * dx

    top = along_width(images.index_select(-2, rows_low))
    bottom = along_width(images.index_select(-2, rows_high))
    return top + (bottom - top) * dy.view(-1, 1)


def resize_like_clean_fid(images: Tensor, size: int) -> Tensor:
    """clean-fid's resize of ``(B, C, H, W)`` levels 0..255 to ``size`` x ``size``: Pillow's bicubic filter on
    each channel as a float32 ``"F"`` image, clipped to [0, 255] (``make_resizer("PIL", False, "bicubic", ...)``).

    Pillow computes on the CPU: images elsewhere are copied there and back.
    """
    batch, channels = images.shape[:2]
    if images.device.type == "meta":  # a trace of shapes: no pixels to resize
        return images.new_empty(batch, channels, size, size)
    planes = images.detach().to("cpu", torch.float32).numpy()
    resized = np.empty((batch, channels, size, size), dtype=np.float32)
    for index in np.ndindex(batch, channels):
        plane = Image.fromarray(np.ascontiguousarray(planes[index]), mode="F")
        resized[index] = np.asarray(plane.resize((size, size), resample=Image.Resampling.BICUBIC))
    np.clip(resized, 0.0, _LEVELS, out=resized)
    return torch.from_numpy(resized).to(device=images.device, dtype=images.dtype)
