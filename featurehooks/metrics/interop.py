"""An extractor's layer as the ``(N, D)`` feature module other metric libraries take (torchmetrics' FID and KID).

torchmetrics' ``FrechetInceptionDistance(feature=...)`` and ``KernelInceptionDistance(feature=...)`` (and
the other libraries that take a custom feature network) call a module on batches of images and expect one
``(N, D)`` tensor back; a ``FeatureExtractor`` returns a dict, takes floating images only, and leaves
maps unpooled. ``PooledFeatures`` closes the gap: one layer, pooled to vectors, from uint8 images (as
torchmetrics passes them with ``normalize=False``) or floating ones (``normalize=True``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._layout import Pool, as_pool
from .._stream.forward import pool_features
from ..errors import InvalidTypeError, InvalidValueError, LayerNotFoundError, did_you_mean
from ..extractor import FeatureExtractor

__all__ = ["PooledFeatures"]

_UINT8_MAX = 255.0


class PooledFeatures(nn.Module):
    """One layer of a ``FeatureExtractor``, pooled to ``(N, D)`` vectors: the ``feature=`` module torchmetrics takes.

    ``FrechetInceptionDistance(feature=PooledFeatures(ext, "layer4"))`` computes FID (and
    ``KernelInceptionDistance`` KID) in the feature space of any backbone, layer and pooling. Its numbers
    equal ``frechet_distance`` and ``kernel_inception_distance`` on the same features (measured: 3e-8
    relative for FID, whose result torchmetrics returns in float32; 2e-5 for KID, which torchmetrics
    computes in float32), e.g. those of ``feature_statistics(ext, images, layer="layer4", pool="avg",
    resize_size=None, crop_size=None)``: nothing here resizes or crops (torchmetrics' own Inception resizes
    to 299x299; here images reach the backbone at the size they have).

    Images:

    - ``uint8`` images (torchmetrics' default, ``normalize=False``) hold values in [0, 255]: they are
      divided by 255 and mapped to the extractor's ``input_range``, as ``images.float() / 255`` would be
      for the default ``input_range=(0, 1)``.
    - floating images (torchmetrics' ``normalize=True``, which hands a custom module its [0, 1] floats
      unchanged) are passed on as they are: they must lie in the extractor's ``input_range``.

    Images are moved to the extractor's device. The module holds the extractor as a submodule, so the
    metric's ``.to(device)`` moves it too; the backbone stays frozen and in eval mode, and adds nothing
    to the metric's ``state_dict``.

    ``num_features`` is ``D``, read from the extractor's metadata without a forward, so torchmetrics needs
    no probe forward of a 299x299 dummy image (which a fixed-size ViT would refuse). Models whose layouts
    are known only after a forward have no ``num_features`` attribute until their first call; torchmetrics
    then probes them once.

    Args:
        extractor: the ``FeatureExtractor`` (its ``input_range``, normalization, device and dtype apply).
        layer: the output to use; ``None`` for an extractor with a single output.
        pool: ``"avg"`` or ``"max"`` over positions (spatial, or patch tokens), ``"cls"`` for the class
            token, or ``None`` for a layer that already returns ``(N, D)`` vectors.

    Shape:
        input: ``(N, C, H, W)`` uint8 in [0, 255], or floating in ``input_range``; output: ``(N, D)``
        in the extractor's dtype (float32 for ``precision="bf16"``/``"fp16"``: pooled in float32).

    Raises:
        LayerNotFoundError: ``layer`` is not an output of the extractor.
        InvalidValueError: a bad ``pool``, or ``pool=None`` for a layer of maps or tokens.
        InvalidTypeError: images of an integer dtype other than uint8.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import PooledFeatures
        >>> ext = FeatureExtractor("resnet18", ["layer3", "layer4"], weights=None)
        >>> feature = PooledFeatures(ext, "layer4", pool="avg")
        >>> feature.num_features
        512
        >>> images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
        >>> tuple(feature(images).shape)
        (2, 512)
        >>> torch.equal(feature(images), feature(images.float() / 255))  # uint8 or [0, 1] floats
        True
    """

    def __init__(self, extractor: FeatureExtractor, layer: str | None = None, *, pool: Pool | None = "avg") -> None:
        super().__init__()
        if not isinstance(extractor, FeatureExtractor):
            raise InvalidTypeError(
                f"extractor must be a FeatureExtractor, not {type(extractor).__name__}; build one with "
                "FeatureExtractor(backbone, [layer])"
            )
        names = _names(extractor)
        if layer is None:
            if len(names) != 1:
                raise InvalidValueError(f"the extractor returns {len(names)} outputs {names}: pass layer=<one of them>")
            layer = names[0]
        if layer not in names:
            raise LayerNotFoundError(
                f"the extractor returns no layer {layer!r} (it returns {names}); {did_you_mean(layer, names)}"
            )
        self.extractor = extractor
        self.layer = layer
        self.pool: Pool | None = as_pool(pool)
        channels = self._known_channels()
        if channels is not None:
            self.num_features = channels

    def _known_channels(self) -> int | None:
        """``D`` from the extractor's layouts (its meta trace), or None when they are not known before a forward
        or the layer cannot be pooled (the forward then says why)."""
        try:
            layout = self.extractor.output_layouts[self.layer]
        except RuntimeError:  # a model that cannot be traced: known after its first forward
            return None
        if self.pool is None and layout.kind != "NC":
            raise InvalidValueError(
                f"pool=None: layer {self.layer!r} returns {layout.kind} features, not (N, D) vectors; pool them "
                "(pool='avg', 'max' or 'cls')"
            )
        return layout.channels if layout.kind != "other" else None

    def _as_input(self, images: Tensor) -> Tensor:
        if not isinstance(images, Tensor):
            raise InvalidTypeError(f"expected a torch.Tensor of images, got {type(images).__name__}")
        images = images.to(self.extractor.device)
        if images.is_floating_point():
            return images
        if images.dtype != torch.uint8:
            raise InvalidTypeError(
                f"expected uint8 images in [0, 255] or floating images in input_range={self.extractor.input_range}, "
                f"got {images.dtype}"
            )
        low, high = self.extractor.input_range
        scaled = images.to(self.extractor.dtype) / _UINT8_MAX
        return scaled if (low, high) == (0.0, 1.0) else scaled * (high - low) + low

    def forward(self, images: Tensor) -> Tensor:
        """``(N, D)`` pooled features of ``images`` (uint8 in [0, 255], or floating in ``input_range``)."""
        feature = self.extractor(self._as_input(images))[self.layer]
        if self.extractor.precision != "float32":  # a bf16/fp16 backbone's features are pooled in float32
            feature = feature.to(torch.promote_types(feature.dtype, torch.float32))
        pooled = pool_features(feature, self.extractor.output_layouts[self.layer], self.pool, self.layer)
        if pooled.dim() != 2:
            raise InvalidValueError(
                f"layer {self.layer!r} returns features of shape {tuple(pooled.shape)}, not (N, D) vectors; pool "
                "them (pool='avg', 'max' or 'cls')"
            )
        if "num_features" not in self.__dict__:  # an untraced model: known now
            self.num_features = int(pooled.shape[1])
        return pooled

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, pool={self.pool!r}"


def _names(extractor: FeatureExtractor) -> list[str]:
    """The names the extractor returns (its ``.prefix`` outputs too, when its layouts are known)."""
    try:
        return list(extractor.output_layouts)
    except RuntimeError:
        return list(extractor.layers)
