"""DINOv2 ViT-S/B/L/g-14 by their torch hub names (``"dinov2_vitl14"``), as timm models that compute DINOv2's features.

The hub's ``torch.hub.load("facebookresearch/dinov2", "dinov2_vitl14")`` (what dgm-eval and EDM2 load for
FD_DINOv2) is a ViT trained at 518x518 (37x37 patches of 14) whose position embeddings are resized to the
input's grid on every forward by DINOv2's own ``interpolate_pos_encoding``: bicubic, no antialiasing, and a
*scale factor* of ``(grid + 0.1) / 37`` rather than a target size, so the sampling points sit a little off
those of a plain resize. timm's ``vit_*_patch14_dinov2`` holds the same tensors under the same names (less
``mask_token``) but resamples with its own rule (a target size, antialiased), which gives other features.

Here the timm architecture is built at one input size (224 by default, FD_DINOv2's) and its position
embedding is computed once, at build, by DINOv2's rule for that grid. The forward is then timm's plain
fixed-size forward, with timm's module names (``blocks.23``, ``norm``...), and equals the hub model's at that
size; any other size is refused by the patch embedding instead of being resampled another way. DINOv2's
``x_norm_clstoken`` (the hub model's output) is the class token of layer ``"norm"``: ``pool="cls"``.

Weights are the hub release's ``$TORCH_HOME/hub/checkpoints/dinov2_<arch>_pretrain.pth`` (where
``torch.hub.load`` caches them), or a local ``.pth``/``.safetensors`` in the hub's or timm's key layout, read
with ``weights_only=True``. Images are prepared as dgm-eval does: the whole image resized to 224x224 by
Pillow's bicubic filter (no crop), ImageNet mean and std.
"""

from __future__ import annotations

import os
import re
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models import WeightsEnum

from ..errors import BackboneNotFoundError, InvalidValueError, did_you_mean
from ._files import hub_checkpoint_path, is_state_dict_file, load_hub_checkpoint, read_state_dict, weights_source
from ._meta import adopt_state, meta_parameters
from .base import Backbone
from .timm_models import import_timm, model_facts

__all__ = [
    "DINOV2_LAYER",
    "DINOV2_MODELS",
    "PATCH_SIZE",
    "architecture",
    "hub_to_timm",
    "interpolate_pos_embed",
    "is_dinov2",
    "load",
    "weights_path",
    "weights_url",
]

DINOV2_MODELS = {
    "dinov2_vits14": "vit_small_patch14_dinov2",
    "dinov2_vitb14": "vit_base_patch14_dinov2",
    "dinov2_vitl14": "vit_large_patch14_dinov2",
    "dinov2_vitg14": "vit_giant_patch14_dinov2",
}
"""The torch hub entry names of DINOv2's backbones (without registers) and the timm architecture of each.

Examples:
    >>> from featurehooks.backbones.dinov2 import DINOV2_MODELS
    >>> DINOV2_MODELS["dinov2_vitl14"]
    'vit_large_patch14_dinov2'
"""

DINOV2_LAYER = "norm"
"""The final LayerNorm: its class token (``pool="cls"``) is DINOv2's ``x_norm_clstoken``, the FD_DINOv2 feature.

Examples:
    >>> from featurehooks.backbones.dinov2 import DINOV2_LAYER
    >>> DINOV2_LAYER
    'norm'
"""

PATCH_SIZE = 14
_TRAINED_GRID = 37  # the hub checkpoints' position embeddings: 518 / 14 patches a side
_OFFSET = 0.1  # interpolate_offset of the hub entries without registers (interpolate_antialias=False)
_BASE_URL = "https://dl.fbaipublicfiles.com/dinov2"
_IMAGE_SIZE = 224  # dgm-eval's and EDM2's resize for FD_DINOv2
_HUB_ONLY = "mask_token"  # used for masked training only; timm's model has no such tensor
# the ViT-g/14 feed-forward: DINOv2's SwiGLU (w12, w3) is timm's packed GLU (fc1, fc2)
_SWIGLU = re.compile(r"(blocks\.\d+\.mlp)\.(w12|w3)\.")
_SWIGLU_NAMES = {"w12": "fc1", "w3": "fc2"}

WeightsArg = Union[str, "os.PathLike[str]", WeightsEnum, None]  # an enum member is refused, with the reason


