"""FeatureExtractor: a frozen backbone that returns the named features you ask for (``capture``, for your own
module, is in ``featurehooks._capture``)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ._capture import Mode, check_mode, refuse_torchscript
from ._compute import ComputePolicy, KeepsPrecision
from ._formats import MemoryFormat
from ._hooks import ClosedOnExit
from ._inputs import RangeCheck, check_channels, check_images, normalization
from ._layout import Layout, prefix_tokens_of
from ._outputs import (
    OutputFormat,
    as_maps,
    check_format,
    check_prefix_names,
    layouts_of,
    returned_layouts,
)
from ._precision import Precision
from ._tap_session import TapSession
from ._taps import Site, Taps
from ._trace import ConvWork, Trace, fixed_input_size, trace, trace_images
from .backbones import BackboneSpec, Preprocessing, WeightsSpec, load_backbone
from .errors import InvalidTypeError, InvalidValueError
from .layers import FeatureInfo, LayerIndex, LayerSpec, describe

__all__ = ["FeatureExtractor", "LayerSpec", "MemoryFormat", "OutputFormat", "Precision"]


def _check_normalize(normalize: object, mean: object, std: object) -> None:
    if not isinstance(normalize, bool):
        raise InvalidTypeError(f"normalize must be True or False, not {normalize!r}")
    if not normalize and (mean is not None or std is not None):
        raise InvalidValueError("normalize=False feeds images as they are: it takes no mean or std")


def _floating_tensor(model: nn.Module) -> Tensor:
    """The model's first floating-point parameter or buffer (an empty float tensor for none): its dtype and device."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t for t in tensors if t.is_floating_point()), torch.empty(0))


def _traced(
    model: nn.Module, size: int | tuple[int, int], in_channels: int | None, taps: Taps, count_conv: bool
) -> tuple[Trace | None, int | None, str]:
    """The one meta trace of ``model`` with the channels it takes, or, for a model that cannot run on meta tensors
    (its real forwards are checked instead), None, the backbone's channels and why."""
    try:
        found, channels = trace_images(model, size, in_channels, watch=taps.sites, count_conv=count_conv)
    except Exception as exc:  # the model cannot run on meta tensors: real forwards are checked instead
        return None, in_channels, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return found, channels, ""


