"""OpenAI's CLIP image towers as backbones (``"clip_vit_l14_336"``, ...), built with transformers (an optional extra).

A name is ``clip_vit_<size><patch>`` plus ``_<resolution>`` where the tower is not a 224 one (``CLIP_TOWERS`` maps
each to its Hugging Face repository). The model is ``CLIPImageTower``: transformers' ``CLIPVisionModelWithProjection``
whose ``forward`` returns ``image_embeds``, the output of its layer ``"visual_projection"`` (``EMBEDDING_LAYER``).
Its architecture comes from the ``config.json`` cached with the weights, else from the values written here; the
weights from the Hugging Face cache (what ``CLIPVisionModelWithProjection.from_pretrained(repo)`` downloaded) or a
local file, never from the network. The preprocessing is CLIP's: resize of the shorter side and center crop to the
tower's resolution (bicubic), CLIP's mean and std.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import Tensor, nn

from ..errors import BackboneNotFoundError, MissingDependencyError, WeightsUnavailableError, did_you_mean, first_line
from ._files import is_state_dict_file, read_state_dict
from ._meta import adopt_state, meta_parameters
from .base import Backbone, Preprocessing

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "CLIP_TOWERS",
    "EMBEDDING_LAYER",
    "PREFIX",
    "CLIPImageTower",
    "architecture",
    "load",
]

PREFIX = "clip_"
EMBEDDING_LAYER = "visual_projection"
"""The layer whose output is the tower's projected embedding (transformers' ``image_embeds``), ``(B, D)``."""
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what from_pretrained looks for, in its order
_TOWER_KEYS = ("vision_model.", "visual_projection.")  # a CLIPModel checkpoint also holds the text tower
_ALTERNATIVES = "or pass weights='path/to/file.safetensors' (or .pth, weights_only), or weights=None for random init"


@dataclass(frozen=True)
class CLIPTower:
    """One OpenAI CLIP image tower: its Hugging Face repository and architecture (``CLIPVisionConfig`` values)."""

    repo: str
    image_size: int
    patch_size: int
    width: int
    depth: int
    heads: int
    embed_dim: int

    def config_values(self) -> dict[str, Any]:
        """The ``CLIPVisionConfig`` keywords of the repository's ``vision_config``."""
        return {
            "hidden_size": self.width,
            "intermediate_size": 4 * self.width,
            "num_hidden_layers": self.depth,
            "num_attention_heads": self.heads,
            "patch_size": self.patch_size,
            "image_size": self.image_size,
            "projection_dim": self.embed_dim,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
        }


CLIP_TOWERS = {
    "clip_vit_b32": CLIPTower("openai/clip-vit-base-patch32", 224, 32, 768, 12, 12, 512),
    "clip_vit_b16": CLIPTower("openai/clip-vit-base-patch16", 224, 16, 768, 12, 12, 512),
    "clip_vit_l14": CLIPTower("openai/clip-vit-large-patch14", 224, 14, 1024, 24, 16, 768),
    "clip_vit_l14_336": CLIPTower("openai/clip-vit-large-patch14-336", 336, 14, 1024, 24, 16, 768),
}
"""The CLIP image towers by featurehooks name; ``"clip_vit_l14_336"`` is the one CMMD uses.

Examples:
    >>> from featurehooks.backbones.clip import CLIP_TOWERS
    >>> CLIP_TOWERS["clip_vit_l14_336"].repo
    'openai/clip-vit-large-patch14-336'
"""


class CLIPImageTower(nn.Module):
    """transformers' ``CLIPVisionModelWithProjection`` with a ``forward`` that returns ``image_embeds``.

    It holds that model's two children under their own names, so its state-dict keys are transformers' (and those
    of the vision half of a ``CLIPModel`` checkpoint): ``vision_model.*`` (the ViT: ``vision_model.encoder.layers.N``
    returns ``(B, 1 + patches, width)`` tokens, the class token first) and ``visual_projection``, whose output is the
    embedding (not scaled to unit length).

    Shape:
        input: ``(B, 3, S, S)`` normalized with CLIP's mean and std, ``S`` the tower's resolution; output: ``(B, D)``.
    """

    num_prefix_tokens = 1  # the class token leads the patch tokens of the encoder's outputs

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.vision_model: nn.Module = model.vision_model  # type: ignore[assignment]
        self.visual_projection: nn.Module = model.visual_projection  # type: ignore[assignment]

    def forward(self, pixel_values: Tensor) -> Tensor:
        pooled = self.vision_model(pixel_values=pixel_values).pooler_output
        return self.visual_projection(pooled)  # type: ignore[no-any-return]


