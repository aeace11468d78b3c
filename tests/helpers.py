"""What the test files share: the repository's root, scripts loaded by path, a tiny seeded extractor, a folder of
seeded random PNGs, sweeps sampled for ``make test-fast``, a deadline for code that could hang, a scaling module
for the probes, the CLI as two CPU ranks (under torchrun, or started as torchrun starts them).

The fixtures over them (and the seeded weights cache) live in ``conftest.py``; these are plain functions
because module-level helpers of the test files (``dump(...)``) call them too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from featurehooks import FeatureExtractor, _precision

SEED = 0
REPO = Path(__file__).resolve().parents[1]
# the command line's smallest real model: ResNet-18 at random init, layer1 of 36 px images cropped to 32
TINY_CLI_MODEL = ["--backbone", "resnet18", "--layers", "layer1", "--weights", "none", "--resize", "36", "--crop", "32"]


def load_script(relative: str) -> ModuleType:
    """The script ``REPO/relative`` (``benchmarks/losses.py``) as a module, registered in ``sys.modules``
    (dataclasses look their module up there). Its folder leads ``sys.path`` while it loads, as when it runs as a
    script, so its imports of the modules beside it (``_harness``, ``_common``) work."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(f"_fh_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def tiny_extractor(
    layers: tuple[str, ...] | list[str] = ("relu1", "conv2"),
    *,
    channels: tuple[int, ...] = (8, 16),
    stride: int = 2,
    **kwargs: object,
) -> FeatureExtractor:
    """An extractor over a seeded conv net that builds in milliseconds: ``conv1`` (3x3, ``stride``), ``relu1``
    and, with a second width in ``channels``, ``conv2`` (3x3). Normalized by mean 0.5 and std 0.25.

    The global RNG is seeded with 0 first, as every copy of this helper did.
    """
    torch.manual_seed(SEED)
    parts: OrderedDict[str, nn.Module] = OrderedDict(conv1=nn.Conv2d(3, channels[0], 3, stride=stride), relu1=nn.ReLU())
    if len(channels) > 1:
        parts["conv2"] = nn.Conv2d(channels[0], channels[1], 3)
    options = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25), **kwargs}
    return FeatureExtractor(nn.Sequential(parts), list(layers), **options)


def bf16_value_and_grad(
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``value_and_grad`` of ``metric`` run under CPU bfloat16 autocast (the gradient taken outside it)."""

    def under_autocast(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return metric(a, b)

    return value_and_grad(under_autocast, x, y)


needs_cpu_bf16 = pytest.mark.skipif(
    bool(_precision.unsupported("bf16", "cpu", None)), reason="this CPU has no native bfloat16 (precision='bf16')"
)
"""Marks a test of ``precision="bf16"`` on the CPU too slow to run emulated: it runs where featurehooks lets bf16
run (AVX512-BF16, AMX-BF16, Arm BF16). Emulated (an AVX2 EPYC), a VGG16 step in bf16 took 36x float32's time."""

CASTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    ".half()": lambda m: m.half(),
    ".to(torch.bfloat16)": lambda m: m.to(torch.bfloat16),
    ".half().float()": lambda m: m.half().float(),
    ".double()": lambda m: m.double(),
}
"""Casts a user applies to a model holding an extractor, loss or metric: under ``precision="bf16"``/``"fp16"`` each
must leave what runs bitwise as it was (float16 ends at 65504; float32 normalization and calibration stay)."""

bf16_anywhere = pytest.mark.usefixtures("cpu_bf16")
"""Marks a test of ``precision="bf16"`` on the CPU that runs on every machine: natively where the CPU has bfloat16,
emulated elsewhere (the ``cpu_bf16`` fixture), so CI on any CPU tests the option's logic."""


def photos(size: int = 64, count: int = 2) -> torch.Tensor:
    """``count`` of scikit-image's photos (astronaut, coffee, chelsea, rocket) as ``(count, 3, size, size)`` floats in
    [0, 1], center-cropped square and resized with antialiasing: real images for tests of precision and losses."""
    from skimage import data

    images = []
    for load in (data.astronaut, data.coffee, data.chelsea, data.rocket)[:count]:
        array = load()
        side = min(array.shape[:2])
        top, left = (array.shape[0] - side) // 2, (array.shape[1] - side) // 2
        square = torch.from_numpy(np.ascontiguousarray(array[top : top + side, left : left + side]))
        pixels = square.permute(2, 0, 1)[None].float() / 255
        images.append(torch.nn.functional.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True))
    return torch.cat(images).clamp(0, 1)