def is_dinov2(spec: object) -> bool:
    """Whether ``spec`` names a DINOv2 backbone here: one of ``DINOV2_MODELS``, or another ``"dinov2_..."``
    name (refused with the known ones by ``load``).

    Examples:
        >>> from featurehooks.backbones.dinov2 import is_dinov2
        >>> is_dinov2("dinov2_vitl14"), is_dinov2("vgg16")
        (True, False)
    """
    return isinstance(spec, str) and spec.startswith("dinov2_")


def _timm_name(name: str) -> str:
    if name not in DINOV2_MODELS:
        raise BackboneNotFoundError(
            f"unknown DINOv2 backbone {name!r}; {did_you_mean(name, DINOV2_MODELS)} "
            f"(the torch hub names without registers: {', '.join(DINOV2_MODELS)})"
        )
    return DINOV2_MODELS[name]


def weights_url(name: str) -> str:
    """Where the hub entry ``name`` downloads its weights from (``torch.hub.load_state_dict_from_url``).

    Examples:
        >>> from featurehooks.backbones.dinov2 import weights_url
        >>> weights_url("dinov2_vitl14").rsplit("/", 1)[-1]
        'dinov2_vitl14_pretrain.pth'
    """
    _timm_name(name)
    return f"{_BASE_URL}/{name}/{name}_pretrain.pth"


def weights_path(name: str) -> str:
    """Where ``weights="DEFAULT"`` reads them: ``$TORCH_HOME/hub/checkpoints/<name>_pretrain.pth``, torch hub's cache.

    Examples:
        >>> from featurehooks.backbones.dinov2 import weights_path
        >>> weights_path("dinov2_vits14").endswith("hub/checkpoints/dinov2_vits14_pretrain.pth")
        True
    """
    return str(hub_checkpoint_path(weights_url(name)))


def hub_to_timm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The hub release's state dict under timm's names: ``mask_token`` left out, ViT-g's ``mlp.w12``/``mlp.w3``
    renamed ``mlp.fc1``/``mlp.fc2``; the tensors themselves are not touched (nor is ``pos_embed`` resampled).

    Examples:
        >>> import torch
        >>> from featurehooks.backbones.dinov2 import hub_to_timm
        >>> sorted(hub_to_timm({"mask_token": torch.zeros(1, 4), "blocks.0.mlp.w12.weight": torch.zeros(8, 4)}))
        ['blocks.0.mlp.fc1.weight']
    """
    converted = {}
    for key, value in state.items():
        if key == _HUB_ONLY:
            continue
        converted[_SWIGLU.sub(lambda m: f"{m.group(1)}.{_SWIGLU_NAMES[m.group(2)]}.", key)] = value
    return converted


def interpolate_pos_embed(pos_embed: Tensor, grid: tuple[int, int]) -> Tensor:
    """A ``(1, 1 + M*M, D)`` position embedding (class token first) for a ``grid`` of patches, by DINOv2's rule.

    DINOv2's ``interpolate_pos_encoding`` as its hub entries without registers set it up: unchanged when the grid
    is the trained square; otherwise, in float32, bicubic without antialiasing with a scale factor of
    ``(side + 0.1) / M`` per axis (so the sampling points are those of that scale, not of the exact size).

    Shape:
        input: ``(1, 1 + M*M, D)``; output: ``(1, 1 + H*W, D)`` for ``grid = (H, W)``.

    Examples:
        >>> import torch
        >>> from featurehooks.backbones.dinov2 import interpolate_pos_embed
        >>> interpolate_pos_embed(torch.zeros(1, 1 + 37 * 37, 8), (16, 16)).shape
        torch.Size([1, 257, 8])
    """
    tokens, dim = pos_embed.shape[1] - 1, pos_embed.shape[-1]
    side = round(tokens**0.5)
    if side * side != tokens:
        raise InvalidValueError(f"pos_embed of {tokens} patch positions is not a square grid (plus a class token)")
    if grid == (side, side):
        return pos_embed
    values = pos_embed.float()
    patches = values[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
    scale = (float(grid[0] + _OFFSET) / side, float(grid[1] + _OFFSET) / side)
    patches = F.interpolate(patches, scale_factor=scale, mode="bicubic", antialias=False)
    if tuple(patches.shape[-2:]) != grid:  # the scale floors to the grid for any grid DINOv2 accepts
        raise InvalidValueError(f"DINOv2's interpolation gives a {tuple(patches.shape[-2:])} grid, not {grid}")
    patches = patches.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], dim)
    return torch.cat((values[:, :1], patches), dim=1).to(pos_embed.dtype)


def _check_size(image_size: object) -> int:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1 or image_size % PATCH_SIZE:
        raise InvalidValueError(f"image_size must be a positive multiple of {PATCH_SIZE}, got {image_size!r}")
    return image_size


def _create(name: str, image_size: int) -> nn.Module:
    """The timm architecture of ``name`` at ``image_size``, its config saying how dgm-eval prepares images."""
    overlay = {
        "input_size": (3, image_size, image_size),
        "crop_pct": 1.0,
        "crop_mode": "squash",  # the whole image, resized to a square: no crop
        "interpolation": "bicubic",
    }
    return import_timm().create_model(
        _timm_name(name), pretrained=False, img_size=image_size, pretrained_cfg_overlay=overlay
    )


def _backbone(model: nn.Module, name: str, source: str | None) -> Backbone:
    preprocessing, channels = model_facts(model)  # ImageNet mean/std, 224x224 bicubic squash, from the config
    return Backbone(model, name, source, preprocessing, channels)


def _source(name: str, weights: object) -> str | None:
    """What a Backbone records for ``weights``: None, the local file, or the hub file's stem for "DEFAULT"."""
    return weights_source(
        weights,
        f"{name}_pretrain",
        f"unknown weights {weights!r} for {name}: it has one set, 'DEFAULT' (the torch hub release, "
        f"{os.path.basename(weights_url(name))}); or pass a local .pth/.safetensors file, or None for random init",
    )


