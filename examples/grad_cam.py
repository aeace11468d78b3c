"""Grad-CAM (Selvaraju et al. 2017) for a torchvision classifier, with ``capture(..., grads=True)``.

One forward and one backward: ``capture`` keeps the activations of the chosen layer and, after the
backward of each image's top class score, their gradients. Each channel's weight is the spatial mean
of its gradient; the map is ``relu(sum_c weight_c * activation_c)``, upsampled to the image.

    python examples/grad_cam.py                        # ImageNet weights (cached or downloadable)
    python examples/grad_cam.py --weights none         # offline: seeded random weights
    python examples/grad_cam.py --images a.jpg b.jpg --layer layer3 --out cams.png

The picture goes to ``demo-output/grad_cam.png`` (ignored by git); ``--out docs/grad_cam.png``
redraws the one in the docs.

With random weights the maps show the mechanics only, not what a trained network looks at; the
picture's caption says which weights drew it.

References:
    Selvaraju et al., "Grad-CAM: Visual Explanations from Deep Networks via Gradient-based
    Localization", ICCV 2017.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

import featurehooks as fh
from featurehooks.viz import add_caption

from _common import run, weights_caption

HERE = Path(__file__).parent
DEFAULT_IMAGES = [
    HERE / "images" / name
    for name in ("sample_00_shapes.png", "sample_03_stripes.png", "sample_05_texture.png", "sample_07_shapes.png")
]
# A few anchors of a black-red-yellow-white heat colormap, interpolated linearly.
HEAT = np.array([[0, 0, 4], [87, 16, 110], [188, 55, 84], [249, 142, 9], [252, 255, 164]], dtype=np.float32)
TILE = 160


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weights",
        default="DEFAULT",
        help="'DEFAULT', a weights name such as IMAGENET1K_V1, or 'none' for seeded random weights",
    )
    parser.add_argument("--model", default="resnet18", help="torchvision classifier (default resnet18)")
    parser.add_argument("--layer", default="layer4", help="layer whose activations are weighted (default layer4)")
    parser.add_argument("--images", type=Path, nargs="+", default=DEFAULT_IMAGES, help="image files")
    parser.add_argument("--size", type=int, default=224, help="images are resized to size x size (default 224)")
    parser.add_argument(
        "--out", type=Path, default=Path("demo-output/grad_cam.png"), help="output PNG (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    return parser.parse_args(argv)


def load_images(paths: list[Path], size: int, pre: fh.Preprocessing) -> tuple[torch.Tensor, torch.Tensor]:
    """The images in [0, 1] as (B, 3, size, size), and the same normalized as the weights expect."""
    pictures = []
    for path in paths:
        image = fh.read_image(path)
        image = image.float().div(255) if image.dtype == torch.uint8 else image
        pictures.append(
            F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(
                0, 1
            )
        )
    batch = torch.cat(pictures)
    if pre.mean is None or pre.std is None:
        return batch, batch
    mean, std = torch.tensor(pre.mean).view(1, -1, 1, 1), torch.tensor(pre.std).view(1, -1, 1, 1)
    return batch, (batch - mean) / std


def grad_cam(activations: torch.Tensor, gradients: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Grad-CAM maps (B, H, W) in [0, 1] from a layer's activations and gradients (B, C, h, w)."""
    weights = gradients.mean(dim=(2, 3), keepdim=True)  # alpha_c: global-average-pooled gradients
    cam = torch.relu((weights * activations).sum(dim=1, keepdim=True))
    cam = F.interpolate(cam, size=size, mode="bilinear", align_corners=False)[:, 0]
    return cam / cam.amax(dim=(1, 2), keepdim=True).clamp_min(1e-12)


def heat(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] to RGB floats in [0, 1]."""
    position = np.clip(values, 0, 1) * (len(HEAT) - 1)
    low = np.floor(position).astype(int)
    high = np.minimum(low + 1, len(HEAT) - 1)
    weight = (position - low)[..., None]
    return (HEAT[low] * (1 - weight) + HEAT[high] * weight) / 255


def draw(images: torch.Tensor, cams: torch.Tensor, labels: list[str], caption: str) -> Image.Image:
    """One row per image: the image, its Grad-CAM map, and the map over the image; ``caption`` in a band on top."""
    rows = len(images)
    canvas = Image.new("RGB", (3 * TILE + 4, rows * (TILE + 14)), (255, 255, 255))
    pen = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()
    small = F.interpolate(images, size=(TILE, TILE), mode="bilinear", antialias=True, align_corners=False)
    maps = F.interpolate(cams[:, None], size=(TILE, TILE), mode="bilinear", align_corners=False)[:, 0]
    for row in range(rows):
        top = row * (TILE + 14)
        picture = small[row].permute(1, 2, 0).clamp(0, 1).numpy()
        colored = heat(maps[row].numpy())
        tiles = [picture, colored, 0.5 * picture + 0.5 * colored]
        for column, tile in enumerate(tiles):
            canvas.paste(Image.fromarray((tile * 255).round().astype(np.uint8)), (column * (TILE + 2), top + 14))
        pen.text((2, top + 1), labels[row], fill=(0, 0, 0), font=font)
    return Image.fromarray(add_caption(np.asarray(canvas), caption))


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    weights = None if args.weights.lower() == "none" else args.weights
    torch.manual_seed(args.seed)
    try:
        loaded = fh.load_backbone(args.model, weights)
    except fh.WeightsUnavailableError as exc:
        raise SystemExit(f"{exc}\nrun with --weights none to use seeded random weights offline") from exc
    model = loaded.model.eval().requires_grad_(False)
    images, inputs = load_images(args.images, args.size, loaded.preprocessing)
    inputs.requires_grad_(True)  # the model is frozen: without one input that requires grad there is no graph

    start = time.perf_counter()
    with fh.capture(model, [args.layer], grads=True) as feats:
        logits = model(inputs)
        top = logits.argmax(dim=1)
        logits.gather(1, top[:, None]).sum().backward()  # each image's top class score; samples do not mix
    cams = grad_cam(feats[args.layer].detach(), feats.grads[args.layer], (args.size, args.size))
    elapsed = time.perf_counter() - start

    categories = loaded.weights and _categories(args.model, loaded.weights)
    probabilities = logits.detach().softmax(dim=1)
    labels = []
    for index, path in enumerate(args.images):
        name = f" {categories[int(top[index])]}" if categories else ""
        labels.append(f"{path.name}: class {int(top[index])}{name} ({float(probabilities[index, top[index]]):.1%})")
    kind = weights_caption(args.model, loaded.weights, args.seed)
    caption = f"Grad-CAM, {args.model} {args.layer}: image | map | overlay\n{kind}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    draw(images, cams, labels, caption).save(args.out, optimize=True)

    if not loaded.weights:
        print(
            "note: random weights; the maps show how Grad-CAM works, not what a trained network looks at",
            file=sys.stderr,
        )
    for label in labels:
        print(label)
    print(f"forward + backward + maps for {len(images)} images in {elapsed:.2f} s; wrote {args.out}")
    return args.out


def _categories(model: str, weights: str) -> list[str] | None:
    import torchvision.models as tvm

    try:
        return list(tvm.get_model_weights(model)[weights.rsplit(".", 1)[-1]].meta["categories"])
    except (KeyError, ValueError):  # a local file, or weights without category names
        return None


if __name__ == "__main__":
    run(main)
