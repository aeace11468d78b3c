"""FeatureExtractor (a frozen backbone that returns named features) and capture (hooks on your own module)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Union

import torch
from torch import Tensor, nn

from ._hooks import HookSession
from .backbones import BackboneSpec, Preprocessing, WeightsSpec, load_backbone
from .layers import FeatureInfo, LayerIndex, describe

__all__ = ["FeatureExtractor", "LayerSpec", "capture"]

LayerSpec = Union[str, Sequence[str], Mapping[str, str]]
Mode = Literal["detach", "grad"]
# Values this far outside input_range (as a fraction of its width) are almost surely the wrong scale.
_RANGE_SLACK = 0.1


def _resolve_taps(index: LayerIndex, layers: LayerSpec) -> tuple[dict[str, list[str]], list[str]]:
    """Module path -> output names, and the output names in request order."""
    if isinstance(layers, str):
        layers = [layers]
    pairs = list(layers.items()) if isinstance(layers, Mapping) else [(name, name) for name in layers]
    if not pairs:
        raise ValueError(f"no layers requested; pick some from featurehooks.list_layers({index.label!r})")
    taps: dict[str, list[str]] = {}
    out_names: list[str] = []
    for name, out_name in pairs:
        if not isinstance(name, str) or not isinstance(out_name, str):
            raise TypeError(f"layer names must be strings, got {name!r}")
        if out_name in out_names:
            raise ValueError(f"layer {out_name!r} requested twice")
        taps.setdefault(index.resolve(name), []).append(out_name)
        out_names.append(out_name)
    return taps, out_names


def _check_mode(mode: str) -> None:
    if mode not in ("detach", "grad"):
        raise ValueError(f"mode must be 'detach' or 'grad', not {mode!r}")


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
            raise ValueError(f"input_range must be (low, high) with low < high, got {input_range}")
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
        self._index = LayerIndex(model, loaded.name)
        taps, self.layers = _resolve_taps(self._index, layers)
        self.paths = list(taps)
        first_conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        self.in_channels: int | None = first_conv.in_channels if first_conv is not None else None
        self._register_normalization(loaded.preprocessing)
        self._range_checked = False
        self._session = HookSession(model, taps, detach=mode == "detach", stop_early=early_exit)
        size = self.preprocessing.crop_size or 224
        try:
            self._session.verify_on_meta(model, (torch.empty(1, self.in_channels or 3, size, size),))
        except BaseException:
            self._session.remove()
            raise

    @property
    def backbone(self) -> nn.Module:
        """The frozen model (not a registered submodule, so it stays out of ``state_dict()``)."""
        return self._model

    def _register_normalization(self, pre: Preprocessing) -> None:
        """Buffers ``mean``/``std`` in the units of ``input_range``, so forward is one ``(x - mean) / std``."""
        low, high = self.input_range
        channels = len(pre.mean) if pre.mean is not None else (self.in_channels or 1)
        mean = torch.tensor(pre.mean if pre.mean is not None else [0.0] * channels)
        std = torch.tensor(pre.std if pre.std is not None else [1.0] * channels)
        self.register_buffer("mean", (low + mean * (high - low)).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", (std * (high - low)).view(1, -1, 1, 1), persistent=False)
        self._normalizes = pre.mean is not None or (low, high) != (0.0, 1.0)

    @property
    def feature_info(self) -> list[FeatureInfo]:
        """Channels and stride of each requested layer, in request order (a meta-device forward)."""
        size = self.preprocessing.crop_size or 224
        shape = (1, self.in_channels or 3, size, size)
        rows = {row.path: row for row in describe(self._model, shape, self.backbone_name)}
        path_of = {out: path for path, outs in self._session.taps.items() for out in outs}
        return [rows[path_of[out]] for out in self.layers]

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FeatureExtractor:
        super()._apply(fn, recurse)
        if recurse:
            self._model._apply(fn)
        return self

    def _check_input(self, images: Tensor) -> None:
        if not isinstance(images, Tensor):
            raise TypeError(f"expected a torch.Tensor of images, got {type(images).__name__}")
        if images.dim() != 4:
            raise ValueError(
                f"expected images of shape (batch, {self.in_channels or 'channels'}, height, width), "
                f"got shape {tuple(images.shape)}"
            )
        if not images.is_floating_point():
            raise TypeError(
                f"expected floating-point images in input_range={self.input_range}, got {images.dtype}; "
                "convert with images.float() (and divide uint8 by 255 for input_range=(0, 1))"
            )
        if self.in_channels is not None and images.shape[1] != self.in_channels:
            hint = "; repeat grayscale with images.expand(-1, 3, -1, -1)" if images.shape[1] == 1 else ""
            raise ValueError(f"expected {self.in_channels} channels, got {images.shape[1]}{hint}")
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
        """Return ``{name: feature}`` for the requested layers, in request order."""
        if not self._session.active:
            raise RuntimeError("this FeatureExtractor was closed; create a new one")
        self._check_input(images)
        x = self.normalize(images)
        grad = self.mode == "grad" and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            store = self._session.run(self._model, x)
            if self._session.track_versions and self._session.last_mutated:  # the meta dry run was impossible
                self._session.clone_from_now_on(self._session.last_mutated)
                store = self._session.run(self._model, x)
        return {name: store[name] for name in self.layers}

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
    index = LayerIndex(module, type(module).__name__)
    taps, out_names = _resolve_taps(index, layers)
    session = HookSession(module, taps, detach=mode == "detach", stop_early=False)
    collected: dict[str, Any] = {}
    ordered: dict[str, Any] = {}
    state = {"verified": False, "dry_run": False}

    def start_forward(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if state["dry_run"]:
            return
        if not state["verified"]:  # first forward: learn which taps need a clone, on meta tensors
            state["verified"] = state["dry_run"] = True
            try:
                if not session.verify_on_meta(module, args, kwargs):
                    # No dry run, and this forward cannot be repeated: copy every tap, so none can be
                    # changed in place after capture (the first forward included).
                    session.clone_paths |= set(session.taps)
                    session.track_versions = False
            finally:
                state["dry_run"] = False
        collected.clear()
        session.begin(collected)

    def finish_forward(_module: nn.Module, _args: Any, _output: Any) -> None:
        if state["dry_run"]:
            return
        session.reset()  # also after an exception: a tapped submodule called on its own stores nothing
        ordered.clear()
        ordered.update((name, collected[name]) for name in out_names if name in collected)

    handles = [
        module.register_forward_pre_hook(start_forward, with_kwargs=True),
        module.register_forward_hook(finish_forward, always_call=True),
    ]
    try:
        yield ordered
    finally:
        for handle in handles:
            handle.remove()
        session.remove()
