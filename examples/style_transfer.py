"""Neural style transfer by optimization (Gatys et al. 2016): content + style + total variation.

One VGG19 forward per step serves all three terms: the content and style losses share a
FeatureExtractor built over the union of their layers, the content features and the style Grams
are computed once, and LossGroup dispatches the features of the image being optimized.

    python examples/style_transfer.py                       # bundled images, about 2 minutes on 2 CPU cores
    python examples/style_transfer.py --content me.jpg --style starry.jpg --size 384 --steps 300 --out out.png
    python examples/style_transfer.py --precision bf16      # VGG19 stored in bfloat16 (AVX512-BF16 CPUs, GPUs)
    python examples/style_transfer.py --demo                # the short run of `make demo`: 60 steps at 128 px

Pretrained VGG19 weights are used when cached (or downloadable); otherwise the example says so in
one line and goes on with seeded random weights (``--seed``), which still transfer colours and
textures. The picture's caption names the weights that drew it, or says they are random;
``python examples/style_transfer.py --side-by-side --out docs/style_transfer.png`` redraws the one
in the docs.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

import featurehooks as fh
import featurehooks.losses as fl
from featurehooks.viz import add_caption

from _common import pretrained_or_seeded, run, weights_caption

HERE = Path(__file__).parent

CONTENT_LAYERS = ["relu4_2"]
STYLE_LAYERS = ["relu1_1", "relu2_1", "relu3_1", "relu4_1", "relu5_1"]
DEFAULTS = {"size": 192, "steps": 200}
DEMO = {"size": 128, "steps": 60}  # make demo: an eighth of the work, the same picture in outline


def load_image(path: Path, size: int) -> torch.Tensor:
    """An image as a (1, 3, H, W) batch in [0, 1], its longer side resized to ``size``."""
    image = Image.open(path).convert("RGB")
    scale = size / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BICUBIC)
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div(255).unsqueeze(0)


def save_image(images: list[torch.Tensor], path: Path, caption: str) -> None:
    """Save images side by side (each (1, 3, H, W) in [0, 1], resized to the first one's height) as a PNG, under a
    band with ``caption``."""
    height = images[0].shape[-2]
    tiles = [
        torch.nn.functional.interpolate(
            img,
            size=(height, round(img.shape[-1] * height / img.shape[-2])),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )
        for img in images
    ]
    strip = torch.cat(tiles, dim=-1)[0].clamp(0, 1).mul(255).round().byte().permute(1, 2, 0).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(add_caption(strip, caption)).save(path, optimize=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--content", type=Path, default=HERE / "images" / "sample_00_shapes.png", help="content image")
    parser.add_argument("--style", type=Path, default=HERE / "style" / "waves.png", help="style image")
    parser.add_argument(
        "--size", type=int, default=None, help="longer side of the images, in pixels (default 192; 128 with --demo)"
    )
    parser.add_argument("--steps", type=int, default=None, help="optimization steps (default 200; 60 with --demo)")
    parser.add_argument(
        "--demo", action="store_true", help="the short run of `make demo`, enough to show the mechanics"
    )
    parser.add_argument("--out", type=Path, default=Path("demo-output/style_transfer.png"), help="output PNG")
    parser.add_argument("--side-by-side", action="store_true", help="write content | style | result in one PNG")
    parser.add_argument("--content-weight", type=float, default=1.0)
    parser.add_argument(
        "--style-weight",
        type=float,
        default=None,
        help="default 1e6 with pretrained weights, 1e8 with random ones (their features are weaker)",
    )
    parser.add_argument("--tv-weight", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.05, help="Adam learning rate on pixels in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision", choices=["float32", "bf16", "fp16"], default="float32", help="what VGG19 computes in"
    )
    args = parser.parse_args(argv)
    for name, value in (DEMO if args.demo else DEFAULTS).items():  # what --size and --steps leave unsaid
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> float:
    """Run the optimization, write the picture and return the final loss (that of the result), to compare runs."""
    args = parse_args(argv)
    if args.size < 16 or args.steps < 0:
        raise SystemExit("--size must be at least 16 and --steps at least 0")
    torch.manual_seed(args.seed)
    content_image = load_image(args.content, args.size)
    style_image = load_image(args.style, args.size)

    layers = STYLE_LAYERS + CONTENT_LAYERS
    extractor = pretrained_or_seeded(
        partial(fh.FeatureExtractor, "vgg19", layers, mode="grad", precision=args.precision), "VGG19", args.seed
    )
    if args.style_weight is None:
        args.style_weight = 1e6 if extractor.weights is not None else 1e8
    content = fl.PerceptualLoss(extractor, CONTENT_LAYERS)
    content.set_target(content_image)  # content features, computed once
    style = fl.StyleLoss(extractor, STYLE_LAYERS, target=style_image)  # style Grams, computed once
    loss_fn = fl.LossGroup(
        {"content": content, "style": style, "tv": fl.TotalVariationLoss()},
        weights={"content": args.content_weight, "style": args.style_weight, "tv": args.tv_weight},
    )

    image = content_image.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([image], lr=args.lr)
    start = time.perf_counter()
    with tqdm(range(args.steps), desc="style transfer", unit="step", file=sys.stderr) as progress:
        for _ in progress:
            optimizer.zero_grad(set_to_none=True)
            terms = loss_fn.terms(image)  # one VGG19 forward for all terms
            sum(terms.values()).backward()
            optimizer.step()
            with torch.no_grad():
                image.clamp_(0, 1)
            progress.set_postfix({name: f"{value.item():.3g}" for name, value in terms.items()})
    elapsed = time.perf_counter() - start

    result = image.detach()
    with torch.no_grad():
        final_loss = loss_fn(result).item()
    panels = "content | style | result" if args.side_by_side else "result"
    caption = f"style transfer, VGG19: {panels}\n{weights_caption('VGG19', extractor.weights, args.seed)}"
    save_image([content_image, style_image, result] if args.side_by_side else [result], args.out, caption)
    per_step = f" ({1000 * elapsed / args.steps:.0f} ms/step)" if args.steps else ""
    print(
        f"{args.steps} steps at {tuple(result.shape[-2:])} in {elapsed:.0f} s{per_step}, "
        f"final loss {final_loss:.4g}; wrote {args.out}"
    )
    return final_loss


if __name__ == "__main__":
    run(main)
