"""FeatureExtractor (a frozen backbone that returns named features) and capture (hooks on your own module)."""

from __future__ import annotations

import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._hooks import HookSession
from ._trace import Trace, trace_images
from .backbones import BackboneSpec, Preprocessing, WeightsSpec, load_backbone
from .errors import InvalidTypeError, InvalidValueError
from .layers import FeatureInfo, LayerIndex, LayerSpec, describe

__all__ = ["FeatureExtractor", "LayerSpec", "capture"]

Mode = Literal["detach", "grad"]
# Values this far outside input_range (as a fraction of its width) are almost surely the wrong scale.
_RANGE_SLACK = 0.1


def _check_mode(mode: str) -> None:
    if mode not in ("detach", "grad"):
        raise InvalidValueError(f"mode must be 'detach' or 'grad', not {mode!r}")


def _floating_tensor(model: nn.Module) -> Tensor:
    """The model's first floating-point parameter or buffer (an empty float tensor for none): its dtype and device."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return next((t for t in tensors if t.is_floating_point()), torch.empty(0))


class FeatureExtractor(nn.Module):
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
        early_exit: stop the forward after the deepest requested layer (turn off only to measure).

    Grayscale input is an error rather than silently repeated: pass ``x.expand(-1, 3, -1, -1)``.

    Shape:
        input: ``(B, C, H, W)`` float in ``input_range``; output: dict of the requested features.

    Example:
        >>> ext = FeatureExtractor("vgg16", ["relu2_2", "relu3_3"], weights=None)
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
        early_exit: bool = True,
    ) -> None:
        super().__init__()
        _check_mode(mode)
        low, high = (float(v) for v in input_range)
        if not low < high:
            raise InvalidValueError(f"input_range must be (low, high) with low < high, got {input_range}")
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
        self.preprocessing: Preprocessing = loaded.preprocessing
        self.mode: Mode = mode
        self.input_range = (low, high)
        self.early_exit = early_exit
        index = LayerIndex(model, loaded.name)
        self.taps = index.taps(layers)
        size = self.preprocessing.crop_size or 224
        self._untraced = ""
        try:
            found, self.in_channels = trace_images(model, size, loaded.in_channels, watch=self.taps.sites)
        except Exception as exc:  # the model cannot run on meta tensors: real forwards are checked instead
            found, self.in_channels = None, loaded.in_channels
            self._untraced = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if found is not None:
            index.check_calls(self.taps, found)
        self._trace: Trace | None = found
        self._register_normalization(loaded.preprocessing)
        self._range_checked = False
        self._session = HookSession(model, self.taps, detach=mode == "detach", stop_early=early_exit)
        self._session.prepare(found)

    @property
    def backbone(self) -> nn.Module:
        """The frozen model (not a registered submodule, so it stays out of ``state_dict()``)."""
        return self._model

    def _register_normalization(self, pre: Preprocessing) -> None:
        """Buffers ``mean``/``std`` in the units of ``input_range``, so forward is one ``(x - mean) / std``.

        They start with the backbone's dtype and device (a user's module may be float64 or on a GPU already)
        and follow ``.to()`` from then on: forward casts images to their dtype and checks their device.
        """
        low, high = self.input_range
        channels = len(pre.mean) if pre.mean is not None else (self.in_channels or 1)
        like = _floating_tensor(self._model)
        mean = torch.tensor(pre.mean if pre.mean is not None else [0.0] * channels).to(like)
        std = torch.tensor(pre.std if pre.std is not None else [1.0] * channels).to(like)
        self.register_buffer("mean", (low + mean * (high - low)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", (std * (high - low)).view(1, -1, 1, 1), persistent=False)
        self._normalizes = pre.mean is not None or (low, high) != (0.0, 1.0)

    @property
    def layers(self) -> list[str]:
        """Output names in request order."""
        return self.taps.names

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

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FeatureExtractor:
        super()._apply(fn, recurse)
        if recurse:
            self._model._apply(fn)
        return self

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
        Under autocast the backbone's ops choose their own precision, as usual.
        """
        if not self._session.active:
            raise RuntimeError("this FeatureExtractor was closed; create a new one")
        self._check_input(images)
        x = self.normalize(images.to(self.mean.dtype))
        grad = self.mode == "grad" and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            return self._session.run(self._model, x)

    def close(self) -> None:
        """Remove every hook from the backbone; the extractor cannot be called afterwards."""
        self._session.remove()

    def __enter__(self) -> FeatureExtractor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def extra_repr(self) -> str:
        return (
            f"backbone={self.backbone_name!r}, weights={self.weights!r}, layers={self.layers}, "
            f"mode={self.mode!r}, input_range={self.input_range}"
        )


@contextmanager
def capture(module: nn.Module, layers: LayerSpec, *, mode: Mode = "grad") -> Iterator[dict[str, Any]]:
    """Collect named intermediate outputs of your own module for the duration of a ``with`` block.

    Unlike FeatureExtractor, the module is neither copied, frozen nor switched to eval: use it on a
    model you are training, such as a GAN discriminator. Each forward of ``module`` inside the block
    refills the yielded dict (request order); the hooks are removed when the block ends, also on error.

    Args:
        module: the model to tap.
        layers: module paths (or a dict ``{"module.path": "output_name"}``).
        mode: ``"grad"`` keeps the graph; ``"detach"`` stores detached outputs.

    Example:
        >>> net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 1, 3))
        >>> with capture(net, ["0", "2"]) as feats:
        ...     _ = net(torch.rand(1, 3, 16, 16))
        >>> list(feats)
        ['0', '2']
    """
    _check_mode(mode)
    taps = LayerIndex(module, type(module).__name__).taps(layers)
    session = HookSession(module, taps, detach=mode == "detach", stop_early=False)
    features = CapturedFeatures(taps.names)
    try:
        session.follow(features.publish)
        yield features
    finally:
        session.remove()


class CapturedFeatures(Mapping[str, Any]):
    """The outputs of the latest completed forward inside a ``capture`` block, in request order.

    Forwards in several threads each publish their own outputs: a thread reads those of its own
    latest forward. A thread that ran none reads those of the one thread that did; when several
    did (``nn.DataParallel`` replicas), reading is an error rather than an arbitrary pick.
    """

    def __init__(self, names: list[str]) -> None:
        self._names = names
        self._by_thread: dict[int, dict[str, Any]] = {}

    def publish(self, store: Mapping[str, Any]) -> None:
        """Make ``store`` (one completed forward) what this thread reads from now on."""
        self._by_thread[threading.get_ident()] = {name: store[name] for name in self._names if name in store}

    def _current(self) -> dict[str, Any]:
        mine = self._by_thread.get(threading.get_ident())
        if mine is not None:
            return mine
        published = list(self._by_thread.values())
        if len(published) > 1:
            raise RuntimeError(
                f"forwards in {len(published)} other threads were captured (e.g. nn.DataParallel replicas); "
                "read the features in the thread that ran the forward"
            )
        return published[0] if published else {}

    def __getitem__(self, name: str) -> Any:
        return self._current()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __repr__(self) -> str:
        return f"CapturedFeatures({list(self._current())})"
