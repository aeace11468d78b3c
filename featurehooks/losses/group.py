"""LossGroup: several losses on one image with one backbone forward per shared extractor."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping

from torch import Tensor, nn

from ..errors import InvalidTypeError, InvalidValueError
from ..functional import check_images, check_mask
from ._base import FeatureLoss

__all__ = ["LossGroup"]


class LossGroup(nn.Module):
    r"""A weighted sum of named losses that share backbone forwards.

    Feature losses built on the same ``FeatureExtractor`` (pass one extractor, created over the
    union of their layers, as their ``backbone``) get their features from a single forward of the
    input and at most one forward of the target per call. Losses with a fixed target
    (``set_target``) use it and ignore the call's target; the others compare with the call's
    target. Losses whose ``takes_target`` is False (``TotalVariationLoss``) get the input only;
    any other module is called as ``loss(input, target)``.

    With ``mask=`` (``(B, 1, H, W)`` or ``(1, 1, H, W)`` weights on the input's pixels, see ``docs/losses.md``,
    "Masked losses") every member is called with that mask: the feature losses, ``LPIPS`` and ``DISTS`` compare
    the region only, each by its own ``mask_normalization``, and the sum equals the members called with the mask
    one by one (bitwise where they share no forward). A member that takes no mask (``TotalVariationLoss``, a prior
    on the input with no region to compare) makes a masked call an error: add it outside the group.

    Args:
        losses: name -> loss module, in the order the terms are reported.
        weights: name -> weight of that term; missing names weigh 1.

    Shape:
        input, target: ``(B, C, H, W)``; output: scalar, or ``(B,)`` when the members use
        ``reduction="none"``.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.losses import LossGroup, PerceptualLoss, StyleLoss
        >>> ext = FeatureExtractor("vgg16", ["relu2_2", "relu3_3"], mode="grad", weights=None)
        >>> group = LossGroup(
        ...     {"content": PerceptualLoss(ext, ["relu3_3"]), "style": StyleLoss(ext, ["relu2_2", "relu3_3"])},
        ...     weights={"style": 10.0},
        ... )
        >>> x, y = torch.rand(2, 3, 64, 64, requires_grad=True), torch.rand(2, 3, 64, 64)
        >>> sorted(group.terms(x, y))  # one backbone forward for x and one for y
        ['content', 'style']
        >>> hole = torch.zeros(2, 1, 64, 64)
        >>> hole[..., 16:48, 16:48] = 1
        >>> group(x, y, mask=hole).shape  # both terms inside the hole only
        torch.Size([])
    """

    def __init__(self, losses: Mapping[str, nn.Module], weights: Mapping[str, float] | None = None) -> None:
        super().__init__()
        if not losses:
            raise InvalidValueError("LossGroup needs at least one loss")
        for name, loss in losses.items():
            if not isinstance(loss, nn.Module):
                raise InvalidTypeError(f"loss {name!r} must be an nn.Module, got {type(loss).__name__}")
        weights = dict(weights or {})
        unknown = [name for name in weights if name not in losses]
        if unknown:
            raise InvalidValueError(f"weights name losses that are not in the group: {unknown}; it has {list(losses)}")
        reductions = {getattr(loss, "reduction", None) for loss in losses.values()} - {None}
        if len(reductions) > 1:
            raise InvalidValueError(
                f"the losses of a group must share one reduction, got {sorted(map(str, reductions))}"
            )
        self.losses = nn.ModuleDict(losses)
        self.weights = {name: float(weights.get(name, 1.0)) for name in losses}

    def terms(self, input: Tensor, target: Tensor | None = None, *, mask: Tensor | None = None) -> dict[str, Tensor]:
        """Each loss times its weight, by name (useful for logging); their sum is ``forward``.

        Every feature loss without a fixed target checks ``target`` against ``input``, and ``mask`` is checked
        against ``input`` (and refused if a member takes none), before any forward runs.
        """
        check_images(input, "input")
        self._check_call(input, target, mask)
        masked = {} if mask is None else {"mask": mask}  # a member that takes no mask is called without one
        input_features: dict[tuple[int, object], dict[str, Tensor]] = {}
        target_features: dict[tuple[int, object], dict[str, Tensor]] = {}
        result: dict[str, Tensor] = {}
        for name, loss in self.losses.items():
            if isinstance(loss, FeatureLoss):
                key = (id(loss.extractor), loss.input_size)
                if key not in input_features:
                    input_features[key] = loss.features(input)
                if loss.has_target or target is None:  # (no target: each has a fixed one, as checked above)
                    value = loss.from_features(input_features[key], mask=mask)
                else:
                    if key not in target_features:
                        target_features[key] = loss.target_features(target)
                    value = loss.from_features(input_features[key], target_features[key], mask=mask)
            elif not getattr(loss, "takes_target", True) or target is None:
                value = loss(input, **masked)
            else:
                value = loss(input, target, **masked)
            result[name] = self.weights[name] * value
        return result

    def _check_call(self, input: Tensor, target: Tensor | None, mask: Tensor | None) -> None:
        """Refuse a missing or mismatched target, and a mask that a member cannot take or that is not the input's."""
        for name, loss in self.losses.items():
            if isinstance(loss, FeatureLoss) and not loss.has_target:
                if target is None:
                    raise InvalidValueError(
                        f"loss {name!r} has no fixed target: pass a target, or call "
                        f"group.losses[{name!r}].set_target(image) once"
                    )
                loss.check_target(input, target)
        if mask is None:
            return
        refused = [f"{name!r} ({type(loss).__name__})" for name, loss in self.losses.items() if not _takes_mask(loss)]
        if refused:
            raise InvalidValueError(
                f"loss {', '.join(refused)} of this group takes no mask=: it compares no region (a total variation "
                "is a prior on the input); call the group with the mask and add that loss outside it"
            )
        with warnings.catch_warnings():  # an all-zeros mask is reported by each member, as when called by hand
            warnings.simplefilter("ignore")
            check_mask(mask, input.shape[0], input.shape[-2:], input.device)
        for name, loss in self.losses.items():
            if (
                isinstance(loss, FeatureLoss)
                and not loss.has_target
                and loss.input_size is None
                and target is not None
                and target.shape[-2:] != input.shape[-2:]
            ):
                raise InvalidValueError(
                    f"loss {name!r}: a mask lies on the pixels of input and target alike, but target "
                    f"{tuple(target.shape)} is not the input's size {tuple(input.shape[-2:])}; for a style image of "
                    f"its own size, call group.losses[{name!r}].set_target(style, mask=its_mask) once"
                )

    def forward(self, input: Tensor, target: Tensor | None = None, *, mask: Tensor | None = None) -> Tensor:
        """The weighted sum of every loss; with ``mask``, of every loss inside it (see the class docstring)."""
        values = list(self.terms(input, target, mask=mask).values())
        return sum(values[1:], values[0])

    def extra_repr(self) -> str:
        return f"weights={self.weights}"


def _takes_mask(loss: nn.Module) -> bool:
    """Whether ``loss`` is called with ``mask=``: every feature loss, and a module whose ``forward`` names it."""
    return isinstance(loss, FeatureLoss) or "mask" in inspect.signature(loss.forward).parameters
