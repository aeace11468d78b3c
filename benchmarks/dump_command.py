"""Is ``featurehooks extract`` at least as fast as a hand-written loop, each a fresh process, on quiet and busy cores?

Each runs as a user runs it: issue 39's last question, asked the way ``metrics.py --fid-defaults`` asks it of
``featurehooks fid`` against ``python -m pytorch_fid``. The job of ``dump_throughput.py`` (ResNet-18's
average-pooled ``layer4`` features of a folder of JPEGs, the weights' preprocessing, written to ``.npy``), by three
commands, each a fresh process on every call (interpreter, imports, weights and DataLoader workers included):

- *hand-written loop script* (the baseline): ``python benchmarks/_hand_loop.py`` (``ImageFolder``,
  ``weights.transforms()``, a ``DataLoader``, the truncated torchvision model, one ``np.save``);
- *featurehooks extract, own defaults*: ``featurehooks extract`` choosing its workers itself, as a user runs it: the
  contender of the target (at least as fast as the hand loop under each load);
- *featurehooks extract, same workers*: ``featurehooks extract --workers N``, the hand loop's decoding workers (for
  information).

Every command gets the same batch size and the environment of the benchmark without any thread or OpenMP variable
(``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``), so each runs with its own
defaults: torch's thread count for both, and for ``featurehooks`` commands their short OpenMP spin waits
(``featurehooks/_openmp.py``; an in-process ``dump_features`` in a user's script has torch's, as in
``dump_throughput.py``). ``--threads`` sets ``OMP_NUM_THREADS`` for all three instead.

Rounds are interleaved (the order rotates) after one untimed call each on the warm-up folder, under each
``--load`` (``_load.py``); every command's rows are compared with the hand loop's, matched by file path.

    python benchmarks/dump_command.py --load none,torch,python --rounds 7 --budget 480   # ~20 minutes on 2 cores
    python benchmarks/dump_command.py --quick    # 18 images, 1 round: checks the script, not speed

Needs ``scikit-image`` (the photos). Writes ``benchmarks/results/dump_command.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as H
import _load as L
import _report as R
import dump_throughput as D
from _machine import loadavg
from _weights import seeded_hub_weights, seeded_torch_home

NAME = "dump_command"
TITLE = "featurehooks extract vs a hand-written loop script, each a fresh process: ResNet-18 layer4 avg-pooled"
HAND = "hand-written loop script"
SAME_WORKERS = "featurehooks extract, same workers"
OWN_DEFAULTS = "featurehooks extract, own defaults"
HAND_SCRIPT = Path(__file__).with_name("_hand_loop.py")
CLEARED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", *L.OPENMP_WAITS)  # each command with its own defaults


def environment(threads: int | None) -> dict[str, str]:
    """The benchmark's environment with no thread or OpenMP variable (each command's defaults), or with
    ``OMP_NUM_THREADS=threads`` for all."""
    env = {key: value for key, value in os.environ.items() if key not in CLEARED}
    env["PYTHONWARNINGS"] = "ignore"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def commands(out: dict[str, Path], batch: int, workers: int) -> dict[str, Callable[[Path], list[str]]]:
    """Each contender's command line for a folder of photos, writing into its ``out`` folder."""
    hand = [sys.executable, str(HAND_SCRIPT), "--batch-size", str(batch), "--workers", str(workers)]
    extract = [sys.executable, "-m", "featurehooks", "extract", "--backbone", "resnet18", "--layers", "layer4",
               "--pool", "avg", "--batch-size", str(batch), "--device", "cpu", "--overwrite", "-q"]  # fmt: skip
    same = [*extract, "--workers", str(workers)]
    return {
        HAND: lambda folder: [*hand, str(folder), str(out[HAND])],
        OWN_DEFAULTS: lambda folder: [*extract, "--out", str(out[OWN_DEFAULTS]), str(folder)],
        SAME_WORKERS: lambda folder: [*same, "--out", str(out[SAME_WORKERS]), str(folder)],
    }


def shown_commands(args: argparse.Namespace) -> dict[str, str]:
    """Each contender's command line as the results show it: ``python``, ``PHOTOS`` and ``OUT`` for the paths."""
    lines = commands(dict.fromkeys((HAND, OWN_DEFAULTS, SAME_WORKERS), Path("OUT")), args.batch_size, args.workers)
    return {name: " ".join(["python", *line(Path("PHOTOS"))[1:]]) for name, line in lines.items()}


