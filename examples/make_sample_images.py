"""Draw the bundled sample images (examples/images, examples/style) from a fixed seed.

The pictures are the project's own: simple scenes and textures that exercise colour, edges and
scale, so the demo, the tests and the style-transfer example run offline. Re-run to regenerate (the same
bytes: the seed is fixed); ``--help`` only prints the usage.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

HERE = Path(__file__).parent
SIZE = 224


def _canvas(rng: np.random.Generator) -> Image.Image:
    """A vertical two-colour gradient, like sky over ground."""
    top, bottom = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    ramp = np.linspace(0.0, 1.0, SIZE)[:, None, None]
    pixels = (top * (1 - ramp) + bottom * ramp) * np.ones((1, SIZE, 1))
    return Image.fromarray(pixels.astype(np.uint8))


def shapes(rng: np.random.Generator) -> Image.Image:
    image = _canvas(rng)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 9))):
        x, y = rng.integers(0, SIZE, 2)
        r = int(rng.integers(12, 60))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        box = (int(x - r), int(y - r), int(x + r), int(y + r))
        if rng.random() < 0.5:
            draw.ellipse(box, fill=colour, outline=(0, 0, 0), width=2)
        else:
            draw.rectangle(box, fill=colour, outline=(255, 255, 255), width=2)
    return image


def stripes(rng: np.random.Generator) -> Image.Image:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    angle, period = rng.uniform(0, np.pi), rng.uniform(8, 32)
    wave = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / period)
    colours = rng.integers(0, 256, (2, 3))
    mix = (wave[..., None] + 1) / 2
    return Image.fromarray((colours[0] * mix + colours[1] * (1 - mix)).astype(np.uint8))


def texture(rng: np.random.Generator) -> Image.Image:
    noise = rng.integers(0, 256, (SIZE // 8, SIZE // 8, 3), dtype=np.uint8)
    image = Image.fromarray(noise).resize((SIZE, SIZE), Image.Resampling.BICUBIC)
    return image.filter(ImageFilter.DETAIL)


def style_waves() -> Image.Image:
    """A swirling, brush-like colour field that gives the style-transfer example bold strokes."""
    yy, xx = np.mgrid[0:256, 0:256].astype(np.float32) / 256
    swirl = np.sin(12 * xx + 6 * np.sin(9 * yy)) + np.cos(14 * yy + 5 * np.sin(7 * xx))
    hue = (swirl - swirl.min()) / (swirl.max() - swirl.min())
    palette = np.array([[20, 40, 110], [240, 200, 60], [200, 60, 40], [30, 140, 160]], dtype=np.float32)
    position = hue * (len(palette) - 1)
    low = np.floor(position).astype(int).clip(0, len(palette) - 2)
    frac = (position - low)[..., None]
    pixels = palette[low] * (1 - frac) + palette[low + 1] * frac
    return Image.fromarray(pixels.astype(np.uint8)).filter(ImageFilter.EDGE_ENHANCE_MORE)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help exits here
    rng = np.random.default_rng(2026)
    makers = [shapes, shapes, shapes, stripes, stripes, texture, texture, shapes]
    for number, make in enumerate(makers):
        make(rng).save(HERE / "images" / f"sample_{number:02d}_{make.__name__}.png")
    style_waves().save(HERE / "style" / "waves.png")


if __name__ == "__main__":
    main()
