"""FeatureExtractor: a frozen backbone that returns the named features you ask for (``capture``, for your own
module, is in ``featurehooks._capture``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._capture import Mode, check_mode
from ._compute import ComputePolicy, KeepsPrecision
from ._formats import MemoryFormat
from ._hooks import ClosedOnExit, TapSession
from ._layout import Layout, check_nchw, classify, patch_size_of, prefix_tokens_of, to_nchw
from ._precision import Precision
from ._taps import Site
from ._trace import ConvWork, Trace, fixed_input_size, trace, trace_images
from .backbones import BackboneSpec, Preprocessing, WeightsSpec, load_backbone
from .errors import InvalidTypeError, InvalidValueError
from .layers import FeatureInfo, LayerIndex, LayerSpec, describe

__all__ = ["FeatureExtractor", "LayerSpec", "MemoryFormat", "OutputFormat", "Precision"]

OutputFormat = Literal["native", "nchw"]
# Values this far outside input_range (as a fraction of its width) are almost surely the wrong scale.
_RANGE_SLACK = 0.1


def _check_format(output_format: str, return_prefix_tokens: bool, prefix_tokens: int | None) -> None:
    if output_format not in ("native", "nchw"):
        raise InvalidValueError(f"output_format must be 'native' or 'nchw', not {output_format!r}")
    if return_prefix_tokens and output_format != "nchw":
        raise InvalidValueError(
            "return_prefix_tokens=True goes with output_format='nchw' (native token outputs keep their prefix tokens)"
        )
    if prefix_tokens is not None and (isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int)):
        raise InvalidTypeError(f"prefix_tokens must be a non-negative int or None, not {prefix_tokens!r}")
    if prefix_tokens is not None and prefix_tokens < 0:
        raise InvalidValueError(f"prefix_tokens must be a non-negative int or None, not {prefix_tokens}")


def _check_normalize(normalize: object, mean: object, std: object) -> None:
    if not isinstance(normalize, bool):
        raise InvalidTypeError(f"normalize must be True or False, not {normalize!r}")
    if not normalize and (mean is not None or std is not None):
        raise InvalidValueError("normalize=False feeds images as they are: it takes no mean or std")


def _floating_tensor(model: nn.Module) -> Tensor:
    """The model's first floating-point parameter or buffer (an empty float tensor for none): its dtype and device."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t for t in tensors if t.is_floating_point()), torch.empty(0))


