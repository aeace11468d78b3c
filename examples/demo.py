"""The quick-start demo (``make demo``): offline, on the bundled sample images.

Lists VGG16's layers, extracts relu3_3 / relu4_3 features, dumps them for the whole folder to
demo-output/features/ and draws demo-output/feature_maps.png. Pretrained weights are used when
they are cached; otherwise the demo says so in one line and continues with seeded random weights.
The picture's caption names the weights that drew it, or says they are random.

    python examples/demo.py && cp demo-output/feature_maps.png docs/   # redraws the picture in the docs
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

import featurehooks as fh

from _common import pretrained_or_seeded, weights_caption

HERE = Path(__file__).parent

IMAGES = sorted((HERE / "images").glob("*.png"))
OUT = Path("demo-output")


def main() -> None:
    rows = fh.list_layers("vgg16")
    print("VGG16 layers (first 10 of", len(rows), "):")
    for row in rows[:10]:
        print(f"  {row.name:<10} {row.path:<12} {row.type:<8} {row.layout} channels={row.channels} stride={row.stride}")
    layers = ["relu3_3", "relu4_3"]
    with pretrained_or_seeded(partial(fh.FeatureExtractor, "vgg16", layers), "VGG16") as extractor:
        images = torch.cat([fh.prepare_image(path, extractor) for path in IMAGES])  # as the weights' transforms
        features = extractor(images)
        dump = fh.dump_features(
            extractor, HERE / "images", OUT / "features", pool="avg", num_workers=0, overwrite=True, progress=False
        )
        caption = f"VGG16 {', '.join(layers)}: image | 8 most active channels\n" + weights_caption(
            "VGG16", extractor.weights
        )
        grid = fh.save_feature_grid(
            OUT / "feature_maps.png", {k: v[:1] for k, v in features.items()}, images[:1], caption=caption
        )
    print(f"\n{len(IMAGES)} images from {IMAGES[0].parent} -> {weights_caption('VGG16', extractor.weights)}")
    for name, value in features.items():
        print(f"  {name}: shape {tuple(value.shape)}, mean activation {value.mean():.4f}")
    shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in dump.manifest.settings.shapes.items())
    print(f"\nfeature dump (avg-pooled): {dump.out_dir}/ with {shapes}, index.csv, manifest.json")
    print(f"feature-map picture: {grid}")


if __name__ == "__main__":
    main()
