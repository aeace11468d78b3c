"""Offline test setup: a temporary TORCH_HOME whose hub cache holds seeded random weights.

torchvision, lpips and piq all look in ``$TORCH_HOME/hub/checkpoints/<file name of the URL>``
before downloading, so the real ``weights="DEFAULT"`` code path runs without a network.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torchvision.models as tvm

from featurehooks.backbones._files import hub_checkpoint_path
from featurehooks.backbones.torchvision_models import random_init_kwargs, resolve_weights

SEED = 0


@pytest.fixture(scope="session", autouse=True)
def torch_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point every cache at an empty temporary folder for the whole session; no test touches ~/.cache."""
    home = tmp_path_factory.mktemp("torch_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(home))
        patch.setenv("HF_HOME", str(home / "huggingface"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield home


def write_seeded_weights(name: str, member: str = "DEFAULT") -> Path:
    """Write seeded random weights of torchvision model ``name`` where its ``member`` weights are cached.

    The model gets the arguments torchvision's builder derives from the member (a SWAG ViT is a 384 or
    518 model), so the file has the layout of the real checkpoint, which torchvision itself can load.
    It is initialized as the architecture's own init does, so files of members whose layout needs no
    arguments hold the same values as ``tvm.get_model(name, weights=None)`` would.
    """
    weights = resolve_weights(name, member)
    path = hub_checkpoint_path(weights.url)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(SEED)
        model = tvm.get_model(name, weights=None, **random_init_kwargs(name, weights))
        torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def seeded_weights(torch_home: Path) -> Callable[..., Path]:
    """``seeded_weights("vgg16")`` caches seeded weights for the DEFAULT (or a named) member."""
    return write_seeded_weights


@pytest.fixture(scope="session")
def vgg16_cached(seeded_weights: Callable[..., Path]) -> Path:
    """Seeded VGG16 IMAGENET1K_V1 weights in the cache (the file lpips and piq read too)."""
    return seeded_weights("vgg16")


@pytest.fixture(scope="session")
def resnet18_cached(seeded_weights: Callable[..., Path]) -> Path:
    """Seeded ResNet18 IMAGENET1K_V1 weights in the cache."""
    return seeded_weights("resnet18")


@pytest.fixture
def images() -> torch.Tensor:
    """A small seeded batch in [0, 1]."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.rand(2, 3, 64, 64, generator=generator)
