"""Memory formats: which one a forward runs in, and the evidence ``"auto"`` decides by.

``"auto"`` never changes what NCHW code would give beyond float32 rounding, and never in a graph:

- A forward that builds a graph runs NCHW, so input gradients are bitwise those of the NCHW code a user
  ports. Channels-last convolutions round differently, and ReLU/max-pool ties and L1 signs turn that into
  input gradients a few % of their largest element apart (VGG, ResNet): a speed-up that changes numbers is
  opt-in (``memory_format="channels_last"``).
- A forward without a graph runs channels-last on CPUs and CUDA devices for a backbone whose 2-D
  convolutions do most of the work up to the deepest requested layer (``ConvWork.share``, counted in FLOPs
  on the meta device, where the channels-last forward must also run) when each convolution weight is used
  at least ``MIN_REUSE`` times in one image's forward (``ConvWork.reuse``). Only the images are converted:
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

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ._copy import meta_copy
from ._taps import Site
from ._trace import STATE, drop_hooks
from .errors import InvalidValueError

__all__ = [
    "MEMORY_FORMATS",
    "TORCH_FORMATS",
    "MemoryFormat",
    "auto_format",
    "channels_last_pays",
    "check_memory_format",
    "ConvWork",
    "conv_work",
    "deepest",
]

MemoryFormat = Literal["auto", "channels_last", "contiguous"]
MEMORY_FORMATS: tuple[str, ...] = ("auto", "channels_last", "contiguous")
TORCH_FORMATS = {"channels_last": torch.channels_last, "contiguous": torch.contiguous_format}
# A backbone whose convolutions do at least this share of the FLOPs runs channels-last under "auto".
CONV_SHARE = 0.5
# Each convolution weight must be used at least this often in one image's forward for "auto" to run it
# channels-last (benchmarks/memory_formats.py --sizes): below, ResNets and VGG16 up to relu5_3 measured up to
# 1.9x slower in it on the CPU, since every channels-last forward converts the weights again.
MIN_REUSE = 1000
# Devices whose convolution kernels were measured (CPU) or are documented (cuDNN) faster in channels_last.
CHANNELS_LAST_DEVICES = ("cpu", "cuda")
_CONVOLUTIONS = ("convolution", "_convolution", "conv2d", "cudnn_convolution")


def check_memory_format(memory_format: object) -> None:
    if memory_format not in MEMORY_FORMATS:
        raise InvalidValueError(f"memory_format must be 'auto', 'channels_last' or 'contiguous', not {memory_format!r}")


class _Stop(BaseException):
    """Raised by the hook on the deepest requested call: nothing after it runs in the extractor either.
    A BaseException, as the session's own stop: a model's ``except Exception`` must not swallow it."""


@dataclass(frozen=True)
class ConvWork:
    """What ``"auto"`` decides by, counted once on the meta device up to the deepest requested layer.

    ``share``: the share of FLOPs in convolutions. ``reuse_per_pixel``: multiply-adds of the convolutions
    per weight element, per image and per input pixel; times an image's pixels it says how often each
    convolution weight is used in a forward of one image.
    """

    share: float
    reuse_per_pixel: float

    def reuse(self, height: int, width: int) -> float:
        """How often a convolution weight is used, on average, in the forward of one ``height x width`` image."""
        return self.reuse_per_pixel * height * width


def conv_work(model: nn.Module, input_shape: tuple[int, ...], stop_at: Site | None) -> ConvWork | None:
    """The convolution work of a channels-last forward on the meta device, up to the call ``stop_at`` (the
    deepest requested layer); None when that forward fails in channels-last (a ``.view`` that needs NCHW
    strides) or does no FLOPs at all."""
    copied = meta_copy(model).to(memory_format=torch.channels_last)
    dtype = next((p.dtype for p in copied.parameters() if p.is_floating_point()), torch.float32)
    images = torch.empty(input_shape, dtype=dtype, device="meta").contiguous(memory_format=torch.channels_last)
    calls: dict[str, int] = {}

    def stop(path: str, *_: Any) -> None:
        calls[path] = calls.get(path, 0) + 1
        if stop_at is not None and (path, calls[path] - 1) == stop_at:
            raise _Stop

    ran: dict[int, int] = {}  # id -> weight elements of the convolution modules that ran

    def note(module: nn.Module, _args: Any, output: Any) -> Any:
        ran[id(module)] = module.weight.numel()
        return _channels_last_output(output)

    for module in copied.modules():
        if isinstance(module, nn.Conv2d):  # meta convolutions return NCHW strides; CPU and cuDNN ones do not
            module.register_forward_hook(note)
    if stop_at is not None:
        dict(copied.named_modules())[stop_at[0]].register_forward_hook(partial(stop, stop_at[0]))
    counter = FlopCounterMode(display=False)
    STATE.active, was_tracing = True, STATE.active
    try:
        with torch.no_grad(), counter:
            copied.eval()(images)
    except _Stop:
        pass
    except Exception:  # noqa: BLE001 - any failure means: no evidence that channels-last runs
        return None
    finally:
        STATE.active = was_tracing
        drop_hooks(copied)
    counts = counter.get_flop_counts().get("Global", {})
    total = sum(counts.values())
    convolutions = sum(flops for op, flops in counts.items() if _op_name(op) in _CONVOLUTIONS)
    if not total:
        return None
    weights = sum(ran.values())
    pixels = input_shape[0] * input_shape[-2] * input_shape[-1]
    return ConvWork(convolutions / total, convolutions / 2 / weights / pixels if weights else 0.0)


def _channels_last_output(output: Any) -> Any:
    """A convolution's output with the channels-last strides the real kernels give it, so that a later
    ``.view`` that needs NCHW strides fails on the meta device as it would on the real one."""
    is_map = isinstance(output, torch.Tensor) and output.dim() == 4
    return output.contiguous(memory_format=torch.channels_last) if is_map else output


def _op_name(op: Any) -> str:
    """``aten.convolution.default`` -> ``convolution``."""
    return str(getattr(op, "__name__", op)).split(".")[0]


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


def deepest(sites: Collection[Site], order: dict[Site, int]) -> Site | None:
    """The site of ``sites`` that fires last (None without sites)."""
    return max(sites, key=lambda site: order[site], default=None)
