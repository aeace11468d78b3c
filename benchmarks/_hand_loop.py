"""The loop a user writes by hand to dump ResNet-18's average-pooled ``layer4`` features of an image folder.

The baseline of ``dump_throughput.py`` (called in its process) and of ``dump_command.py`` (run as a script, a fresh
process each call, as a user runs it).

``torchvision.datasets.ImageFolder`` with ``weights.transforms()``, a ``DataLoader``, a plain torchvision ResNet-18
truncated by hand (``conv1`` .. ``layer4``, ``adaptive_avg_pool2d``, ``flatten``) under ``torch.no_grad()``, the
rows collected and saved with one ``np.save`` at the end. Imports only torch, torchvision and numpy.

    python benchmarks/_hand_loop.py PHOTOS OUT --batch-size 32 --workers 2   # reads TORCH_HOME's ResNet-18 weights
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def truncated_resnet(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What a user writes: the stem and the four stages of a torchvision ResNet, then a global average pool."""

    def features(x: torch.Tensor) -> torch.Tensor:
        x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        x = model.layer4(model.layer3(model.layer2(model.layer1(x))))
        return torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)

    return features


def hand_loop(root: Path, out: Path, transform: Any, model: torch.nn.Module, batch_size: int, workers: int) -> Path:
    """ImageFolder + DataLoader + the truncated model, rows saved by one ``np.save`` as ``out/layer4.npy``."""
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(root), transform=transform)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers, shuffle=False)
    forward = truncated_resnet(model)
    rows = []
    with torch.no_grad():
        for images, _ in loader:
            rows.append(forward(images))
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "layer4.npy", torch.cat(rows).numpy())
    return out / "layer4.npy"


def main(argv: Sequence[str] | None = None) -> None:
    """The script: ResNet-18 with its DEFAULT weights (from the cache under ``TORCH_HOME``), then ``hand_loop``."""
    import torchvision.models as tvm

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", type=Path, help="an ImageFolder: one folder per class")
    p.add_argument("out", type=Path, help="folder to write layer4.npy into")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    weights = tvm.ResNet18_Weights.DEFAULT
    model = tvm.resnet18(weights=weights).eval()
    hand_loop(args.root, args.out, weights.transforms(), model, args.batch_size, args.workers)


if __name__ == "__main__":
    main()
