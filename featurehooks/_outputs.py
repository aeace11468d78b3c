"""What a ``FeatureExtractor`` returns: the layout of each tapped output, and ``output_format="nchw"``'s maps.

``"native"`` returns module outputs as they are; ``"nchw"`` returns channels-last maps (Swin) and tokens (ViT)
as ``(B, C, H, W)`` views, the tokens without their prefix tokens (returned apart on request as
``"<name>.prefix"``). The layouts come from the meta trace, or from the first real forward of a model that cannot
be traced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from torch import Tensor, nn

from ._layout import Layout, check_nchw, classify, patch_size_of, to_nchw
from .errors import InvalidTypeError, InvalidValueError

__all__ = ["OutputFormat", "as_maps", "check_format", "check_prefix_names", "layouts_of", "returned_layouts"]

OutputFormat = Literal["native", "nchw"]


def check_format(output_format: str, return_prefix_tokens: bool, prefix_tokens: int | None) -> None:
    """Refuse an unknown ``output_format``, prefix tokens asked of native outputs, and a bad ``prefix_tokens``."""
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


def check_prefix_names(names: Sequence[str], return_prefix_tokens: bool) -> None:
    """Refuse ``"<name>.prefix"`` outputs that would clash with a requested output of that name."""
    clashes = [f"{name}.prefix" for name in names if f"{name}.prefix" in names]
    if return_prefix_tokens and clashes:
        raise InvalidValueError(f"return_prefix_tokens=True would return {clashes} twice; rename those layers")


def layouts_of(
    model: nn.Module,
    shapes: Mapping[str, tuple[int, ...] | None],
    input_shape: tuple[int, ...],
    prefix_tokens: int | None,
    output_format: str,
) -> dict[str, Layout]:
    """The layout of each output from its shape; with ``"nchw"``, refuse token outputs that cannot become maps
    (their prefix count unknown, or tokens that do not tile the input)."""
    patch = patch_size_of(model)
    layouts = {name: classify(shape, input_shape, prefix_tokens, patch) for name, shape in shapes.items()}
    if output_format == "nchw":
        for name, layout in layouts.items():
            check_nchw(layout, shapes[name] or (), (input_shape[-2], input_shape[-1]), name)
    return layouts


def returned_layouts(layouts: dict[str, Layout], output_format: str, return_prefix_tokens: bool) -> dict[str, Layout]:
    """The layouts of what ``forward`` returns: with ``"nchw"``, token and NHWC outputs as maps, plus prefixes."""
    if output_format == "native":
        return layouts
    returned: dict[str, Layout] = {}
    for name, layout in layouts.items():
        if layout.kind in ("NHWC", "NLC"):
            returned[name] = Layout("NCHW", layout.channels, layout.stride)
            if return_prefix_tokens and layout.kind == "NLC" and layout.prefix_tokens:
                returned[f"{name}.prefix"] = Layout("NLC", layout.channels, None, layout.prefix_tokens)
        else:
            returned[name] = layout
    return returned


def as_maps(
    features: dict[str, Any], layouts: Mapping[str, Layout], image_hw: tuple[int, int], return_prefix_tokens: bool
) -> dict[str, Any]:
    """Token and channels-last outputs as ``(B, C, H, W)`` views; prefix tokens kept on request."""
    maps: dict[str, Any] = {}
    for name, value in features.items():
        if not isinstance(value, Tensor):
            maps[name] = value
            continue
        maps[name], prefix = to_nchw(value, layouts[name], image_hw, name)
        if return_prefix_tokens and prefix is not None and prefix.shape[1]:
            maps[f"{name}.prefix"] = prefix
    return maps
