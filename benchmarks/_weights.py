"""Seeded weights: every contender runs the same ones.

:func:`seeded_torch_home` points ``TORCH_HOME`` at a folder (a fresh temporary one unless given) and
:func:`seeded_hub_weights` writes seeded random torchvision weights where ``weights="DEFAULT"``, lpips and piq look
for them, with the recipe of ``tests/conftest.py``. Your own ``~/.cache/torch`` is never written to.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from _harness import SEED


@contextlib.contextmanager
def seeded_torch_home(path: str | None) -> Iterator[Path]:
    """Point TORCH_HOME (and HF_HOME) at ``path``, or at a temporary folder removed afterwards."""
    saved = {k: os.environ.get(k) for k in ("TORCH_HOME", "HF_HOME", "HF_HUB_OFFLINE")}
    with contextlib.ExitStack() as stack:
        home = Path(path) if path else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fh_bench_")))
        os.environ["TORCH_HOME"] = str(home)
        os.environ["HF_HOME"] = str(home / "huggingface")
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            yield home
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def seeded_hub_weights(name: str) -> Path:
    """Seeded random weights of torchvision model ``name`` where its DEFAULT weights are cached.

    Same recipe as ``tests/conftest.py`` (seed 0, ``get_model(name, weights=None)``), so lpips, piq,
    torchvision and featurehooks all read one identical file.
    """
    import torchvision.models as tvm

    from featurehooks.backbones._files import hub_checkpoint_path
    from featurehooks.backbones.torchvision_models import resolve_weights

    weights = resolve_weights(name, "DEFAULT")
    path = hub_checkpoint_path(weights.url)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        state = torch.random.get_rng_state()
        torch.manual_seed(SEED)
        model = tvm.get_model(name, weights=None, num_classes=len(weights.meta["categories"]))
        torch.random.set_rng_state(state)
        tmp = path.with_suffix(".partial")
        torch.save(model.state_dict(), tmp)
        tmp.replace(path)
    return path


def seeded_fid_weights() -> Path:
    """Seeded FID Inception weights where pytorch-fid and featurehooks both read them.

    Same recipe as ``tests/conftest.py`` (He-normal convolutions after seed 0, so pool3 features stay of order
    one, as a trained network's are; torchvision's init makes them about 1e8, where pytorch-fid's sqrtm fails).
    """
    from featurehooks.backbones.fid_inception import FIDInceptionV3, fid_weights_path

    path = Path(fid_weights_path())
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = FIDInceptionV3(init_weights=False)
            for layer in model.modules():
                if isinstance(layer, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        torch.save(model.state_dict(), path.with_suffix(".partial"))
        path.with_suffix(".partial").replace(path)
    return path


def load_seeded(name: str) -> torch.nn.Module:
    """A plain torchvision model (no hooks) with the seeded cached weights, frozen and in eval mode (built on the
    meta device, then given the file's tensors: a random init of VGG16 alone takes a second)."""
    import torchvision.models as tvm

    path = seeded_hub_weights(name)
    with torch.device("meta"):
        model = tvm.get_model(name, weights=None)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), assign=True)
    return model.eval().requires_grad_(False)


def seeded_isc_weights(gain: float = 60.0) -> Path:
    """The seeded FID Inception weights with ``fc`` scaled by ``gain``, in ``$TORCH_HOME/isc/``, for the Inception
    Score: the seeded ``fc`` alone gives scores of about 1.0002, which say nothing; scaled, the classes are confident
    enough for a score well above 1 (the recipe of ``tests/metrics/test_inception_score.py``). featurehooks and
    torch-fidelity both read this one file (its key names are pytorch-fid's, which both use)."""
    path = Path(os.environ["TORCH_HOME"]) / "isc" / f"pt_inception-2015-12-05-fc{gain:g}.pth"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        state = torch.load(seeded_fid_weights(), map_location="cpu", weights_only=True)
        state["fc.weight"] = state["fc.weight"] * gain
        torch.save(state, path.with_suffix(".partial"))
        path.with_suffix(".partial").replace(path)
    return path


