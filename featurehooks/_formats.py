"""Memory formats: which one a forward runs in, and the rule ``"auto"`` decides by.

``"auto"`` never changes what NCHW code would give beyond float32 rounding, and never in a graph:

- A forward that builds a graph runs NCHW, so input gradients are bitwise those of the NCHW code a user
  ports. Channels-last convolutions round differently, and ReLU/max-pool ties and L1 signs turn that into
  input gradients a few % of their largest element apart (VGG, ResNet): a speed-up that changes numbers is
  opt-in (``memory_format="channels_last"``).
- A forward without a graph runs channels-last on CPUs and CUDA devices for a backbone whose 2-D
  convolutions do most of the work up to the deepest requested layer (``ConvWork.share``, counted in FLOPs by
  the meta trace) when each convolution weight is used at least ``MIN_REUSE`` times in one image's forward
  (``ConvWork.reuse``), and when the backbone runs channels-last on the meta device up to there
  (``Trace.runs_channels_last``, checked once, at construction): a forward runs once, in
  the format chosen before it, and never again in another after a failure. Only the images are converted:
  a channels-last forward then converts each weight again, a cost that grows with the weights while the
  gain grows with the work done on them. ``benchmarks/memory_formats.py --sizes`` measured channels-last
  1.1–1.9x *slower* than NCHW on the CPU for ResNet-18/50 at small images (each weight used 10–500 times),
  and 0.65–0.92x NCHW's time from about 1000 uses per weight on (VGG16, ResNets at >= 540 px, DenseNet,
  EfficientNet, RegNet, MobileNet). ViT, Swin and ConvNeXt (share 0.01–0.09) stay NCHW: their work is in
  matrix products.

A rule rather than a timed probe: it is decided the same way in every process and rank, costs nothing at
call time, and depends on one image's size, not on the batch, so every image of a size runs in one format
whatever batch it falls in (a resumed dump writes the bytes an uninterrupted one would). On CUDA,
channels-last is cuDNN's documented fast path for convolutions; ``benchmarks/run_gpu.sh`` measures both
formats there.
"""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

import torch
from torch import Tensor

from ._trace import ConvWork
from .errors import InvalidValueError

__all__ = [
    "MEMORY_FORMATS",
    "TORCH_FORMATS",
    "ConvWork",
    "MemoryFormat",
    "auto_format",
    "channels_last_pays",
    "check_memory_format",
    "in_format",
]

MemoryFormat = Literal["auto", "channels_last", "contiguous"]
MEMORY_FORMATS: tuple[str, ...] = get_args(MemoryFormat)  # the names, spelled once
TORCH_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
# A backbone whose convolutions do at least this share of the FLOPs runs channels-last under "auto".
CONV_SHARE = 0.5
# Each convolution weight must be used at least this often in one image's forward for "auto" to run it
# channels-last: below, channels-last measured slower on the CPU, since every channels-last forward converts the
# weights again (benchmarks/memory_formats.py --sizes; docs/concepts.md#memory-formats).
MIN_REUSE = 1000
# Devices whose convolution kernels were measured (CPU) or are documented (cuDNN) faster in channels_last.
CHANNELS_LAST_DEVICES = ("cpu", "cuda")


def check_memory_format(memory_format: object) -> None:
    if memory_format not in MEMORY_FORMATS:
        raise InvalidValueError(f"memory_format must be 'auto', 'channels_last' or 'contiguous', not {memory_format!r}")


def auto_format(work: ConvWork | None, device_type: str, shape: tuple[int, ...]) -> str:
    """The format ``"auto"`` runs a forward without a graph in: channels-last for a convolutional backbone
    (a convolution share of at least ``CONV_SHARE``) on a device where it was measured faster, when
    ``channels_last_pays`` for images of ``shape``; NCHW otherwise."""
    if work is None or work.share < CONV_SHARE or device_type not in CHANNELS_LAST_DEVICES:
        return "contiguous"
    return "channels_last" if channels_last_pays(work, shape) else "contiguous"


def channels_last_pays(work: ConvWork, shape: tuple[int, ...]) -> bool:
    """Whether each convolution weight is used often enough in the forward of one image of ``shape``
    (B, C, H, W) for channels-last to pay: at least ``MIN_REUSE`` times.

    A channels-last forward converts every convolution's weights again, a cost that grows with the weights,
    while what it saves grows with the work on them. It looks at one image, not at the batch: every image of
    a given size runs in one format whatever batch it falls in (a dump's rows do not depend on where a
    resume cut the batches), and larger batches only favour channels-last more.
    """
    return work.reuse(shape[-2], shape[-1]) >= MIN_REUSE


def in_format(images: Tensor, memory_format: str) -> Tensor:
    """``images`` laid out in ``memory_format`` (no copy when they are), their gradient in their own layout."""
    layout = TORCH_FORMATS[memory_format]
    if images.is_contiguous(memory_format=layout):
        return images
    if images.requires_grad and torch.is_grad_enabled():
        return cast(Tensor, _AsFormat.apply(images, layout))
    return images.contiguous(memory_format=layout)


class _AsFormat(torch.autograd.Function):
    """Images in another memory layout whose gradient comes back in the images' own layout: code that
    ``.view``s an input gradient (gradient penalties) must not see the backbone's format. The context is set
    apart from the forward, so ``torch.func.grad`` takes it too."""

    generate_vmap_rule = True

    @staticmethod
    def forward(images: Tensor, layout: torch.memory_format) -> Tensor:
        return images.contiguous(memory_format=layout)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, torch.memory_format], output: Tensor) -> None:
        images = inputs[0]
        ctx.own = torch.channels_last if images.is_contiguous(memory_format=torch.channels_last) else None

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.contiguous(memory_format=ctx.own or torch.contiguous_format), None
