"""Offline test setup: a temporary TORCH_HOME whose hub cache holds seeded random weights.

torchvision, lpips and piq all look in ``$TORCH_HOME/hub/checkpoints/<file name of the URL>``
before downloading, so the real ``weights="DEFAULT"`` code path runs without a network.

Under pytest-xdist (``make test``) every worker has its own TORCH_HOME, as a single process has, and
each seeded file is written once per run into a store the workers share, then hard-linked into the
worker's cache. Each worker's math libraries get an equal share of the cores: two workers running two
threads each on two cores wait on each other (a 2048-dimensional FD took 130 s instead of 4). torch and the
helpers are imported where they are used: xdist's controller, which runs no test, starts its workers 5 s sooner.
"""

from __future__ import annotations

import os

# Before numpy and torch are imported: OpenBLAS and OpenMP read these once, at load time.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, _threads)

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from filelock import FileLock

if TYPE_CHECKING:
    import torch


@pytest.fixture(scope="session", autouse=True)
def torch_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point every cache at an empty temporary folder for the whole session; no test touches ~/.cache."""
    home = tmp_path_factory.mktemp("torch_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(home))
        patch.setenv("HF_HOME", str(home / "huggingface"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield home


@pytest.fixture(autouse=True)
def quiet_cores_seen() -> None:
    """Every test's streams start as a fresh process's do, from quiet cores, not from what an earlier test saw
    (``cpus.LAST_SEEN``: CI's parallel workers keep the cores busy at times)."""
    from featurehooks._stream import cpus

    cpus.LAST_SEEN.busy = False


@pytest.fixture(scope="session")
def seeded_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of seeded weight files, shared by all xdist workers of this run (the run's temporary root)."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent  # pytest-<n>/popen-gw0 -> pytest-<n>
    store = root / "seeded_weights"
    store.mkdir(exist_ok=True)
    return store


def write_seeded_weights(store: Path, name: str, member: str = "DEFAULT") -> Path:
    """Seeded random weights of torchvision model ``name`` where its ``member`` weights are cached.

    The model gets the arguments torchvision's builder derives from the member (a SWAG ViT is a 384 or
    518 model), so the file has the layout of the real checkpoint, which torchvision itself can load.
    It is initialized as the architecture's own init does after ``torch.manual_seed(0)``, so files of
    members whose layout needs no arguments hold the same values as ``tvm.get_model(name, weights=None)``
    would. The caller's RNG state is left as it was. The file is written once into ``store`` (under a
    lock: xdist workers share it) and linked into this process's cache.
    """
    import torch
    import torchvision.models as tvm

    from featurehooks.backbones._files import hub_checkpoint_path
    from featurehooks.backbones.torchvision_models import random_init_kwargs, resolve_weights

    from helpers import SEED

    weights = resolve_weights(name, member)
    path = hub_checkpoint_path(weights.url)
    if path.exists():
        return path
    shared = store / path.name
    with FileLock(f"{shared}.lock"):
        if not shared.exists():
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                model = tvm.get_model(name, weights=None, **random_init_kwargs(name, weights))
            partial = shared.with_name(f"{shared.name}.partial")
            torch.save(model.state_dict(), partial)
            partial.replace(shared)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(shared, path)
    except OSError:  # another filesystem
        shutil.copyfile(shared, path)
    return path


@pytest.fixture(scope="session")
def seeded_weights(torch_home: Path, seeded_store: Path) -> Callable[..., Path]:
    """``seeded_weights("vgg16")`` caches seeded weights for the DEFAULT (or a named) member."""
    return lambda name, member="DEFAULT": write_seeded_weights(seeded_store, name, member)


@pytest.fixture(scope="session")
def vgg16_cached(seeded_weights: Callable[..., Path]) -> Path:
    """Seeded VGG16 IMAGENET1K_V1 weights in the cache (the file lpips and piq read too)."""
    return seeded_weights("vgg16")


@pytest.fixture(scope="session")
def fid_weights(torch_home: Path) -> Path:
    """Seeded FID Inception weights where pytorch-fid and featurehooks both read them
    (``pt_inception-2015-12-05-6726825d.pth``), written by the benchmarks' recipe (``seeded_fid_weights``): one
    file serves tests and benchmarks, with features of order one as a trained network's (pytorch-fid's ``sqrtm``
    fails on torchvision's init, which multiplies them by about 1e8)."""
    from helpers import load_script

    return load_script("benchmarks/_weights.py").seeded_fid_weights()


@pytest.fixture(scope="session")
def resnet18_cached(seeded_weights: Callable[..., Path]) -> Path:
    """Seeded ResNet18 IMAGENET1K_V1 weights in the cache."""
    return seeded_weights("resnet18")


@pytest.fixture(scope="session")
def png_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``png_folder(count=5, size=(40, 44), seed=0)``: a folder of ``helpers.write_pngs`` images, written once per
    session for each set of arguments. Shared by the tests that ask for it: read it, never write into it."""
    from helpers import SEED, write_pngs

    made: dict[tuple[int, tuple[int, int], int], Path] = {}

    def folder(count: int = 5, size: tuple[int, int] = (40, 44), seed: int = SEED) -> Path:
        key = (count, tuple(size), seed)
        if key not in made:
            name = f"pngs_{count}x{size[0]}x{size[1]}_seed{seed}"
            made[key] = write_pngs(tmp_path_factory.mktemp(name), count, size, seed)
        return made[key]

    return folder


@pytest.fixture
def images() -> torch.Tensor:
    """A small seeded batch in [0, 1]."""
    import torch

    from helpers import SEED

    generator = torch.Generator().manual_seed(SEED)
    return torch.rand(2, 3, 64, 64, generator=generator)


@pytest.fixture
def cpu_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lets ``precision="bf16"`` run on a CPU that featurehooks refuses it on (no native bfloat16): torch emulates
    it there, slower but with bfloat16's rounding, so the option's logic is tested on every machine (its speed is
    the benchmarks' business). Where the CPU has bfloat16, nothing changes."""
    from featurehooks import _precision

    refused = _precision.unsupported

    def unsupported(precision: str, device_type: str, index: int | None) -> str:
        return "" if (precision, device_type) == ("bf16", "cpu") else refused(precision, device_type, index)

    monkeypatch.setattr(_precision, "unsupported", unsupported)


@pytest.fixture(scope="session")
def dinov2_vits14_cached(torch_home: Path) -> dict[str, torch.Tensor]:
    """Seeded ViT-S/14 weights in the hub layout, where ``torch.hub`` caches ``dinov2_vits14``'s release (and
    ``weights="DEFAULT"`` reads it); the state written."""
    import torch

    from featurehooks.backbones import dinov2

    from dinov2_reference import hub_state

    state = hub_state("dinov2_vits14")
    path = Path(dinov2.weights_path("dinov2_vits14"))
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state
