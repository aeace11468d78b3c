"""Train a tiny denoiser with a perceptual loss (Johnson et al. 2016) plus L1, on the bundled images.

The loss module holds a frozen VGG16 outside the model's parameters and state_dict, so the
optimizer only sees the denoiser and checkpoints stay small. Prints the perceptual loss as it falls.

    python examples/train_with_perceptual_loss.py              # 300 steps, under a minute on 2 CPU cores
    python examples/train_with_perceptual_loss.py --amp        # the same under bf16 autocast
    python examples/train_with_perceptual_loss.py --precision bf16   # the frozen VGG16 stored in bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

import featurehooks as fh

from _common import pretrained_or_seeded, run

HERE = Path(__file__).parent


def load_images(folder: Path) -> torch.Tensor:
    """Every PNG in ``folder`` as a float batch in [0, 1]."""
    arrays = [np.asarray(Image.open(p).convert("RGB")) for p in sorted(folder.glob("*.png"))]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def random_batch(images: torch.Tensor, batch: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """Random crops of ``size`` x ``size``, randomly flipped."""
    index = torch.randint(len(images), (batch,), generator=generator)
    top = torch.randint(images.shape[-2] - size + 1, (batch,), generator=generator)
    left = torch.randint(images.shape[-1] - size + 1, (batch,), generator=generator)
    crops = torch.stack([images[i, :, t : t + size, s : s + size] for i, t, s in zip(index, top, left)])
    flip = torch.rand(batch, generator=generator) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1), crops.flip(-1), crops)


class Denoiser(nn.Module):
    """A small residual CNN: output = input + correction."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 3, 3, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x + self.body(x)).clamp(0, 1)


def main(argv: list[str] | None = None) -> tuple[float, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=32, help="crop size in pixels")
    parser.add_argument("--noise", type=float, default=0.15, help="std of the Gaussian noise to remove")
    parser.add_argument("--amp", action="store_true", help="train under bf16 autocast")
    parser.add_argument(
        "--precision", choices=["float32", "bf16", "fp16"], default="float32", help="what the frozen VGG16 computes in"
    )
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    images = load_images(HERE / "images")
    model = Denoiser()
    # frozen VGG16: no parameters, nothing in state_dict
    perceptual = pretrained_or_seeded(
        partial(fh.PerceptualLoss, "vgg16", layers=["relu2_2"], precision=args.precision), "VGG16"
    )
    l1 = nn.L1Loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(0)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if args.amp else contextlib.nullcontext()

    history: list[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        clean = random_batch(images, args.batch, args.size, generator)
        noisy = (clean + args.noise * torch.randn(clean.shape, generator=generator)).clamp(0, 1)
        with amp:
            output = model(noisy)
            loss_p = perceptual(output, clean)
            loss = loss_p + l1(output.float(), clean)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history.append(loss_p.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            recent = history[-args.log_every :]
            print(f"step {step:4d}  perceptual loss {sum(recent) / len(recent):.4g}")
    first = sum(history[:10]) / len(history[:10])
    last = sum(history[-10:]) / len(history[-10:])
    elapsed = time.perf_counter() - start
    print(
        f"perceptual loss fell from {first:.4g} to {last:.4g} ({last / first:.0%} of the start) "
        f"in {elapsed:.0f} s ({1000 * elapsed / args.steps:.0f} ms/step); checkpoint keys: {len(model.state_dict())} "
        f"(the loss adds {len(perceptual.state_dict())})"
    )
    return first, last


if __name__ == "__main__":
    run(main)