def run(command: list[str], env: dict[str, str]) -> None:
    """``command`` to its end; a failure ends the benchmark with its error."""
    done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="18 images, batch 8, 1 round: checks the script, not speed")
    p.add_argument("--images", type=int, default=None, help="number of JPEGs (default: 200; 18 if --quick)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default: 7; 1 if --quick)")
    p.add_argument(
        "--budget", type=float, default=480.0,
        help="seconds of timed rounds under each load: no round starts that would not end within it (one always runs)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=None, help="images per batch (default: 32; 8 if --quick)")
    p.add_argument("--workers", type=int, default=2, help="the hand loop's DataLoader workers, and extract's --workers")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every command (default: none set)")
    p.add_argument("--torch-home", default=None, help="TORCH_HOME with (or for) seeded weights; default: a temp dir")
    p.add_argument("--out", default=str(H.RESULTS), help="folder for dump_command.json and .md")
    p.add_argument("--tag", default="", help="suffix of the result files")
    p.add_argument("--load", default="none", type=L.parse_loads, help=L.load_option_help())
    args = D.fill_sizes(p.parse_args(argv), {"images": 200, "rounds": 7, "batch_size": 32})
    if args.workers < 0 or (args.threads is not None and args.threads < 1):
        raise SystemExit("--workers must be at least 0 and --threads at least 1")
    return args


def settings(args: argparse.Namespace, argv: Sequence[str] | None) -> H.Settings:
    """The harness settings (seed, command, output folder): CPU, wall clock, no chart; the benchmark's own
    threads stay as they are (it only waits for the commands)."""
    shared = argparse.Namespace(
        device="cpu", quick=False, threads=None, budget=0.0, min_reps=args.rounds, max_reps=args.rounds,
        warmup=1, out=args.out, tag=args.tag, no_plot=True, clock="wall", autocast=None,
    )  # fmt: skip
    cfg = H.settings(shared, budget=0.0)
    cfg.quick = args.quick
    if argv is not None:  # called from Python (tests): say what the command line would have been
        cfg.command = " ".join(["python", "benchmarks/dump_command.py", *argv])
    return cfg


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = arguments(argv)
    cfg = settings(args, argv)
    load_at_start = loadavg()
    env = environment(args.threads)
    with seeded_torch_home(args.torch_home), tempfile.TemporaryDirectory(prefix="fh_dump_command_") as tmp:
        work = Path(tmp)
        root, warm_root, classes = D.photo_folders(work, args.images, args.batch_size, warm=not args.quick)
        seeded_hub_weights("resnet18")
        env["TORCH_HOME"] = os.environ["TORCH_HOME"]
        outs = {name: work / f"out{i}" for i, name in enumerate((HAND, OWN_DEFAULTS, SAME_WORKERS))}
        lines = commands(outs, args.batch_size, args.workers)
        contenders = {name: lambda folder, line=line: run(line(folder), env) for name, line in lines.items()}
        measured = {}
        for load in args.load:
            with L.background(load, quick=args.quick) as running:
                H.log(f"timing under load {load!r}: up to {args.rounds} round(s), {args.budget:g} s at most")
                warm = None if args.quick else warm_root  # quick: the script checked, each command run once
                timing = D.time_rounds(contenders, root, warm, args.rounds, args.budget)
                measured[load] = (timing, running.record())
        order = D.folder_order(root)
        checks = D.checked_against(HAND, outs, order)

    count = len(order)
    params = {"images": count, "batch": args.batch_size, "workers": args.workers, "threads": args.threads or "own"}
    groups = [D.group_under(load, timing, during, params, checks, HAND) for load, (timing, during) in measured.items()]
    targets = [
        R.Target(f"{name}: max abs diff / max abs feature, vs the hand loop", D.CASE, checks[name]["rel_diff"],
                 D.MAX_RELATIVE_DIFF, "<=", unit="")
        for name in (OWN_DEFAULTS, SAME_WORKERS)
    ]  # fmt: skip
    targets += [  # issue 39: the command as a user runs it, against the loop as a user writes it
        R.Target(f"{OWN_DEFAULTS} / {HAND} images/s (at least as fast)", group.label,
                 group.row(OWN_DEFAULTS).extra["speedup"], 1.0, ">=")
        for group in groups
    ]  # fmt: skip
    rounds = ", ".join(f"{load}: {timing.rounds}" for load, (timing, _) in measured.items())
    notes = [
        f"images/s = {count} images / seconds of one whole command (median and best of the interleaved rounds "
        f"({rounds}), after one untimed call each on the first images, none in quick mode); *× baseline* = "
        "images/s over the hand loop script's in the same group (median over median, best over best).",
        f"Inputs: {count} JPEGs (quality {D.JPEG_QUALITY}, {classes} class folders) cut from scikit-image's photos "
        "at 333..640 px; resize 256, center crop 224 (the weights' own); seeded random ResNet-18 weights in "
        "TORCH_HOME's cache, read by every command.",
        f"Every command a fresh process: batch {args.batch_size}; the hand loop and *same workers* "
        f"{args.workers} DataLoader worker(s), *own defaults* featurehooks' choice; "
        + (
            f"OMP_NUM_THREADS={args.threads} for all."
            if args.threads
            else "no thread or OpenMP variable set: torch's thread count for all, featurehooks' commands with their "
            "short OpenMP spin waits (GOMP_SPINCOUNT=3000), the hand loop with GNU OpenMP's default."
        ),
        L.NOTE,
        "Outputs: each command's rows matched to the hand loop's by file path; *max abs diff* over all "
        f"{count}x512 features, *diff / max abs* over the largest |feature| of the hand loop.",
    ]
    if cfg.quick:
        notes.insert(0, f"Quick mode: {count} images, {args.rounds} round(s); it checks the script, not the speed.")
    config = {"images": count, "rounds": {load: timing.rounds for load, (timing, _) in measured.items()},
              "batch_size": args.batch_size, "workers": args.workers, "threads": args.threads,
              "loads": args.load, "budget_s": args.budget, "load_average_at_start": load_at_start,
              "commands": shown_commands(args)}  # fmt: skip
    columns = [
        ("images_per_s", "images/s (median)", ".1f"), ("best_images_per_s", "images/s (best)", ".1f"),
        ("speedup", "× baseline", ".2f"), ("best_speedup", "× baseline (best)", ".2f"),
        R.ABS_DIFF_COLUMN, ("rel_diff", "diff / max abs", ".1e"),
        *L.COLUMNS,
    ]  # fmt: skip
    return R.publish(cfg, R.save(NAME, TITLE, cfg, groups, targets, config, notes, extra_columns=columns))


if __name__ == "__main__":
    main()