def architecture(name: str, weights: WeightsArg = "DEFAULT", *, image_size: int = _IMAGE_SIZE) -> Backbone:
    """What ``load(name, weights, image_size=...)`` gives, with meta parameters: nothing read or initialized.

    Examples:
        >>> from featurehooks.backbones.dinov2 import architecture
        >>> backbone = architecture("dinov2_vitl14")
        >>> backbone.weights, tuple(backbone.model.pos_embed.shape), backbone.model.pos_embed.device.type
        ('dinov2_vitl14_pretrain', (1, 257, 1024), 'meta')
    """
    size = _check_size(image_size)
    source = _source(name, weights)
    with meta_parameters():
        model = _create(name, size)
    return _backbone(model, name, source)


def load(name: str, weights: WeightsArg = "DEFAULT", *, image_size: int = _IMAGE_SIZE) -> Backbone:
    """DINOv2 backbone ``name`` (``"dinov2_vits14"`` ... ``"dinov2_vitg14"``) for ``image_size`` square inputs.

    ``weights``: ``"DEFAULT"`` reads the hub release from torch hub's cache (``weights_path(name)``), downloading
    it first where it is missing and a network is there; a local file may hold the hub's keys or timm's; ``None``
    is timm's random init. The position embedding of the file is resampled once to the input's grid by
    DINOv2's rule (``interpolate_pos_embed``), so the forward at ``image_size`` equals the hub model's.

    Raises:
        BackboneNotFoundError: ``name`` is not one of ``DINOV2_MODELS``.
        WeightsUnavailableError: the file is neither cached nor downloadable (the message names the file and
            the folder), unreadable, or not this network's weights; or ``weights`` is another name.
        InvalidValueError: ``image_size`` is not a multiple of 14.

    Examples:
        >>> import torch
        >>> from featurehooks.backbones.dinov2 import load
        >>> _ = torch.manual_seed(0)
        >>> backbone = load("dinov2_vits14", weights=None)  # random init; "DEFAULT": the hub release
        >>> backbone.name, backbone.preprocessing.resize_size, backbone.preprocessing.crop_mode
        ('dinov2_vits14', 224, 'squash')
    """
    size = _check_size(image_size)
    source = _source(name, weights)
    if source is None:
        return _backbone(_create(name, size), name, None)
    if is_state_dict_file(weights):
        state = read_state_dict(weights)  # type: ignore[arg-type]
    else:
        alternatives = (
            f"download it from {weights_url(name)} (torch.hub.load('facebookresearch/dinov2', '{name}') puts it "
            "there too), or pass weights='path/to/file.pth', or weights=None for random init"
        )
        state = load_hub_checkpoint(weights_url(name), f"{name} (DINOv2)", alternatives)
    state = hub_to_timm(state)
    grid = (size // PATCH_SIZE, size // PATCH_SIZE)
    if "pos_embed" in state and state["pos_embed"].dim() == 3:  # a missing or odd one: adopt_state says so
        # in the model's float32, as the hub model interpolates its float32 parameter (a half file is cast first)
        state["pos_embed"] = interpolate_pos_embed(state["pos_embed"].float(), grid)
    with meta_parameters():
        model = _create(name, size)
    return _backbone(adopt_state(model, state, source, name), name, source)
