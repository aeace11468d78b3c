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
