"""Watch the activations and gradients of a small CNN while it trains, and plot them over the steps.

The CNN learns to tell the orientation of noisy stripes (four classes, generated on the fly).
``watch`` keeps per-layer statistics of the outputs and of the gradients flowing back into them on
the device; every ``--every`` steps the window is read once (``summary``), stored and reset. The
plot shows the standard deviation of each layer's output and of its gradient, the fraction of
exact zeros after each ReLU (dead units), and the loss.

    python examples/watch_training.py                          # about 10 s on 2 CPU cores: demo-output/watch.png
    python examples/watch_training.py --lr 0.3 --out big_lr.png  # too large a step: watch the zeros grow
    python examples/watch_training.py --csv watch.csv          # also every window's rows as CSV

The plot goes to ``demo-output/watch.png`` (ignored by git); ``--out docs/watch.png`` redraws the
picture in the docs.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from featurehooks.probes.watch import watch

ANGLES = (0.0, math.pi / 2, math.pi / 4, -math.pi / 4)  # one class per stripe orientation
NOISE = 2.0  # noise std, against stripes of amplitude 1


def stripes(batch: int, size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Noisy sinusoidal stripes in one of four orientations, and the orientation index."""
    labels = torch.randint(len(ANGLES), (batch,), generator=generator)
    angles = torch.tensor(ANGLES)[labels].view(-1, 1, 1)
    coords = torch.linspace(-1, 1, size)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    frequency = 4 + 4 * torch.rand(batch, 1, 1, generator=generator)
    phase = 2 * math.pi * torch.rand(batch, 1, 1, generator=generator)
    waves = torch.sin(frequency * math.pi * (x * torch.cos(angles) + y * torch.sin(angles)) + phase)
    images = waves.unsqueeze(1).expand(-1, 3, -1, -1) + NOISE * torch.randn(batch, 3, size, size, generator=generator)
    return images, labels


class SmallCNN(nn.Module):
    """Three convolutions with ReLUs and pooling, then a linear classifier; no normalization layers."""

    def __init__(self, width: int = 16, classes: int = len(ANGLES)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1, stride=2)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(2 * width, 4 * width, 3, padding=1, stride=2)
        self.relu3 = nn.ReLU()
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu1(self.conv1(x))
        h = self.relu2(self.conv2(h))
        h = self.relu3(self.conv3(h))
        return self.fc(h.mean((2, 3)))


def train(args: argparse.Namespace) -> tuple[list[int], dict[tuple[str, str], dict[str, list[float]]], list[float]]:
    """Train for ``args.steps`` steps; return the window ends, per-(layer, kind) statistics and the losses."""
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    model = SmallCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    windows: list[int] = []
    series: dict[tuple[str, str], dict[str, list[float]]] = {}
    losses: list[float] = []
    with watch(model, ["conv*", "relu*", "fc"]) as w:
        for step in range(1, args.steps + 1):
            images, labels = stripes(args.batch, args.size, generator)
            loss = nn.functional.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())  # the training loop's own logging; watch itself reads nothing here
            if step % args.every == 0:
                rows = w.to_csv(args.csv, step=step, append=step > args.every) if args.csv else w.summary()
                windows.append(step)
                for row in rows:
                    stats = series.setdefault((row.name, row.kind), {"std": [], "zeros": [], "absmax": []})
                    for name in stats:
                        stats[name].append(getattr(row, name))
                w.reset()
    return windows, series, losses


def plot(
    path: Path,
    windows: list[int],
    series: dict[tuple[str, str], dict[str, list[float]]],
    losses: list[float],
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    convs = [name for name, kind in series if kind == "output" and not name.startswith("relu")]
    relus = [name for name, kind in series if kind == "output" and name.startswith("relu")]
    colors = {name: plt.get_cmap("viridis")(k / max(len(convs) - 1, 1)) for k, name in enumerate(convs)}
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.4))
    ax = axes[0, 0]
    for name in convs:
        ax.plot(windows, series[(name, "output")]["std"], color=colors[name], label=name)
    ax.set(title="output std", xlabel="step", yscale="log")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for name in convs:
        ax.plot(windows, series[(name, "grad")]["std"], color=colors[name], label=name)
    ax.set(title="gradient std (w.r.t. the output)", xlabel="step", yscale="log")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    for k, name in enumerate(relus):
        ax.plot(windows, series[(name, "output")]["zeros"], color=plt.get_cmap("magma")(0.2 + 0.25 * k), label=name)
    ax.set(title="fraction of exact zeros after ReLU", xlabel="step", ylim=(0, 1))
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    ax.plot(range(1, len(losses) + 1), losses, color="0.6", lw=0.8, label="per step")
    window = windows[0] if windows else 1
    smooth = [sum(losses[i - window : i]) / window for i in windows]
    ax.plot(windows, smooth, color="black", label=f"mean of {window}")
    ax.set(title="loss", xlabel="step")
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10, help="steps per statistics window")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", type=Path, default=None, help="also append every window's rows to this CSV file")
    p.add_argument(
        "--out", type=Path, default=Path("demo-output") / "watch.png", help="output PNG (default: %(default)s)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    windows, series, losses = train(args)
    title = (
        f"watch on a small CNN learning stripe orientations (SGD lr={args.lr:g}, batch {args.batch}, "
        f"windows of {args.every} steps)"
    )
    plot(args.out, windows, series, losses, title)
    print(
        f"{args.steps} steps in {time.perf_counter() - start:.1f} s, final loss {sum(losses[-20:]) / 20:.3f}; "
        f"plot: {args.out}"
    )


if __name__ == "__main__":
    main()
