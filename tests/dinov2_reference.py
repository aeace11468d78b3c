"""DINOv2's own forward, written from facebookresearch/dinov2's definitions, and dgm-eval's preprocessing: the oracle
of ``tests/backbones/test_dinov2.py`` and ``tests/metrics/test_fd_dinov2.py`` (the ``dinov2`` package cannot be
installed: its name on the package index is an empty placeholder)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision.transforms as TF
from PIL import Image
from torch import Tensor

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# the hub entries' architectures: (blocks, heads); all are ViT-*/14 trained at 518 (a 37x37 grid)
HUB_HEADS = {"dinov2_vits14": 6, "dinov2_vitb14": 12, "dinov2_vitl14": 16, "dinov2_vitg14": 24}
PHOTOS = ("astronaut", "chelsea", "coffee")  # 512x512, 300x451, 400x600: squashed to 224x224


def hub_state(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Seeded weights of hub entry ``name`` in the hub release's layout (its keys, a 37x37 ``pos_embed``,
    ``mask_token``): the benchmarks' recipe (``benchmarks/_weights.py``), one definition for both."""
    from helpers import load_script

    state = load_script("benchmarks/_weights.py").dinov2_hub_state(name, seed)
    return {key: value.to(dtype) for key, value in state.items()}


def write_photos(folder: Path, names: tuple[str, ...] = PHOTOS, *, flip: bool = False) -> list[Path]:
    """skimage's photos as PNG files in ``folder`` (mirrored with ``flip``), in name order."""
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        pixels = getattr(skimage.data, name)()
        path = folder / f"{name}.png"
        Image.fromarray(pixels[:, ::-1] if flip else pixels).save(path)
        paths.append(path)
    return paths


def dgm_eval_transform(path: Path) -> Tensor:
    """dgm-eval's ``DINOv2Encoder.transform`` of its ``ImagePathDataset`` item (clean_resize off, its default)."""
    image = Image.open(path).convert("RGB")
    resized = TF.Compose([TF.Resize((224, 224), TF.InterpolationMode.BICUBIC), TF.ToTensor()])(image)
    return TF.Normalize(np.array(IMAGENET_MEAN), np.array(IMAGENET_STD))(resized)


def interpolate_pos_encoding(pos_embed: Tensor, x: Tensor, w: int, h: int, patch: int) -> Tensor:
    """``DinoVisionTransformer.interpolate_pos_encoding`` (interpolate_offset=0.1, interpolate_antialias=False)."""
    npatch, n = x.shape[1] - 1, pos_embed.shape[1] - 1
    if npatch == n and w == h:
        return pos_embed
    pos_embed = pos_embed.float()
    class_pos_embed, patch_pos_embed = pos_embed[:, 0], pos_embed[:, 1:]
    dim, w0, h0, m = x.shape[-1], w // patch, h // patch, int(math.sqrt(n))
    scale = (float(w0 + 0.1) / m, float(h0 + 0.1) / m)
    patch_pos_embed = F.interpolate(
        patch_pos_embed.reshape(1, m, m, dim).permute(0, 3, 1, 2), mode="bicubic", antialias=False, scale_factor=scale
    )
    assert (w0, h0) == patch_pos_embed.shape[-2:]
    patch_pos_embed = patch_pos_embed.permute(0, 2, 3, 1).view(1, -1, dim)
    return torch.cat((class_pos_embed.unsqueeze(0), patch_pos_embed), dim=1).to(x.dtype)


def dinov2_oracle(state: dict[str, Tensor], x: Tensor, heads: int) -> Tensor:
    """DINOv2's ``forward`` (eval): ``x_norm_clstoken`` of a hub checkpoint ``state`` (ViT-S/B/L, MLP blocks)."""
    state = {key: value.float() for key, value in state.items()}

    def norm(t: Tensor, prefix: str) -> Tensor:
        return F.layer_norm(t, t.shape[-1:], state[f"{prefix}.weight"], state[f"{prefix}.bias"], eps=1e-6)

    def linear(t: Tensor, prefix: str) -> Tensor:
        return F.linear(t, state[f"{prefix}.weight"], state[f"{prefix}.bias"])

    b, _, w, h = x.shape
    weight = state["patch_embed.proj.weight"]
    tokens = F.conv2d(x, weight, state["patch_embed.proj.bias"], stride=weight.shape[-1]).flatten(2).transpose(1, 2)
    tokens = torch.cat((state["cls_token"].expand(b, -1, -1), tokens), dim=1)
    tokens = tokens + interpolate_pos_encoding(state["pos_embed"], tokens, w, h, weight.shape[-1])
    n, c = tokens.shape[1:]
    depth = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("blocks."))
    for i in range(depth):
        block = f"blocks.{i}"
        qkv = linear(norm(tokens, f"{block}.norm1"), f"{block}.attn.qkv").reshape(b, n, 3, heads, c // heads)
        q, k, v = (part.transpose(1, 2) for part in torch.unbind(qkv, 2))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        tokens = tokens + linear(attended, f"{block}.attn.proj") * state[f"{block}.ls1.gamma"]
        hidden = F.gelu(linear(norm(tokens, f"{block}.norm2"), f"{block}.mlp.fc1"))
        tokens = tokens + linear(hidden, f"{block}.mlp.fc2") * state[f"{block}.ls2.gamma"]
    return norm(tokens, "norm")[:, 0]


def relative_error(found: Tensor, expected: Tensor) -> float:
    """Largest absolute difference as a share of the features' largest magnitude."""
    return float((found - expected).abs().max() / expected.abs().max())