def _state_sha256(model: nn.Module) -> str:
    """SHA-256 of ``model``'s state dict: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        value = tensor.detach()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}\n".encode())
        digest.update(value.reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
    return digest.hexdigest()


class FeatureExtractor(KeepsPrecision, ClosedOnExit):
    """A frozen pretrained backbone that returns the named intermediate features you ask for.

    The backbone is built (or deep-copied, for an ``nn.Module``), loaded, frozen and pinned to eval mode, held
    outside the module tree (a parent's ``.train()`` or ``state_dict()`` never reaches it; ``.to()`` moves it),
    and its forward stops once every requested layer has run. The reasoning behind each option is in
    ``docs/concepts.md``; speed in ``docs/performance.md``.

    Args:
        backbone: torchvision model name (``"vgg16"``), ``"timm/<name>"``, or an ``nn.Module``.
        layers: names to return (aliases such as ``"relu3_3"``, module paths such as ``"layer3"``), or a dict
            ``{"module.path": "output_name"}`` that renames outputs.
        weights: ``"DEFAULT"``, a weights enum member name, ``None`` (random init), or a local weights file.
        mode: ``"detach"`` returns features without a graph; ``"grad"`` keeps the graph to the input.
        input_range: the value range of the images you pass, e.g. ``(0, 1)``, ``(-1, 1)`` or ``(0, 255)``.
        mean: per-channel mean for images scaled to [0, 1]; overrides the weights' normalization.
        std: per-channel std for images scaled to [0, 1]; overrides the weights' normalization.
        normalize: ``False`` feeds images to the backbone exactly as you pass them (no mean/std, no range map).
        early_exit: stop the forward after the deepest requested layer (turn off only to measure).
        output_format: ``"native"`` (module outputs as they are) or ``"nchw"`` (maps and tokens as ``(B, C, H, W)``).
        return_prefix_tokens: with ``"nchw"``, also return each token layer's prefix tokens as ``"<name>.prefix"``.
        prefix_tokens: how many tokens lead the patch tokens, for your own modules that do not say.
        memory_format: ``"auto"`` (never changes NCHW results beyond float32 rounding), ``"channels_last"`` or
            ``"contiguous"``; ``memory_format_in_use`` says what the latest forward ran in.
        precision: what the backbone computes in: ``"float32"`` (default), ``"bf16"`` or ``"fp16"``.

    ``input_size`` is the only ``(H, W)`` the backbone takes where it fixes one (timm ViTs with a strict image size,
    torchvision's ViT), else None. ``output_layouts`` tells the layout of each returned output. Features keep their
    logical shape whatever the memory format (a channels-last forward returns channels-last strides). Grayscale
    input is an error rather than silently repeated: pass ``x.expand(-1, 3, -1, -1)``.

    Shape:
        input: ``(B, C, H, W)`` float in ``input_range``; output: dict of the requested features.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> ext = FeatureExtractor("vgg16", ["relu2_2", "relu3_3"], weights=None)  # random weights: offline
        >>> {k: tuple(v.shape) for k, v in ext(torch.rand(1, 3, 64, 64)).items()}
        {'relu2_2': (1, 128, 32, 32), 'relu3_3': (1, 256, 16, 16)}
    """

    mean: Tensor
    std: Tensor
    _model: nn.Module

    def __init__(
        self,
        backbone: BackboneSpec,
        layers: LayerSpec,
        *,
        weights: WeightsSpec = "DEFAULT",
        mode: Mode = "detach",
        input_range: tuple[float, float] = (0.0, 1.0),
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        normalize: bool = True,
        early_exit: bool = True,
        output_format: OutputFormat = "native",
        return_prefix_tokens: bool = False,
        prefix_tokens: int | None = None,
        memory_format: MemoryFormat = "auto",
        precision: Precision = "float32",
    ) -> None:
        super().__init__()
        check_mode(mode)
        check_format(output_format, return_prefix_tokens, prefix_tokens)
        policy = ComputePolicy(memory_format, precision)
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise InvalidValueError(f"input_range must be (low, high) with low < high, got {input_range}")
        _check_normalize(normalize, mean, std)
        if isinstance(backbone, nn.Module):
            refuse_torchscript(backbone, (), "FeatureExtractor")
        loaded = load_backbone(
            backbone,
            weights,
            mean=tuple(mean) if mean is not None else None,
            std=tuple(std) if std is not None else None,
        )
        model = loaded.model.eval().requires_grad_(False)
        object.__setattr__(self, "_model", model)  # outside the module tree: see the class docstring
        self.backbone_name = loaded.name
        self.weights = loaded.weights
        # what forward does to the images: nothing at all with normalize=False
        self.preprocessing: Preprocessing = (
            loaded.preprocessing if normalize else dataclasses.replace(loaded.preprocessing, mean=None, std=None)
        )
        self.normalizes = normalize
        self.mode: Mode = mode
        self.input_range = (low, high)
        self.early_exit = early_exit
        self.output_format: OutputFormat = output_format
        self.return_prefix_tokens = return_prefix_tokens
        self._prefix_tokens = prefix_tokens if prefix_tokens is not None else prefix_tokens_of(model)
        index = LayerIndex(model, loaded.name)
        self.taps = index.taps(layers)
        check_prefix_names(self.taps.names, return_prefix_tokens)
        self.input_size = fixed_input_size(model)
        size = self.input_size or self.preprocessing.crop_size or 224
        # auto uses channels-last only without a graph (or in bf16/fp16), so only such an extractor under auto counts
        # the convolution work for it, in its one meta trace
        count_conv = policy.counts_conv(graph=mode == "grad")
        found, self.in_channels, self._untraced = _traced(model, size, loaded.in_channels, self.taps, count_conv)
        self._layouts: dict[str, Layout] | None = None
        self._returned_layouts: dict[str, Layout] = {}
        if found is not None:
            index.check_calls(self.taps, found)
            self._set_layouts({tap.name: found.outputs[tap.site].shape for tap in self.taps}, found.input_shape)
        self._trace: Trace | None = found
        self._policy = policy
        self._register_normalization(self.preprocessing)
        # the convolution work of what the forward runs (None: not counted, or no evidence that channels-last runs)
        policy.weigh(found, self._stop_site, model)
        policy.settle_format(model)
        self._format: str = policy.weights_format
        self._range = RangeCheck(self.input_range)
        # the private copy: copies of the extractor copy its taps; in-place ReLUs after taps run out of place
        self._session: TapSession[None] = TapSession(
            model, self.taps, detach=mode == "detach", stop_early=early_exit, owns_model=True
        )
        self._session.prepare(found)  # may run the trace again, on the float32 model: cast after it
        policy.settle_precision(model)

    @property
    def precision(self) -> Precision:
        """What the backbone computes in: ``"float32"``, ``"bf16"`` or ``"fp16"`` (fixed at construction)."""
        return self._policy.precision

    @property
    def memory_format(self) -> MemoryFormat:
        """How the backbone's activations lie in memory: ``"auto"``, ``"channels_last"`` or ``"contiguous"``
        (fixed at construction; ``memory_format_in_use`` says which format the latest forward ran in)."""
        return self._policy.memory_format

    @property
    def backbone(self) -> nn.Module:
        """The frozen model (not a registered submodule, so it stays out of ``state_dict()``)."""
        return self._model

    def _register_normalization(self, pre: Preprocessing) -> None:
        """Buffers ``mean``/``std`` in the units of ``input_range`` (0 and 1 with ``normalize=False``), with the
        backbone's device and dtype (float32 under bf16/fp16, ``KeepsPrecision``); they follow ``.to()``."""
        low_high = self.input_range if self.normalizes else (0.0, 1.0)
        channels = len(pre.mean) if pre.mean is not None else (self.in_channels or 1)
        like = _floating_tensor(self._model)
        like = like if self.precision == "float32" else like.float()
        mean, std = normalization(pre.mean, pre.std, channels, low_high, like)
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("std", std, persistent=False)
        self._normalizes = pre.mean is not None or low_high != (0.0, 1.0)

    @functools.cached_property
    def _stop_site(self) -> Site | None:
        """The module call after which the forward stops: the deepest requested one with early exit, else None
        (all of the model runs). Read from the trace, so None for an untraced model too."""
        if self._trace is None or not self.early_exit:
            return None
        return self._trace.last(self.taps.sites)

    @property
    def conv_work(self) -> ConvWork | None:
        """The convolution work of what the forward runs, which ``memory_format="auto"`` decides by (``share`` of the
        FLOPs in convolutions, ``reuse`` of each weight per image); None where not counted or channels-last fails."""
        return self._policy.conv_work

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the backbone computes in, and that of the features it returns: ``bfloat16``/``float16`` for
        ``precision="bf16"``/``"fp16"``, else ``dtype`` (float32 unless the extractor was cast with ``.half()`` ...)."""
        return self._policy.compute_dtype(self.mean.dtype)

    def memory_format_for(self, shape: Sequence[int], *, graph: bool | None = None) -> str:
        """``"channels_last"`` or ``"contiguous"``: the format a forward of images of ``shape`` runs in.

        ``graph`` says whether the forward builds a graph (default: it does in ``mode="grad"``). Under ``"auto"``, a
        float32 forward with a graph runs NCHW; others run channels-last where ``conv_work`` says it pays.
        """
        graph = self.mode == "grad" if graph is None else graph
        return self._policy.format_for(tuple(shape), graph=graph, device_type=self.mean.device.type)

    def activation_bytes(self, height: int, width: int) -> int | None:
        """Bytes of the largest module output per image of ``height x width`` in what the forward runs (up to
        the deepest requested layer with early exit: what one image keeps hot in the cache; dumps size their
        CPU micro-batches by it). None for a model that could not be traced."""
        if self._trace is None:
            return None
        last = self._trace.outputs[self._stop_site].order if self._stop_site is not None else math.inf
        traced = self._trace.input_shape
        largest = max(
            (math.prod(out.shape) for out in self._trace.outputs.values() if out.shape and out.order <= last),
            default=0,
        )
        return largest * height * width * self.compute_dtype.itemsize // (traced[0] * traced[-2] * traced[-1])

    @property
    def memory_format_in_use(self) -> str:
        """``"channels_last"`` or ``"contiguous"``: the format of the latest forward (the forced one before any;
        ``"contiguous"`` under ``"auto"``)."""
        return self._format

    @property
    def layers(self) -> list[str]:
        """Output names in request order."""
        return self.taps.names

    def _set_layouts(self, shapes: dict[str, tuple[int, ...] | None], input_shape: tuple[int, ...]) -> None:
        """The layout of each tap, and of what ``forward`` returns, from the taps' output shapes."""
        self._layouts = layouts_of(self._model, shapes, input_shape, self._prefix_tokens, self.output_format)
        self._returned_layouts = returned_layouts(self._layouts, self.output_format, self.return_prefix_tokens)

    @property
    def output_layouts(self) -> dict[str, Layout]:
        """The layout of each returned output, by name (after ``output_format``; ``"<name>.prefix"``
        outputs are ``"NLC"`` tokens that are all prefix tokens). Worked out once, from the trace."""
        if self._layouts is None:
            raise self._untraced_error("the layouts of its outputs are known after its first forward")
        return dict(self._returned_layouts)

    @functools.cached_property
    def feature_info(self) -> list[FeatureInfo]:
        """Layout, channels and stride of each requested layer, in request order (from the meta trace)."""
        if self._trace is None:
            raise self._untraced_error(
                "its layers have no metadata before a real forward; look at the shapes of the features it returns"
            )
        rows = {(row.path, row.call): row for row in describe(self._model, self._trace, self.backbone_name)}
        return [rows[tap.site] for tap in self.taps]

    def _untraced_error(self, consequence: str) -> RuntimeError:
        """The error of a question only the meta trace answers, for a backbone that cannot run on the meta device."""
        return RuntimeError(f"{self.backbone_name} cannot run on the meta device ({self._untraced}), so {consequence}")

    # -- what input pipelines ask (dumps, feature statistics): answered here, never read from private fields --
    @property
    def device(self) -> torch.device:
        """The device the extractor computes on: that of its normalization buffers, which follow ``.to()``."""
        return self.mean.device

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype images are cast to before the backbone runs (its buffers', which follow ``.half()``)."""
        return self.mean.dtype

    def output_shapes(self, input_shape: Sequence[int]) -> dict[str, tuple[int, ...] | None]:
        """The shape of each output ``forward`` returns for images of ``input_shape`` ``(B, C, H, W)``, by name and
        in order (``None`` for an output that is not a single tensor), read from a meta trace: nothing is computed.

        The trace made at construction answers for its own input shape; any other shape is traced again on the
        meta device (milliseconds, no memory). ``output_format`` applies: ``"nchw"`` gives maps (and prefixes).

        Raises:
            InvalidValueError: ``input_shape`` is not ``(B, C, H, W)`` with the channels the backbone takes.
            RuntimeError: the backbone cannot run on the meta device (its shapes are known from a real forward).
            Exception: what the backbone raises on meta tensors of this shape (a size it refuses).

        Examples:
            >>> from featurehooks import FeatureExtractor
            >>> ext = FeatureExtractor("vgg16", ["relu2_2", "relu3_3"], weights=None)
            >>> ext.output_shapes((4, 3, 64, 64))
            {'relu2_2': (4, 128, 32, 32), 'relu3_3': (4, 256, 16, 16)}
        """
        shape = tuple(int(size) for size in input_shape)
        if len(shape) != 4:
            raise InvalidValueError(f"input_shape must be (batch, channels, height, width), got {shape}")
        check_channels(shape[1], self.in_channels)
        if self._trace is None:
            raise self._untraced_error("the shapes of its outputs are known from a real forward only")
        found = self._trace
        if found.input_shape != shape:
            found = trace(self._model, (torch.empty(shape, dtype=self.compute_dtype),), eval_mode=True)
        shapes = {tap.name: found.outputs[tap.site].shape for tap in self.taps}
        if self.output_format == "native":
            return shapes
        outputs = {name: None if size is None else torch.empty(size, device="meta") for name, size in shapes.items()}
        maps = as_maps(outputs, self._layouts or {}, (shape[-2], shape[-1]), self.return_prefix_tokens)
        return {name: tuple(value.shape) if isinstance(value, Tensor) else None for name, value in maps.items()}

    @property
    def range_checked(self) -> bool:
        """Whether the check that images lie in ``input_range`` has run: it looks at the first non-empty batch only
        (each call would sync the device) and warns when values lie far outside."""
        return self._range.done

    def assume_in_range(self) -> contextlib.AbstractContextManager[None]:
        """A block whose forwards skip the range check, for images in range by construction (a probe of constant
        values): the check then looks at the first real batch after the block, as if the block never ran."""
        return self._range.deferred()

    def weights_sha256(self) -> str:
        """SHA-256 of the backbone's state dict (names, dtypes, shapes and bytes), recorded by dumps and feature
        statistics: ``weights`` alone cannot tell two checkpoints of a user's module, or two seeds of a random
        init, apart."""
        return _state_sha256(self._model)

    # -- end of what input pipelines ask ------------------------------------------------------------------------

    def _kept_precision(self) -> str:
        """Under ``precision="bf16"``/``"fp16"``, ``.to()``, ``.half()``, ``.cuda()``, ... only move: the backbone
        keeps its dtype and the normalization float32, never rounded through another dtype."""
        policy = getattr(self, "_policy", None)
        return policy.precision if policy is not None else "float32"

    def _apply_outside(self, fn: Callable[[Tensor], Tensor]) -> None:
        self._model._apply(fn)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        if hasattr(self, "_format"):  # a stray .to(memory_format=...) must not undo a forced format
            self._policy.settle_format(self._model)

    def normalize(self, images: Tensor) -> Tensor:
        """Map images from ``input_range`` to what the backbone's weights expect."""
        return (images - self.mean) / self.std if self._normalizes else images

    def forward(self, images: Tensor) -> dict[str, Tensor]:
        """Return ``{name: feature}`` for the requested layers, in request order.

        Images of any floating dtype are cast to the extractor's (that of its buffers, which follow ``.half()``
        and ``.to()``): no copy when they agree, and gradients still reach a float64 input in ``mode="grad"``.
        Under autocast the backbone's ops choose their own precision, as usual, unless ``precision`` is
        ``"bf16"`` or ``"fp16"``: then the normalized images are cast to it and the backbone runs in it.
        """
        if not self._session.active:
            raise RuntimeError("this FeatureExtractor was closed; create a new one")
        check_images(images, self.in_channels, self.input_range, self.mean.device)
        self._range(images)
        grad = self.mode == "grad" and torch.is_grad_enabled()
        x = self.normalize(images.to(self.mean.dtype))
        chosen = self.memory_format_for(x.shape, graph=grad)  # a local: threads sharing the extractor decide apart
        with torch.set_grad_enabled(grad):
            features = self._policy.run(self._backbone_forward, x, chosen)
        self._format = chosen
        if self._layouts is None:  # an untraced model: layouts from its first real forward
            shapes = {name: tuple(v.shape) if isinstance(v, Tensor) else None for name, v in features.items()}
            self._set_layouts(shapes, tuple(images.shape))
        if self.output_format == "nchw":
            return as_maps(
                features, self._layouts or {}, (images.shape[-2], images.shape[-1]), self.return_prefix_tokens
            )
        return features

    def _backbone_forward(self, images: Tensor) -> dict[str, Any]:
        """The session's forward of the backbone on images already normalized, cast and laid out."""
        return self._session.run(self._model, images)

    def close(self) -> None:
        """Remove every hook from the backbone; the extractor cannot be called afterwards."""
        self._session.remove()

    def extra_repr(self) -> str:
        layout = "" if self.output_format == "native" else f", output_format={self.output_format!r}"
        prefix = ", return_prefix_tokens=True" if self.return_prefix_tokens else ""
        memory = "" if self.memory_format == "auto" else f", memory_format={self.memory_format!r}"
        precision = "" if self.precision == "float32" else f", precision={self.precision!r}"
        raw = "" if self.normalizes else ", normalize=False"
        return (
            f"backbone={self.backbone_name!r}, weights={self.weights!r}, layers={self.layers}, "
            f"mode={self.mode!r}, input_range={self.input_range}{raw}{layout}{prefix}{memory}{precision}"
        )
