"""timm models as ``timm/<name>``; timm is an optional extra, imported only when asked for.

Pretrained weights come from the Hugging Face hub cache when they are there (no network, like
torchvision's hub cache). Otherwise, with ``HF_HUB_OFFLINE=1`` the load fails at once, and online a
single quick request checks that the hub can be reached before timm downloads, because
huggingface_hub retries an unreachable hub with backoff for about 45 seconds.
"""

from __future__ import annotations

import math
import os
import pickle
from types import ModuleType
from typing import Any

from safetensors import SafetensorError
from torch import nn

from ..errors import BackboneNotFoundError, MissingDependencyError, WeightsUnavailableError, did_you_mean, first_line
from ._files import check_kinds, is_state_dict_file, read_state_dict, weights_source
from ._meta import meta_parameters
from .base import Backbone, Preprocessing, Size

PREFIX = "timm/"
# Values of HF_HUB_OFFLINE that mean "offline", as huggingface_hub reads them.
_TRUE = ("1", "ON", "YES", "TRUE")
# What timm raises when it cannot download, read or fit weights (missing keys and wrong shapes are RuntimeErrors).
_LOAD_ERRORS = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)
_ALTERNATIVES = "pass weights='path/to/file.safetensors', or weights=None for random init"


def import_timm() -> ModuleType:
    """Import timm or explain which extra installs it."""
    try:
        import timm
    except ImportError as exc:
        raise MissingDependencyError(
            "timm backbones need the optional dependency timm: pip install 'featurehooks[timm]'"
        ) from exc
    return timm


def _check_name(timm: ModuleType, name: str) -> None:
    """Raise BackboneNotFoundError for a model timm does not know, or a pretrained tag it has not got."""
    if not timm.is_model(name):
        hint = did_you_mean(name, timm.list_models())
        raise BackboneNotFoundError(f"unknown timm model {name!r}; {hint} See timm.list_models().")
    architecture, _, tag = name.partition(".")
    tagged = timm.list_pretrained(f"{architecture}.*")
    if tag and name not in tagged:
        hint = did_you_mean(name, tagged)
        raise BackboneNotFoundError(
            f"timm model {architecture!r} has no pretrained tag {tag!r}; {hint} "
            f"See timm.list_pretrained('{architecture}.*')."
        )


def _data_config(model: nn.Module) -> dict[str, Any]:
    """The model's ``pretrained_cfg`` resolved the way timm's own transforms resolve it."""
    return import_timm().data.resolve_data_config({}, model=model)


def _preprocessing(config: dict[str, Any]) -> Preprocessing:
    """What ``timm.data.create_transform(**config)`` does at eval: its sizes, crop mode, interpolation and Normalize.

    The arithmetic is ``transforms_imagenet_eval``'s: the resize is ``floor(side / crop_pct)`` per side; a square
    one resizes the shorter side (an int), a non-square one keeps the ratio (a pair); modes other than "squash"
    and "border" are "center".
    """
    height, width = (int(side) for side in config["input_size"][-2:])
    crop_pct = float(config["crop_pct"])  # resolve_data_config puts timm's default in place of a missing one
    mode = config["crop_mode"] if config["crop_mode"] in ("squash", "border") else "center"  # timm's else branch
    mean = tuple(float(v) for v in config["mean"])
    return Preprocessing(
        mean=mean,
        std=tuple(float(v) for v in config["std"]),
        resize_size=_size(math.floor(height / crop_pct), math.floor(width / crop_pct)),
        crop_size=_size(height, width),
        interpolation=str(config["interpolation"]),
        crop_mode=mode,
        fill=tuple(round(255 * v) for v in mean) if mode == "border" else None,
    )


def _size(height: int, width: int) -> Size:
    """An int for a square (the shorter side, for a center resize), else ``(height, width)``."""
    return height if height == width else (height, width)


def is_timm_model(module: nn.Module) -> bool:
    """Whether ``module`` was built by timm: a class from timm carrying a ``pretrained_cfg`` dict.

    Told without importing timm, so it costs nothing where timm is not installed (then no module is timm's).
    A timm class constructed directly, not by ``timm.create_model``, has no config and is not counted.
    """
    from_timm = any(cls.__module__.split(".")[0] == "timm" for cls in type(module).__mro__)
    return from_timm and isinstance(getattr(module, "pretrained_cfg", None), dict)


def model_facts(model: nn.Module) -> tuple[Preprocessing, int]:
    """Preprocessing and input channels from a timm model's ``pretrained_cfg``, for a name or an instance alike.

    The channels come from the config, not the first conv: tresnet's space-to-depth stem convolves 48 channels
    of a 3-channel image.
    """
    config = _data_config(model)
    return _preprocessing(config), int(config["input_size"][0])


def _backbone(model: nn.Module, name: str, source: str | None) -> Backbone:
    """A Backbone with preprocessing and input channels from the model's ``pretrained_cfg``."""
    preprocessing, channels = model_facts(model)
    return Backbone(model, PREFIX + name, source, preprocessing, channels)