def import_transformers() -> ModuleType:
    """Import transformers or say how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            "CLIP backbones (and CMMD) need the optional dependency transformers: pip install transformers"
        ) from exc
    return transformers


def _tower(name: str) -> CLIPTower:
    """The tower called ``name``, or a BackboneNotFoundError with the closest names."""
    if name not in CLIP_TOWERS:
        raise BackboneNotFoundError(f"unknown CLIP backbone {name!r}; {did_you_mean(name, CLIP_TOWERS)}")
    return CLIP_TOWERS[name]


def _cached(repo: str, filename: str) -> str | None:
    """The path of ``filename`` of ``repo`` (revision main) in the Hugging Face cache, or None; never downloads."""
    from huggingface_hub import constants, try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE)
    return found if isinstance(found, str) else None


def _config(transformers: ModuleType, tower: CLIPTower) -> Any:
    """The ``CLIPVisionConfig`` of ``tower``: from its cached ``config.json`` when there is one, else ours."""
    path = _cached(tower.repo, "config.json")
    if path is None:
        return transformers.CLIPVisionConfig(**tower.config_values())
    try:  # a CLIPModel's config.json: from_pretrained takes its vision_config
        return transformers.CLIPVisionConfig.from_pretrained(os.path.dirname(path))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise WeightsUnavailableError(f"could not read the CLIP config {path}: {first_line(exc)}") from exc


def _source(tower: CLIPTower, weights: object) -> str | None:
    """What a Backbone records for ``weights``: None, the local file, or ``hf:<repo>`` for "DEFAULT"."""
    if weights is None:
        return None
    if is_state_dict_file(weights):
        return os.fspath(weights)  # type: ignore[call-overload,no-any-return]
    if weights == "DEFAULT":
        return f"hf:{tower.repo}"
    raise WeightsUnavailableError(
        f"CLIP weights must be 'DEFAULT' (OpenAI's, {tower.repo} from the Hugging Face cache), a local "
        f".safetensors/.pth file or None, not {weights!r}"
    )


def _preprocessing(image_size: int) -> Preprocessing:
    """CLIP's: the shorter side resized (bicubic) and center-cropped to ``image_size``, CLIP's mean and std."""
    return Preprocessing(CLIP_MEAN, CLIP_STD, image_size, image_size, "bicubic")


def _backbone(model: nn.Module, name: str, source: str | None, config: Any) -> Backbone:
    tower = CLIPImageTower(model).eval()
    return Backbone(tower, name, source, _preprocessing(int(config.image_size)), int(config.num_channels))


def architecture(name: str, weights: object = "DEFAULT") -> Backbone:
    """What ``load(name, weights)`` gives, with its parameters on the meta device: nothing read or initialized.

    Examples:
        >>> from featurehooks.backbones import clip
        >>> backbone = clip.architecture("clip_vit_l14_336")
        >>> backbone.weights, backbone.preprocessing.crop_size, next(backbone.model.parameters()).device
        ('hf:openai/clip-vit-large-patch14-336', 336, device(type='meta'))
    """
    tower = _tower(name)
    transformers = import_transformers()
    source = _source(tower, weights)
    config = _config(transformers, tower)
    with meta_parameters():
        model = transformers.CLIPVisionModelWithProjection(config)
    return _backbone(model, name, source, config)


def _weights_file(tower: CLIPTower, name: str) -> str:
    """The cached weights file of ``tower``, or a WeightsUnavailableError saying where it was looked for."""
    for filename in _WEIGHT_FILES:
        path = _cached(tower.repo, filename)
        if path is not None:
            return path
    from huggingface_hub import constants

    raise WeightsUnavailableError(
        f"pretrained weights for {name!r} ({tower.repo}: {' or '.join(_WEIGHT_FILES)}) are not in the Hugging Face "
        f"cache {constants.HF_HUB_CACHE}, and featurehooks never downloads them. Cache them once, online: "
        f"CLIPVisionModelWithProjection.from_pretrained({tower.repo!r}) (transformers), or set HF_HOME to a cache "
        f"that holds them; {_ALTERNATIVES}"
    )


def _tower_state(state: dict[str, Tensor], model: nn.Module, source: str) -> dict[str, Tensor]:
    """The image tower's tensors of ``state`` (a ``CLIPModel`` or image-tower checkpoint), less the buffers the
    model does not save (older checkpoints hold ``position_ids``)."""
    kept = {key: value for key, value in state.items() if key.startswith(_TOWER_KEYS)}
    if not kept:
        raise WeightsUnavailableError(
            f"{source} holds no CLIP image tower: none of its {len(state)} keys starts with "
            f"{' or '.join(_TOWER_KEYS)} (a CLIPModel or CLIPVisionModelWithProjection state dict has them)"
        )
    unsaved = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    return {key: value for key, value in kept.items() if key not in unsaved}


def load(name: str, weights: object = "DEFAULT") -> Backbone:
    """CLIP image tower ``name`` with its weights: ``"DEFAULT"`` (the Hugging Face cache), a local file, or None.

    ``"DEFAULT"`` reads ``model.safetensors`` (else ``pytorch_model.bin``, with ``weights_only=True``) of the
    tower's repository from the Hugging Face cache (``HF_HOME``), the files ``from_pretrained`` reads; a local
    ``.safetensors``/``.pth`` holds a ``CLIPModel`` or ``CLIPVisionModelWithProjection`` state dict (text-tower keys
    are ignored). ``None`` is transformers' random init: the architecture, not CLIP.

    Raises:
        BackboneNotFoundError: ``name`` is no CLIP tower (see ``CLIP_TOWERS``).
        MissingDependencyError: transformers is not installed.
        WeightsUnavailableError: the weights are not cached (nothing is downloaded), a file is unreadable or
            holds no image tower of this shape, or ``weights`` is another name.
    """
    tower = _tower(name)
    transformers = import_transformers()
    source = _source(tower, weights)
    config = _config(transformers, tower)
    if source is None:
        return _backbone(transformers.CLIPVisionModelWithProjection(config), name, None, config)
    path = source if is_state_dict_file(weights) else _weights_file(tower, name)
    state = read_state_dict(path, mmap=path != source)  # the hub cache is written by rename, never in place
    with meta_parameters():
        model = transformers.CLIPVisionModelWithProjection(config)
    adopt_state(model, _tower_state(state, model, path), path, f"CLIP image tower {name!r}")
    return _backbone(model, name, source, config)
