"""capture(): hooks on a user's trainable module, filled per forward, removed after the block."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import featurehooks as fh


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2), nn.LeakyReLU(0.2, inplace=True), nn.Conv2d(8, 16, 3), nn.LeakyReLU(0.2)
        )
        self.head = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def hooks(module: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_capture_keeps_training_mode_and_gradients(images: torch.Tensor) -> None:
    disc = Discriminator().train()
    with fh.capture(disc, ["blocks.1", "blocks.3"]) as feats:
        assert hooks(disc) > 0
        logits = disc(images)
    assert hooks(disc) == 0
    assert disc.training and all(p.requires_grad for p in disc.parameters())
    assert list(feats) == ["blocks.1", "blocks.3"]
    (feats["blocks.3"].mean() + logits.mean()).backward()
    assert disc.blocks[0].weight.grad is not None


def test_capture_refills_per_forward_and_renames(images: torch.Tensor) -> None:
    disc = Discriminator()
    with fh.capture(disc, {"blocks.2": "mid"}, mode="detach") as feats:
        disc(images)
        first = feats["mid"]
        disc(images * 0)
    assert list(feats) == ["mid"]
    assert not torch.equal(first, feats["mid"])
    assert not feats["mid"].requires_grad


def test_capture_matches_a_direct_computation(images: torch.Tensor) -> None:
    disc = Discriminator()
    with fh.capture(disc, ["blocks.0"], mode="detach") as feats:
        disc(images)
    torch.testing.assert_close(feats["blocks.0"], disc.blocks[0](images).detach())
    assert (feats["blocks.0"] < 0).any(), "the tap is taken before the in-place LeakyReLU"


def test_capture_removes_hooks_after_an_exception(images: torch.Tensor) -> None:
    disc = Discriminator()
    with pytest.raises(RuntimeError, match="boom"), fh.capture(disc, ["head"]):
        raise RuntimeError("boom")
    assert hooks(disc) == 0


def test_capture_unknown_layer() -> None:
    with pytest.raises(fh.LayerNotFoundError, match="'blocks.1'"), fh.capture(Discriminator(), ["block.1"]):
        pass