_UNKNOWN_WEIGHTS = (
    "timm weights must be 'DEFAULT', a local .pth/.safetensors file or None, not {weights!r}; "
    "pick a pretrained tag in the name instead (timm/{name}.<tag>)"
)


def _source(name: str, weights: str | os.PathLike[str] | None) -> str | None:
    """Where the weights of ``name`` come from: None, the local file, or ``timm:<name>`` for "DEFAULT"."""
    return weights_source(weights, f"timm:{name}", _UNKNOWN_WEIGHTS.format(weights=weights, name=name))


def _meta_model(timm: ModuleType, name: str) -> nn.Module:
    """Model ``name`` with meta parameters: its architecture, nothing read or initialized."""
    with meta_parameters():
        return timm.create_model(name, pretrained=False)


def architecture(name: str, weights: str | os.PathLike[str] | None) -> Backbone:
    """What ``load`` gives for these ``weights``, with meta parameters: nothing downloaded, read or initialized."""
    timm = import_timm()
    _check_name(timm, name)
    source = _source(name, weights)
    return _backbone(_meta_model(timm, name), name, source)


def _offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids the network, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def _candidates(filename: str) -> tuple[str, ...]:
    """The files timm tries for ``filename`` on the hub, a safetensors alternative first."""
    if not filename.endswith(".bin"):
        return (filename,)
    stem = filename[: -len(".bin")]
    safe = {"pytorch_model": "model", "open_clip_pytorch_model": "open_clip_model"}.get(stem, stem)
    return (f"{safe}.safetensors", filename)


def _hub_overlay(timm: ModuleType, name: str) -> dict[str, str] | None:
    """``{"file": cached path}`` when the hub weights of ``name`` are cached; None to let timm download.

    Raises:
        WeightsUnavailableError: they are not cached and HF_HUB_OFFLINE is set or the hub cannot be reached.
    """
    from huggingface_hub import constants, try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id or cfg.custom_load:  # torch hub URLs and custom formats: timm's way
        return None
    repo, _, revision = cfg.hf_hub_id.partition("@")
    files = _candidates(cfg.hf_hub_filename or "pytorch_model.bin")
    for filename in files:
        found = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE, revision=revision or None)
        if isinstance(found, str):
            return {"file": found}
    what = f"pretrained weights for timm model {name!r} ({repo}: {' or '.join(files)})"
    if _offline():
        raise WeightsUnavailableError(
            f"{what} are not in the Hugging Face cache {constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE=1 forbids "
            f"downloading them; set HF_HOME to a cache that holds them, {_ALTERNATIVES}"
        )
    _check_hub_reachable(what, repo, files[0], revision or None)
    return None


def _check_hub_reachable(what: str, repo: str, filename: str, revision: str | None) -> None:
    """One request without retries (timeout: HF_HUB_ETAG_TIMEOUT, default 10 s); any HTTP answer will do."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError:  # the hub answered (404 for a missing alternative, 401, 5xx): timm takes it from here
        return
    except Exception as exc:  # connection refused, DNS failure, timeout: the network is not there
        raise WeightsUnavailableError(
            f"{what} are not cached and the Hugging Face hub cannot be reached ({first_line(exc)}); offline, "
            f"set HF_HUB_OFFLINE=1 to fail at once. Set HF_HOME to a cache that holds them, {_ALTERNATIVES}"
        ) from exc


def _check_file(timm: ModuleType, name: str, path: str) -> None:
    """Read ``path`` as a state dict and check its dtypes before timm loads it: any fault is one clear error."""
    state = read_state_dict(path)
    check_kinds(_meta_model(timm, name), state, path)


def load(name: str, weights: str | os.PathLike[str] | None) -> Backbone:
    """Create timm model ``name``; ``weights``: "DEFAULT" (timm's pretrained tag), a local file, or None.

    timm reads files with ``weights_only=True`` (or safetensors) and applies the model's checkpoint filter.
    """
    timm = import_timm()
    _check_name(timm, name)
    source = _source(name, weights)
    if source is None:
        return _backbone(timm.create_model(name, pretrained=False), name, None)
    if is_state_dict_file(weights):
        _check_file(timm, name, source)
        overlay: dict[str, str] | None = {"file": source}
    else:
        overlay = _hub_overlay(timm, name)
    try:
        model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay)
    except _LOAD_ERRORS as exc:
        raise WeightsUnavailableError(_load_failed(name, overlay, exc)) from exc
    return _backbone(model, name, source)


def _load_failed(name: str, overlay: dict[str, str] | None, exc: Exception) -> str:
    """One line on why timm could not load the weights of ``name`` (from ``overlay["file"]``, or the hub)."""
    detail = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if overlay is not None:
        return f"could not load the weights in {overlay['file']} into timm model {name!r} ({detail})"
    return (
        f"pretrained weights for timm model {name!r} are not cached and could not be loaded ({detail}); "
        f"offline, set HF_HUB_OFFLINE=1 to fail at once. Set HF_HOME to a cache that holds them, {_ALTERNATIVES}"
    )