def dinov2_hub_state(name: str, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Seeded weights of DINOv2 hub entry ``name`` (``"dinov2_vits14"``...) in the hub release's layout: its keys, a
    37x37 ``pos_embed`` and ``mask_token``, scaled so that every block and the interpolated position embedding shape
    the features (the recipe of ``tests/dinov2_reference.py``'s ``hub_state``)."""
    import math

    import timm

    from featurehooks.backbones.dinov2 import DINOV2_MODELS

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in timm.create_model(DINOV2_MODELS[name], img_size=518).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in shapes.items():
        noise = torch.randn(shape, generator=generator)
        if key.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
            value = 1 + 0.1 * noise
        elif key.endswith("gamma"):
            value = 0.2 + 0.3 * torch.rand(shape, generator=generator)
        elif key in ("pos_embed", "cls_token"):
            value = 0.5 * noise
        elif key.endswith("weight"):
            value = noise / math.sqrt(math.prod(shape[1:]))
        else:
            value = 0.02 * noise
        hub_key = key.replace("mlp.fc1.", "mlp.w12.").replace("mlp.fc2.", "mlp.w3.") if "vitg" in name else key
        state[hub_key] = value
    state["mask_token"] = torch.zeros(1, shapes["cls_token"][-1])
    return state


def seeded_dinov2_weights(name: str) -> Path:
    """Seeded weights of DINOv2 hub entry ``name`` where ``torch.hub.load`` caches the release (and featurehooks'
    ``weights="DEFAULT"`` reads it): ``$TORCH_HOME/hub/checkpoints/<name>_pretrain.pth`` (:func:`dinov2_hub_state`)."""
    from featurehooks.backbones.dinov2 import weights_path

    path = Path(weights_path(name))
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(dinov2_hub_state(name), path.with_suffix(".partial"))
        path.with_suffix(".partial").replace(path)
    return path


CLIP_REPO = "openai/clip-vit-large-patch14-336"  # CMMD's tower, whose cache entry the seeded ones stand in for
# image towers at CMMD's 336 pixels (CLIPVisionConfig values): "tiny" for quick runs; "base", ViT-B/32's width, depth
# and token count (7x7 patches of 48, where 32 does not divide 336); "large", ViT-L/14@336 itself (24x24 patches)
CLIP_VISION: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "patch_size": 48, "projection_dim": 16},
    "base": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "patch_size": 48, "projection_dim": 512},
    "large": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
              "patch_size": 14, "projection_dim": 768},
}  # fmt: skip


@contextlib.contextmanager
def hub_cache_in_hf_home() -> Iterator[Path]:
    """Within the block, huggingface_hub reads its cache from ``$HF_HOME/hub`` (as set by :func:`seeded_torch_home`),
    even where it was imported before ``HF_HOME`` was set (it reads the variable once, at import)."""
    from huggingface_hub import constants

    saved, cache = constants.HF_HUB_CACHE, Path(os.environ["HF_HOME"]) / "hub"
    constants.HF_HUB_CACHE = str(cache)
    try:
        yield cache
    finally:
        constants.HF_HUB_CACHE = saved


def seeded_clip_cache(size: str, seed: int = SEED) -> Path:
    """A seeded ``CLIPModel`` (image tower of ``CLIP_VISION[size]`` at 336 pixels, a tiny text tower) cached as
    huggingface_hub caches ``config.json`` and ``model.safetensors`` of ``CLIP_REPO``, under ``$HF_HOME/hub``, where
    featurehooks' ``weights="DEFAULT"`` reads it; returns the snapshot folder (``from_pretrained`` reads it too).
    Each size has its own snapshot, and ``refs/main`` points at the one asked for (the recipe of
    ``tests/clip_reference.py``'s ``write_clip_cache``)."""
    import hashlib

    import transformers
    from huggingface_hub import constants
    from safetensors.torch import save_file

    cache = Path(os.environ["HF_HOME"]) / "hub"
    if Path(constants.HF_HUB_CACHE).resolve() != cache.resolve():
        raise SystemExit(
            f"huggingface_hub reads its cache from {constants.HF_HUB_CACHE}, not {cache}: write the seeded CLIP "
            "within hub_cache_in_hf_home()"
        )
    folder = cache / f"models--{CLIP_REPO.replace('/', '--')}"
    commit = hashlib.sha1(f"{size}-{seed}".encode()).hexdigest()
    snapshot = folder / "snapshots" / commit
    if not (snapshot / "model.safetensors").exists():
        vision: dict[str, Any] = {**CLIP_VISION[size], "image_size": 336, "hidden_act": "quick_gelu"}
        text = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        text |= {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}  # within the tiny vocabulary
        config = transformers.CLIPConfig(
            text_config=text, vision_config=vision, projection_dim=CLIP_VISION[size]["projection_dim"]
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            state = transformers.CLIPModel(config).state_dict()
        snapshot.mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(snapshot / "config.json"))
        partial = snapshot / "model.partial"
        save_file({key: value.contiguous() for key, value in state.items()}, str(partial))
        partial.replace(snapshot / "model.safetensors")
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot
