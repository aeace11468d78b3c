"""Does a dump's memory stay flat as the number of images grows?

Peak resident memory of ``dump_features`` over 500 and 5,000 small generated PNGs (32x32), each
run in a fresh process: the main process (``ru_maxrss``), its DataLoader workers
(``RUSAGE_CHILDREN``), and the growth over the resident memory measured just before the dump
(after torch and the model are loaded). Spatial maps are kept (no pooling), so the output files
grow 10x between the two runs while memory should not.

    python benchmarks/dump_memory.py              # ~1 minute
    python benchmarks/dump_memory.py --quick      # 50 vs 500 images

Writes ``benchmarks/results/dump_memory.json`` (machine, versions) and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = ["layer2", "layer4"]


def rss_now_mib() -> float:
    """Current resident set size of this process, from /proc."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(images: Path, count: int, out: Path, batch_size: int, workers: int) -> None:
    """One dump in this (fresh) process; prints a JSON line with its memory figures."""
    import torch

    from featurehooks import FeatureExtractor
    from featurehooks.dump import dump_features, list_images

    torch.manual_seed(0)
    names = list_images(images)[:count]
    ext = FeatureExtractor("resnet18", LAYERS, weights=None)
    with torch.no_grad():  # warm up once so one-off allocations are in the baseline, not the dump
        ext(torch.zeros(2, 3, 32, 32))
    before = rss_now_mib()
    start = time.perf_counter()
    result = dump_features(
        ext, names, out, batch_size=batch_size, num_workers=workers, resize_size=32, crop_size=32, progress=False
    )
    seconds = time.perf_counter() - start
    peak_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peak_workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    size = sum(result.path(layer).stat().st_size for layer in LAYERS)
    print(json.dumps({
        "images": count, "seconds": seconds, "rss_before_dump_mib": before, "peak_rss_mib": peak_self,
        "growth_mib": peak_self - before, "peak_worker_rss_mib": peak_workers, "output_mib": size / 2**20,
    }))  # fmt: skip


def make_images(folder: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i:05d}.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--counts", type=int, nargs="+", default=[500, 5000], help="numbers of images")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="50 vs 500 images")
    p.add_argument("--out", default=str(RESULTS), help="folder for dump_memory.json and .md")
    p.add_argument("--child", nargs=3, metavar=("IMAGES", "COUNT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(Path(args.child[0]), int(args.child[1]), Path(args.child[2]), args.batch_size, args.workers)
        return
    if args.quick:
        args.counts = [50, 500]
    work = Path(tempfile.mkdtemp(prefix="fh_dump_memory_"))
    (work / "images").mkdir()
    make_images(work / "images", max(args.counts))
    rows = []
    for count in args.counts:
        command = [sys.executable, __file__, "--batch-size", str(args.batch_size), "--workers", str(args.workers),
                   "--child", str(work / "images"), str(count), str(work / f"out_{count}")]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{count:6d} images: peak RSS {row['peak_rss_mib']:.0f} MiB "
            f"(+{row['growth_mib']:.1f} MiB during the dump), "
            f"workers {row['peak_worker_rss_mib']:.0f} MiB, output {row['output_mib']:.1f} MiB, {row['seconds']:.1f} s",
            flush=True,
        )
    import torch

    from _machine import machine, machine_line

    info = machine(torch.device("cpu"))
    command = " ".join(["python", "benchmarks/dump_memory.py", *sys.argv[1:]])
    payload = {
        "benchmark": "dump_memory", "quick": args.quick, "command": command, "machine": info,
        "settings": {"backbone": "resnet18 (random init)", "layers": LAYERS, "pool": None, "image_size": 32,
                     "batch_size": args.batch_size, "workers": args.workers},
        "rows": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dump_memory.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        "## Dump peak memory vs number of images",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine_line(info)}  ",
        f"Load average (1, 5, 15 min) at the end: {info.get('load_average_at_end')} (other jobs share the cores)",
        "",
        f"resnet18 {' + '.join(LAYERS)} feature maps (no pooling), 32x32 PNGs, batch {args.batch_size}, "
        f"{args.workers} workers; each count in a fresh process. Growth = peak RSS minus RSS just before the dump.",
        "",
        "| images | output MiB | peak RSS MiB | growth during dump MiB | peak worker RSS MiB | seconds |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['images']} | {r['output_mib']:.1f} | {r['peak_rss_mib']:.0f} | {r['growth_mib']:.1f} | "
            f"{r['peak_worker_rss_mib']:.0f} | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        "Rows are written through `open_memmap` and their pages released after each commit (`madvise`), so the",
        "output size never shows up in RSS. What still grows with N is bookkeeping: the list of input paths, the",
        "batch index lists and the text of `index.csv` (well under 1 KiB per input).",
    ]
    (out / "dump_memory.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'dump_memory.json'} and .md")


if __name__ == "__main__":
    main()
