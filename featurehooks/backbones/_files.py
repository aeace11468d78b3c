"""Reading local state-dict files safely and fetching torch hub checkpoints offline-first."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import WeightsUnavailableError

STATE_DICT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


def is_state_dict_file(weights: object) -> bool:
    """Whether a ``weights=`` value names a local state-dict file rather than an enum member."""
    return isinstance(weights, (str, os.PathLike)) and str(weights).endswith(STATE_DICT_SUFFIXES)


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a state dict from ``.safetensors`` or a torch file, never unpickling arbitrary objects.

    A checkpoint that wraps its weights under ``"state_dict"`` or ``"model"`` is unwrapped.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsUnavailableError(f"weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError or EOFError for bad files
        raise WeightsUnavailableError(
            f"could not read weights from {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
        ) from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise WeightsUnavailableError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def load_fitting(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str, **kwargs: bool) -> None:
    """``model.load_state_dict(state)``, with keys or shapes that do not fit reported as a weights error."""
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
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, str(path), progress=False)
        except Exception as exc:  # URLError, HTTPError, OSError, ... all mean the same to the user
            raise WeightsUnavailableError(
                f"pretrained weights for {what} are not cached and could not be downloaded "
                f"({type(exc).__name__}: {exc}). Put {path.name} into {path.parent} "
                f"(the cache under TORCH_HOME={os.environ.get('TORCH_HOME', '~/.cache/torch')}), "
                f"or {alternatives}"
            ) from exc
    return read_state_dict(path)