class FeatureExtractor(KeepsPrecision, ClosedOnExit):
    """A frozen pretrained backbone that returns the named intermediate features you ask for.

    The backbone is built (or deep-copied, for an ``nn.Module``), loaded, frozen and pinned to eval
    mode; it is held outside the module tree, so a parent's ``.train()``, ``.apply()`` or
    ``state_dict()`` never reaches it, while ``.to()``/``.cuda()``/``.half()`` move it along.
    The forward stops as soon as every requested layer has run.

    Args:
        backbone: torchvision model name (``"vgg16"``), ``"timm/<name>"``, or an ``nn.Module``.
        layers: names to return (VGG aliases such as ``"relu3_3"`` or module paths such as
            ``"layer3"``), or a dict ``{"module.path": "output_name"}`` that renames outputs.
        weights: ``"DEFAULT"``, a weights enum member name (``"IMAGENET1K_V1"``), ``None`` for random
            init, or a local ``.pth``/``.pt``/``.safetensors`` file (read with ``weights_only=True``).
        mode: ``"detach"`` returns features without a graph; ``"grad"`` keeps the graph to the input
            (for losses) while the backbone's parameters stay frozen.
        input_range: the value range of the images you pass, e.g. ``(0, 1)``, ``(-1, 1)`` or ``(0, 255)``.
        mean: per-channel mean for images scaled to [0, 1]; overrides the weights' normalization.
        std: per-channel std for images scaled to [0, 1]; overrides the weights' normalization.
        normalize: ``False`` feeds images to the backbone exactly as you pass them: no mean/std and no
            mapping of ``input_range`` (which then only serves the out-of-range warning), as code that
            gives a VGG its [-1, 1] images directly does (pix2pixHD).
        early_exit: stop the forward after the deepest requested layer (turn off only to measure).
        output_format: ``"native"`` returns module outputs as they are; ``"nchw"`` returns every map
            and token output as ``(B, C, H, W)``: channels-last maps (Swin) permuted, tokens (ViT)
            without their prefix tokens and reshaped to the patch grid of the images at hand. Both
            are views, no copy. ``(B, C)`` vectors and other outputs are returned as they are.
        return_prefix_tokens: with ``"nchw"``, also return the class/register/distillation tokens of
            each token layer that has some, as ``"<name>.prefix"`` of shape ``(B, P, C)``.
        prefix_tokens: how many tokens lead the patch tokens of the model's token outputs; read
            from the model (timm's ``num_prefix_tokens``, torchvision's ViT), so only needed for
            your own modules that do not say.
        memory_format: how the backbone's 4-D activations lie in memory. ``"auto"`` (default)
            never changes what NCHW code would give beyond float32 rounding, and never in a graph:
            with ``mode="grad"`` it is always ``"contiguous"`` (NCHW), so values and input gradients
            are bitwise those of the NCHW code you port (in float32: with ``precision="bf16"``/``"fp16"``
            the rule of ``mode="detach"`` applies in a graph too); with ``mode="detach"`` it runs a forward in
            ``"channels_last"`` for convolutional backbones where each convolution weight is used
            often enough per image for that to pay (measured: ``featurehooks._formats``; values within
            1e-5 of scale). ``"channels_last"`` and
            ``"contiguous"`` force a format (channels-last in a graph rounds input gradients
            differently, up to a few % of their largest element on VGG/ResNet).
            ``memory_format_in_use`` says which format the latest forward ran in.
        precision: what the backbone computes in: ``"float32"`` (default: the backbone as it is, and an
            enclosing ``torch.autocast`` applies as usual), ``"bf16"`` or ``"fp16"``. The frozen
            backbone is stored once in that dtype (its parameters and buffers; ``compute_dtype``)
            and runs with any enclosing autocast off; normalization and the cast of the images stay
            in float32 (a later ``.to()``/``.half()``/``.float()`` moves the extractor between devices
            but changes neither dtype). Features come back in that dtype; losses and metrics reduce them in float32;
            gradients reach the images in the images' dtype. Faster where the device has the
            kernels (bf16 on an AVX512-BF16 CPU: VGG16 relu3_3 at 4x224 1.9x in inference, 2.5x
            in a loss step), with values that round differently (losses and metrics within
            0.25% of float32 on photos: ``docs/performance.md``); a device
            without them is refused at the first forward (fp16 on a CPU without AVX512-FP16/AMX-FP16,
            where it is emulated and slower; bf16 on a GPU older than compute capability 8.0). fp16
            gradients below 6e-8 become 0: scale the loss as ``torch.amp.GradScaler`` does, or use bf16
            (``docs/performance.md``).

    ``output_layouts`` tells the layout of each returned output.

    Features keep their logical shape whatever the memory format: a ``(B, C, H, W)`` map of a
    channels-last backbone has channels-last strides (``.is_contiguous(memory_format=
    torch.channels_last)``); call ``.contiguous()`` where NCHW memory is needed (``.numpy()``
    arrays keep the strides too, ``np.ascontiguousarray`` makes them C-ordered). Gradients with
    respect to the images keep the images' own memory format. Values agree with NCHW to float32
    rounding (the kernels sum in another order).

    Grayscale input is an error rather than silently repeated: pass ``x.expand(-1, 3, -1, -1)``.

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
        _check_format(output_format, return_prefix_tokens, prefix_tokens)
        policy = ComputePolicy(memory_format, precision)
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise InvalidValueError(f"input_range must be (low, high) with low < high, got {input_range}")
        _check_normalize(normalize, mean, std)
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
        self._check_prefix_names()
        size = self.preprocessing.crop_size or 224
        self._untraced = ""
        # auto uses channels-last only without a graph (or in bf16/fp16), so only such an extractor under auto counts
        # the convolution work for it, in its one meta trace
        count_conv = policy.counts_conv(graph=mode == "grad")
        try:
            found, self.in_channels = trace_images(
                model, fixed_input_size(model) or size, loaded.in_channels, watch=self.taps.sites, count_conv=count_conv
            )
        except Exception as exc:  # the model cannot run on meta tensors: real forwards are checked instead
            found, self.in_channels = None, loaded.in_channels
            self._untraced = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self._layouts: dict[str, Layout] | None = None
        self._returned_layouts: dict[str, Layout] = {}
        if found is not None:
            index.check_calls(self.taps, found)
            self._set_layouts({tap.name: found.outputs[tap.site].shape for tap in self.taps}, found.input_shape)
        self._trace: Trace | None = found
        self._policy = policy
        self._register_normalization(self.preprocessing)
        # the convolution work of what the forward runs (None: not counted, or no evidence that channels-last runs)
        policy.conv_work = found.conv_work.get(self._stop_site) if found is not None else None
        policy.settle_format(model)
        self._format: str = policy.weights_format
        self._range_checked = False
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
        """Buffers ``mean``/``std`` in the units of ``input_range``, so forward is one ``(x - mean) / std``.

        They start with the backbone's dtype and device (a user's module may be float64 or on a GPU already)
        and follow ``.to()`` from then on: forward casts images to their dtype and checks their device. Under
        ``precision="bf16"``/``"fp16"`` they are float32 whatever the module's dtype, and stay so
        (``KeepsPrecision``).
        With ``normalize=False`` they are 0 and 1: images reach the backbone as they are.
        """
        low, high = self.input_range if self.normalizes else (0.0, 1.0)
        channels = len(pre.mean) if pre.mean is not None else (self.in_channels or 1)
        like = _floating_tensor(self._model)
        if self.precision != "float32":
            like = like.float()
        mean = torch.tensor(pre.mean if pre.mean is not None else [0.0] * channels).to(like)
        std = torch.tensor(pre.std if pre.std is not None else [1.0] * channels).to(like)
        self.register_buffer("mean", (low + mean * (high - low)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", (std * (high - low)).view(1, -1, 1, 1), persistent=False)
        self._normalizes = pre.mean is not None or (low, high) != (0.0, 1.0)

    @functools.cached_property
    def _stop_site(self) -> Site | None:
        """The module call after which the forward stops: the deepest requested one with early exit, else None
        (all of the model runs). Read from the trace, so None for an untraced model too."""
        if self._trace is None or not self.early_exit:
            return None
        return self._trace.last(self.taps.sites)

    @property
    def _conv_work(self) -> ConvWork | None:
        """The convolution work ``"auto"`` decides by (None: not counted, or no evidence that channels-last runs)."""
        return self._policy.conv_work

    @property
    def _conv_share(self) -> float | None:
        """The share of convolution FLOPs in what the forward runs, as ``"auto"`` counted it (None: not counted)."""
        return self._conv_work.share if self._conv_work is not None else None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the backbone computes in, and that of the features it returns: ``bfloat16``/``float16`` for
        ``precision="bf16"``/``"fp16"``, else ``dtype`` (float32 unless the extractor was cast with ``.half()`` ...)."""
        return self._policy.compute_dtype(self.mean.dtype)

    def memory_format_for(self, shape: Sequence[int], *, graph: bool | None = None) -> str:
        """``"channels_last"`` or ``"contiguous"``: the format a forward of images of ``shape`` runs in.

        ``graph`` says whether the forward builds a graph (default: it does in ``mode="grad"``). Under
        ``"auto"``, a float32 forward that builds a graph always runs NCHW (bitwise the gradients of NCHW
        code); one without, or any forward in ``precision="bf16"``/``"fp16"`` (whose numbers are not NCHW
        code's anyway), runs channels-last where ``featurehooks._formats.channels_last_pays`` says so for
        this backbone, device and shape: in bf16 that made the VGG16 relu3_3 loss step at 4x224 1.24x
        faster than bf16 in NCHW on this project's CPU.
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

    def _check_prefix_names(self) -> None:
        clashes = [f"{name}.prefix" for name in self.taps.names if f"{name}.prefix" in self.taps.names]
        if self.return_prefix_tokens and clashes:
            raise InvalidValueError(f"return_prefix_tokens=True would return {clashes} twice; rename those layers")

    def _set_layouts(self, shapes: Mapping[str, tuple[int, ...] | None], input_shape: tuple[int, ...]) -> None:
        """The layout of each tap from its output shape; with ``"nchw"``, refuse token outputs that cannot
        become maps (their prefix count unknown, or tokens that do not tile the input)."""
        patch = patch_size_of(self._model)
        layouts = {name: classify(shape, input_shape, self._prefix_tokens, patch) for name, shape in shapes.items()}
        if self.output_format == "nchw":
            for name, layout in layouts.items():
                check_nchw(layout, shapes[name] or (), (input_shape[-2], input_shape[-1]), name)
        self._layouts = layouts
        self._returned_layouts = self._after_format(layouts)

    def _after_format(self, layouts: dict[str, Layout]) -> dict[str, Layout]:
        """The layouts of what ``forward`` returns: with ``"nchw"``, token and NHWC taps as maps, plus prefixes."""
        if self.output_format == "native":
            return layouts
        returned: dict[str, Layout] = {}
        for name, layout in layouts.items():
            if layout.kind in ("NHWC", "NLC"):
                returned[name] = Layout("NCHW", layout.channels, layout.stride)
                if self.return_prefix_tokens and layout.kind == "NLC" and layout.prefix_tokens:
                    returned[f"{name}.prefix"] = Layout("NLC", layout.channels, None, layout.prefix_tokens)
            else:
                returned[name] = layout
        return returned

    @property
    def output_layouts(self) -> dict[str, Layout]:
        """The layout of each returned output, by name (after ``output_format``; ``"<name>.prefix"``
        outputs are ``"NLC"`` tokens that are all prefix tokens). Worked out once, from the trace."""
        if self._layouts is None:
            raise RuntimeError(
                f"{self.backbone_name} cannot run on the meta device ({self._untraced}), so the layouts of its "
                "outputs are known after its first forward"
            )
        return dict(self._returned_layouts)

    @functools.cached_property
    def feature_info(self) -> list[FeatureInfo]:
        """Layout, channels and stride of each requested layer, in request order (from the meta trace)."""
        if self._trace is None:
            raise RuntimeError(
                f"{self.backbone_name} cannot run on the meta device ({self._untraced}), so its layers have no "
                "metadata before a real forward; look at the shapes of the features it returns"
            )
        rows = {(row.path, row.call): row for row in describe(self._model, self._trace, self.backbone_name)}
        return [rows[tap.site] for tap in self.taps]

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
        if self.in_channels is not None and shape[1] != self.in_channels:
            hint = "; repeat grayscale with images.expand(-1, 3, -1, -1)" if shape[1] == 1 else ""
            raise InvalidValueError(f"expected {self.in_channels} channels, got {shape[1]}{hint}")
        if self._trace is None:
            raise RuntimeError(
                f"{self.backbone_name} cannot run on the meta device ({self._untraced}), so the shapes of its "
                "outputs are known from a real forward only"
            )
        found = self._trace
        if found.input_shape != shape:
            found = trace(self._model, (torch.empty(shape, dtype=self.compute_dtype),), eval_mode=True)
        shapes = {tap.name: found.outputs[tap.site].shape for tap in self.taps}
        if self.output_format == "native":
            return shapes
        outputs = {name: None if size is None else torch.empty(size, device="meta") for name, size in shapes.items()}
        maps = self._as_maps(outputs, (shape[-2], shape[-1]))
        return {name: tuple(value.shape) if isinstance(value, Tensor) else None for name, value in maps.items()}

    @property
    def range_checked(self) -> bool:
        """Whether the check that images lie in ``input_range`` has run: it looks at the first non-empty batch
        only (each call would sync the device) and warns when values lie far outside.

        Set it to ``True`` before a forward whose images are in range by construction (a probe of constant
        values) so that the check waits for real images, or to ``False`` to have the next batch checked again.
        """
        return self._range_checked

    @range_checked.setter
    def range_checked(self, checked: bool) -> None:
        self._range_checked = bool(checked)

    def weights_sha256(self) -> str:
        """SHA-256 of the backbone's state dict (names, dtypes, shapes and bytes), recorded by dumps and feature
        statistics: ``weights`` alone cannot tell two checkpoints of a user's module, or two seeds of a random
        init, apart."""
        digest = hashlib.sha256()
        for name, tensor in self._model.state_dict().items():
            value = tensor.detach()
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}\n".encode())
            digest.update(value.reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
        return digest.hexdigest()

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

    def _check_input(self, images: Tensor) -> None:
        """Raise before any compute for what no cast can fix: not a tensor, shape, integer dtype, channels, device."""
        if not isinstance(images, Tensor):
            raise InvalidTypeError(f"expected a torch.Tensor of images, got {type(images).__name__}")
        if images.dim() != 4:
            raise InvalidValueError(
                f"expected images of shape (batch, {self.in_channels or 'channels'}, height, width), "
                f"got shape {tuple(images.shape)}"
            )
        if not images.is_floating_point():
            raise InvalidTypeError(
                f"expected floating-point images in input_range={self.input_range}, got {images.dtype}; "
                "convert with images.float() (and divide uint8 by 255 for input_range=(0, 1))"
            )
        if self.in_channels is not None and images.shape[1] != self.in_channels:
            hint = "; repeat grayscale with images.expand(-1, 3, -1, -1)" if images.shape[1] == 1 else ""
            raise InvalidValueError(f"expected {self.in_channels} channels, got {images.shape[1]}{hint}")
        if images.device != self.mean.device:
            raise InvalidValueError(
                f"images are on {images.device} but the extractor is on {self.mean.device}; "
                "move one of them, e.g. images.to(extractor.mean.device)"
            )
        if not self._range_checked and images.numel() and not torch.compiler.is_compiling():
            self._range_checked = True  # checked once: a per-call check would sync the device every step
            self._warn_if_out_of_range(images)

    def _warn_if_out_of_range(self, images: Tensor) -> None:
        low, high = self.input_range
        slack = _RANGE_SLACK * (high - low)
        found_low, found_high = (float(v) for v in torch.aminmax(images.detach()))
        if found_low < low - slack or found_high > high + slack:
            warnings.warn(
                f"images span [{found_low:.3g}, {found_high:.3g}] but input_range={self.input_range}; "
                "pass the range your images use, e.g. input_range=(0, 255) or (-1, 1)",
                stacklevel=3,
            )

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
        self._check_input(images)
        grad = self.mode == "grad" and torch.is_grad_enabled()
        x = self.normalize(images.to(self.mean.dtype))
        chosen = self.memory_format_for(x.shape, graph=grad)  # a local: threads sharing the extractor decide apart
        with torch.set_grad_enabled(grad):
            features, self._format = self._policy.run(self._backbone_forward, x, chosen)
        if self._layouts is None:  # an untraced model: layouts from its first real forward
            shapes = {name: tuple(v.shape) if isinstance(v, Tensor) else None for name, v in features.items()}
            self._set_layouts(shapes, tuple(images.shape))
        if self.output_format == "nchw":
            return self._as_maps(features, (images.shape[-2], images.shape[-1]))
        return features

    def _backbone_forward(self, images: Tensor) -> dict[str, Any]:
        """The session's forward of the backbone on images already normalized, cast and laid out."""
        return self._session.run(self._model, images)

    def _as_maps(self, features: dict[str, Any], image_hw: tuple[int, int]) -> dict[str, Any]:
        """Token and channels-last outputs as ``(B, C, H, W)`` views; prefix tokens kept on request."""
        layouts = self._layouts or {}
        maps: dict[str, Any] = {}
        for name, value in features.items():
            if not isinstance(value, Tensor):
                maps[name] = value
                continue
            maps[name], prefix = to_nchw(value, layouts[name], image_hw, name)
            if self.return_prefix_tokens and prefix is not None and prefix.shape[1]:
                maps[f"{name}.prefix"] = prefix
        return maps

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