def degraded_photos(size: int = 64, count: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``photos`` with seeded Gaussian noise (std 0.1) and the photos: a restoration model's output and its target."""
    target = photos(size, count)
    noise = 0.1 * torch.randn(target.shape, generator=torch.Generator().manual_seed(SEED))
    return (target + noise).clamp(0, 1), target


def value_and_grad(
    metric: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``metric(x, y)`` and the gradient of its sum to ``x``, both checked float32 and finite (what a loss or metric
    in any precision hands back)."""
    leaf = x.clone().requires_grad_(True)
    value = metric(leaf, y)
    (grad,) = torch.autograd.grad(value.sum(), leaf)
    assert value.dtype == torch.float32 and grad.dtype == torch.float32
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    return value, grad


def maps_and_own_softmaxes(
    model: nn.Module, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """``capture_attention``'s maps of one forward (the outputs checked bitwise those without it), and every
    ``F.softmax`` result of a second forward, in call order: the maps of models that take their own softmax."""
    from featurehooks.attention import capture_attention

    with torch.no_grad():
        expected = model(x)
        with capture_attention(model) as maps:
            out = model(x)
    assert torch.equal(out, expected)
    softmaxes: list[torch.Tensor] = []
    original = torch.nn.functional.softmax

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        softmaxes.append(original(*args, **kwargs))
        return softmaxes[-1]

    monkeypatch.setattr(torch.nn.functional, "softmax", recording)
    with torch.no_grad():
        model(x)
    return dict(maps), softmaxes


def write_pngs(folder: Path, count: int = 5, size: tuple[int, int] = (40, 44), seed: int = SEED) -> Path:
    """``count`` random RGB PNGs ``0.png``, ``1.png``, ... of ``size`` (height, width) from one seeded generator."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def slow_unless(values: Iterable[Any], fast: Collection[Any]) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize``, each marked slow unless it is in ``fast``: ``make test-fast``
    runs the sample, ``make test`` every value. A tuple value holds the arguments of several argnames."""
    return [
        pytest.param(
            *(value if isinstance(value, tuple) else (value,)), marks=() if value in fast else pytest.mark.slow
        )
        for value in values
    ]


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging for ever (a FIFO opened for reading, a symlink cycle)."""

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Scale(nn.Module):
    """Multiplies by ``value`` (``math.nan`` or ``math.inf`` makes a non-finite output on purpose)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value


class _ChangedGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.change = change
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.change(grad), None


class ChangesGradient(nn.Module):
    """Identity forward (a copy); backward hands on ``change(grad)``: a NaN, an inf, an in-place change or an error,
    made there on purpose."""

    def __init__(self, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.change = change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ChangedGradient.apply(x, self.change)


class FlattensWithView(nn.Module):
    """A convolution then ``.view``: fine in NCHW, an error for channels-last strides (at any input size)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(nn.functional.adaptive_avg_pool2d(self.conv(x), 8).view(x.shape[0], -1))


def free_port() -> int:
    """A TCP port nothing listens on now, for torchrun's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m featurehooks ARGS`` on CPU; the whole process group dies on timeout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # TORCH_HOME (seeded weights) is inherited
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "featurehooks", *args,
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun timed out: {stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def each_rank(command: list[str], env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``command`` as two CPU ranks with the environment torchrun gives its workers (rank, world size, rendezvous
    address) and ``env``, started without torchrun's launcher process (its start-up alone is 2.6 s of CPU a test);
    each rank's result, rank 0's first. Both ranks are killed if either outlives the deadline (a rank waiting for
    the other at a rendezvous would otherwise outlive the test)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        ranked = {
            **os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", **(env or {}),
        }  # fmt: skip
        procs.append(subprocess.Popen(command, env=ranked, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120))
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"two ranks timed out: {procs[0].communicate()[1][-3000:]}")
    return [subprocess.CompletedProcess(command, proc.returncode, *out) for proc, out in zip(procs, outputs)]


def two_ranks(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m featurehooks ARGS`` as two CPU ranks (``each_rank``): the ranks' outputs one after the other,
    rank 0's first, and the first failing rank's status. ``torchrun`` runs the real launcher."""
    command = [sys.executable, "-m", "featurehooks", *args]
    ranks = each_rank(command)
    code = next((rank.returncode for rank in ranks if rank.returncode), 0)
    stdout, stderr = ("".join(getattr(rank, stream) for rank in ranks) for stream in ("stdout", "stderr"))
    return subprocess.CompletedProcess(command, code, stdout, stderr)
