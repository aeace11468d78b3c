"""How fast is a feature dump compared with the model alone on the same images?

Images/s of ``dump_features`` (decode + resize + crop in DataLoader workers, forward, write to
``.npy``, commit) against the forward pass alone on the same images preloaded as one tensor, and
against decoding alone (the DataLoader without the model), at the same batch size, on CPU.

    python benchmarks/dump_throughput.py                # ~3 minutes on 2 cores
    python benchmarks/dump_throughput.py --quick        # checks the script, not speed

Writes ``benchmarks/results/dump_throughput.json`` (machine, versions, every sample) and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import machine, machine_line  # noqa: E402

from featurehooks import FeatureExtractor  # noqa: E402
from featurehooks.dump import dump_features, list_images  # noqa: E402
from featurehooks.dump.run import _default_workers  # noqa: E402
from featurehooks.dump.sources import ImageFiles, collate  # noqa: E402
from featurehooks.images import read_image, transform_for  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = {
    "pooled": {"layers": ["layer4"], "pool": "avg", "dtype": "float32"},
    "spatial": {"layers": ["layer3"], "pool": None, "dtype": "float16"},
}


def make_images(folder: Path, count: int, size: tuple[int, int]) -> None:
    """Smooth synthetic photos (gradients and shapes) as JPEG, like a typical image folder."""
    rng = np.random.default_rng(0)
    width, height = size
    ramp = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
    for i in range(count):
        base = (ramp * rng.uniform(80, 255, 3) + rng.uniform(0, 60, 3)).clip(0, 255)
        picture = Image.fromarray(np.broadcast_to(base, (height, width, 3)).astype(np.uint8))
        draw = ImageDraw.Draw(picture)
        for _ in range(6):
            x, y = rng.integers(0, width - 40), rng.integers(0, height - 40)
            box = (x, y, x + rng.integers(20, 160), y + rng.integers(20, 120))
            color = tuple(int(c) for c in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
        picture.save(folder / f"img_{i:05d}.jpg", quality=90)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(case: str, options: dict, names: list[str], work: Path, args: argparse.Namespace) -> list[dict]:
    """Rows of one case: model only, decode only (pooled case), and dump_features per worker count."""
    torch.manual_seed(0)
    ext = FeatureExtractor("resnet18", options["layers"], weights=None)  # seeded random init: same cost
    transform = transform_for(ext.preprocessing, ext.input_range)
    preloaded = torch.stack([transform(read_image(n)) for n in names])
    pool, dtype = options["pool"], getattr(torch, options["dtype"])

    def model_only() -> None:
        with torch.no_grad():
            for start in range(0, len(preloaded), args.batch_size):
                for value in ext(preloaded[start : start + args.batch_size]).values():
                    (value.mean(dim=(2, 3)) if pool else value).to(dtype).numpy()

    def dump(workers: int) -> Callable[[], object]:
        return lambda: dump_features(
            ext, names, work / f"out_{case}", batch_size=args.batch_size, num_workers=workers,
            pool=pool, dtype=options["dtype"], overwrite=True, progress=False,
        )  # fmt: skip

    def decode_only(workers: int) -> Callable[[], object]:
        files = ImageFiles(names, transform, (3, transform.crop_size, transform.crop_size))
        size = args.batch_size
        batches = [list(range(i, min(i + size, len(names)))) for i in range(0, len(names), size)]
        loader_args = {"batch_sampler": batches, "num_workers": workers, "collate_fn": collate}
        return lambda: [None for _ in torch.utils.data.DataLoader(files, **loader_args)]

    contenders: dict[str, tuple[Callable[[], object], int | None]] = {"model only (preloaded)": (model_only, None)}
    for w in args.workers:
        if case == "pooled":  # decoding does not depend on the case
            contenders[f"decode only, {w} workers"] = (decode_only(w), w)
        contenders[f"dump_features, {w} workers"] = (dump(w), w)
    model_only()  # warm-up (oneDNN primitives, page cache of the images)
    dump(args.workers[0])()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(args.reps):
        order = list(contenders)
        order = order[rep % len(order) :] + order[: rep % len(order)]  # rotate: no fixed neighbour
        for name in order:
            samples[name].append(timed(contenders[name][0]))
    model_rate = len(names) / statistics.median(samples["model only (preloaded)"])
    best_model_rate = len(names) / min(samples["model only (preloaded)"])
    rows = []
    for name, (_, workers) in contenders.items():
        seconds = statistics.median(samples[name])
        rate, best = len(names) / seconds, len(names) / min(samples[name])
        rows.append({
            "case": case, "contender": name, "workers": workers, "median_s": seconds, "samples_s": samples[name],
            "images_per_s": rate, "vs_model_only": rate / model_rate,
            "best_images_per_s": best, "best_vs_model_only": best / best_model_rate,
        })  # fmt: skip
        print(f"{case:8s} {name:28s} {rate:8.1f} img/s  ({rate / model_rate:.2f}x model only)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=96, help="number of images")
    p.add_argument("--image-size", type=int, nargs=2, default=(400, 300), metavar=("W", "H"), help="source size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--workers", type=int, nargs="+", default=None, help="worker counts to try (default: 0 and the library default)"
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions (median and best reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--quick", action="store_true", help="16 images, 1 repetition: checks the script, not speed")
    p.add_argument("--out", default=str(RESULTS), help="folder for dump_throughput.json and .md")
    args = p.parse_args()
    if args.workers is None:
        args.workers = sorted({0, max(1, _default_workers())})
    if args.quick:
        args.images, args.reps, args.workers = 16, 1, [0, 1]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="fh_dump_bench_"))
    (work / "images").mkdir()
    make_images(work / "images", args.images, tuple(args.image_size))
    names = list_images(work / "images")
    rows = [row for case, options in CASES.items() for row in measure(case, options, names, work, args)]
    info = machine(torch.device("cpu"))
    command = " ".join(["python", "benchmarks/dump_throughput.py", *sys.argv[1:]])
    payload = {
        "benchmark": "dump_throughput", "quick": args.quick, "command": command, "machine": info,
        "settings": {"images": len(names), "image_size": list(args.image_size), "batch_size": args.batch_size,
                     "backbone": "resnet18 (random init)", "crop": 224, "resize": 256, "reps": args.reps},
        "cases": CASES, "rows": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dump_throughput.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "## Dump throughput vs model only",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine_line(info)}  ",
        f"Load average (1, 5, 15 min) at the end: {info.get('load_average_at_end')} (other jobs share the cores)",
        "",
        f"{len(names)} JPEGs of {args.image_size[0]}x{args.image_size[1]}, resnet18 at 224 (resize 256, crop 224), "
        f"batch {args.batch_size}, median and best of {args.reps} interleaved runs; "
        "dump times include start-up (shape probe, file creation, "
        "worker start) and the per-batch flush + journal fsync.",
        "",
        "| case | contender | images/s (median) | vs model only | images/s (best) | vs model only (best) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        rate, ratio = row["images_per_s"], row["vs_model_only"]
        best, best_ratio = row["best_images_per_s"], row["best_vs_model_only"]
        cells = f"{rate:.1f} | {ratio:.2f}x | {best:.1f} | {best_ratio:.2f}x"
        lines.append(f"| {row['case']} | {row['contender']} | {cells} |")
    if args.quick:
        lines.insert(5, "**Quick mode**: 16 images, one repetition; these numbers check the script, not speed.\n")
    (out / "dump_throughput.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'dump_throughput.json'} and .md")


if __name__ == "__main__":
    main()
