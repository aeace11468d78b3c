"""Reading local state-dict files safely and fetching torch hub checkpoints offline-first."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import WeightsUnavailableError, first_line

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
# Keys under which training checkpoints wrap their state dict, unwrapped in this order (also when nested).
_WRAPPERS = ("state_dict", "model")
# How torch's weights_only unpickler names the class or function it refused to load.
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def is_state_dict_file(weights: object) -> bool:
    """Whether a ``weights=`` value names a local state-dict file rather than an enum member."""
    return isinstance(weights, (str, os.PathLike)) and str(weights).endswith(STATE_DICT_SUFFIXES)


def weights_source(weights: object, hub: str, unknown: str) -> str | None:
    """What a backbone records for ``weights``: None, the local file, or ``hub`` for ``"DEFAULT"``; any other value a
    ``WeightsUnavailableError`` saying ``unknown``."""
    if weights is None:
        return None
    if is_state_dict_file(weights):
        return str(weights)
    if weights == "DEFAULT":
        return hub
    raise WeightsUnavailableError(unknown)


def check_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path if it is an existing file; otherwise a WeightsUnavailableError saying what it is."""
    path = Path(path)
    if path.is_dir():
        raise WeightsUnavailableError(f"weights file {path} is a directory, not a .pth/.safetensors file")
    if not path.is_file():
        raise WeightsUnavailableError(f"weights file not found: {path}")
    return path


def read_state_dict(path: str | os.PathLike[str], *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a torch file, never unpickling arbitrary objects.

    A checkpoint that wraps its weights under ``"state_dict"`` or ``"model"`` is unwrapped. Anything
    else than a non-empty mapping of names to tensors is a WeightsUnavailableError naming the file.
    ``mmap=True`` maps a zip-format torch file instead of reading it: its tensors are read from disk when
    first used, so the layers past a truncated forward are never read. Only for files nobody rewrites in
    place (the hub cache, written by rename): a file truncated under a mapping crashes its reader.
    """
    path = check_file(path)
    try:
        state = _load(path, mmap=mmap)
    except Exception as exc:  # torch, pickle, zipfile and safetensors each raise their own errors
        raise WeightsUnavailableError(_unreadable(path, exc)) from exc
    return check_state_dict(_unwrap(state), path)


def _load(path: Path, *, mmap: bool) -> object:
    """The object stored in ``path``: safetensors for ``.safetensors``, else ``torch.load(weights_only=True)``
    (memory-mapped with ``mmap`` where the file has torch's zip format; older files are read)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    mapped = mmap and zipfile.is_zipfile(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)


def _unreadable(path: Path, exc: Exception) -> str:
    """One line saying why ``path`` could not be read; a refused pickle names what it refused to run."""
    if isinstance(exc, pickle.UnpicklingError):
        found = _REFUSED_GLOBAL.search(str(exc))
        what = f" ({found.group(1)})" if found else ""
        return (
            f"could not read weights file {path}: it holds pickled Python objects{what} besides tensors, which "
            "were neither loaded nor run (weights_only=True); save model.state_dict() or a .safetensors file"
        )
    if isinstance(exc, OSError):
        return f"could not read weights file {path}: {first_line(exc)}"
    kind = "safetensors" if path.suffix == ".safetensors" else "torch.save"
    return f"could not read weights file {path}: not a readable {kind} file (empty, truncated?): {first_line(exc)}"


def _unwrap(state: object) -> object:
    """The state dict inside a training checkpoint (``{"state_dict": ...}``, ``{"model": {"state_dict": ...}}``)."""
    while isinstance(state, Mapping):
        inner = next((state[key] for key in _WRAPPERS if isinstance(state.get(key), Mapping)), None)
        if inner is None:
            break
        state = inner
    return state


def check_state_dict(state: object, path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """``state`` as a dict if it is a non-empty mapping of string keys to tensors; else say what it holds."""
    if not isinstance(state, Mapping):
        raise WeightsUnavailableError(f"{path} holds a {type(state).__name__}, not a state dict of tensors")
    if not state:
        raise WeightsUnavailableError(f"{path} holds an empty state dict: no tensors to load")
    for key, value in state.items():
        if not isinstance(key, str):
            raise WeightsUnavailableError(f"{path} is not a state dict: its key {key!r} is not a parameter name")
        if not isinstance(value, torch.Tensor):
            nested = "; a nested state dict? save the inner one" if isinstance(value, Mapping) else ""
            raise WeightsUnavailableError(
                f"{path} is not a state dict of tensors: {key!r} holds a value of type {type(value).__name__}{nested}"
            )
    return dict(state)


def check_kinds(model: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Refuse integer, boolean or complex tensors for floating-point parameters (a cast would hide a wrong file)."""
    expected = model.state_dict()
    for key, value in state.items():
        target = expected.get(key)
        if target is not None and target.is_floating_point() and not value.is_floating_point():
            raise WeightsUnavailableError(
                f"the weights in {source} do not fit {type(model).__name__}: {key!r} holds {value.dtype} values "
                f"where the model has {target.dtype}; is it a weights file of this model?"
            )


def load_fitting(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, **kwargs: bool) -> None:
    """``model.load_state_dict(state)``, with keys, shapes or dtypes that do not fit reported as a weights error."""
    check_kinds(model, state, source)
    try:
        model.load_state_dict(state, **kwargs)
    except RuntimeError as exc:  # missing/unexpected keys, size mismatches
        detail = " ".join(str(exc).split())[:300]
        raise WeightsUnavailableError(f"the weights in {source} do not fit {type(model).__name__}: {detail}") from exc


def hub_checkpoint_path(url: str) -> Path:
    """Where torch hub caches the file at ``url``: ``$TORCH_HOME/hub/checkpoints/<file name>``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def load_hub_checkpoint(url: str, what: str, alternatives: str) -> dict[str, torch.Tensor]:
    """Load a hub checkpoint from the cache, downloading it first if it is missing.

    Raises:
        WeightsUnavailableError: the file is neither cached nor downloadable; the message names
            the file, the cache folder and ``alternatives``.
    """
    path = hub_checkpoint_path(url)
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(url, str(path), progress=False)
        except Exception as exc:  # URLError, HTTPError, OSError, ... all mean the same to the user
            raise WeightsUnavailableError(
                f"pretrained weights for {what} are not cached and could not be downloaded "
                f"({first_line(exc)}). Put {path.name} into {path.parent} "
                f"(the cache under TORCH_HOME={os.environ.get('TORCH_HOME', '~/.cache/torch')}), "
                f"or {alternatives}"
            ) from exc
    return read_state_dict(path, mmap=True)  # the cache is written by rename, never rewritten in place
