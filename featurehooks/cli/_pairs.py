"""What the per-pair metric commands (``lpips``, ``dists``) share: their options, the pairing of two folders, the
scoring loop and the report."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..metrics.pairs import BATCH_PIXELS
from ._common import (
    UserError,
    add_device_option,
    add_precision_option,
    add_seed_option,
    add_size_options,
    add_stream_options,
    add_weights_option,
    check_output_file,
    print_warnings,
    stream_options,
)

if TYPE_CHECKING:
    from ..metrics.pairs import ImagePair, PairMetric

__all__ = ["add_pair_options", "folder_pairs", "report_scores", "score_folder_pairs"]


def add_pair_options(parser: argparse.ArgumentParser) -> None:
    """``DIR_A DIR_B`` and the options of every per-pair metric command: --weights, --seed, --out,
    --ignore-suffix, --resize, --crop, --batch-size, --batch-pixels, --workers, --device, --precision, -q."""
    parser.add_argument("dir_a", metavar="DIR_A", help="a folder of images (e.g. outputs)")
    parser.add_argument(
        "dir_b",
        metavar="DIR_B",
        nargs="?",
        help="a folder of images with the same relative paths (none with --all-pairs)",
    )
    within = parser.add_mutually_exclusive_group()
    within.add_argument(
        "--all-pairs",
        action="store_true",
        help="score every pair of images of DIR_A alone, N(N-1)/2 of them: the diversity of a set of samples "
        "(lpips_1dir_allpairs.py --all-pairs)",
    )
    within.add_argument(
        "--consecutive",
        action="store_true",
        help="score each image of DIR_A alone with the next (the script's default)",
    )
    add_weights_option(parser, "backbone weights: DEFAULT, a member name, a local file, or none (default: DEFAULT)")
    add_seed_option(parser)
    parser.add_argument("--out", metavar="CSV", default=None, help="write name,score per pair")
    parser.add_argument("--ignore-suffix", action="store_true", help="pair x/1.png with x/1.jpg")
    add_size_options(parser, default="none")
    add_stream_options(parser, unit="pairs", batch_pixels=BATCH_PIXELS)
    add_device_option(parser)
    add_precision_option(parser)


def folder_pairs(args: argparse.Namespace) -> Sequence[ImagePair]:
    """The pairs of ``DIR_A`` and ``DIR_B`` (or of ``DIR_A`` alone, with ``--all-pairs`` or ``--consecutive``), once
    ``--out`` is known to be writable (before any compute).

    What is left out (files in one folder only, unreadable entries) is listed on stderr; no pair at all
    is a UserError.
    """
    from ..metrics import pair_files
    from ..metrics.pairs import pairs_within

    if args.out is not None:
        check_output_file(args.out)
    within = args.all_pairs or args.consecutive
    if within != (args.dir_b is None):
        flag = "--all-pairs" if args.all_pairs else "--consecutive"
        raise UserError(f"{flag} scores the images of DIR_A alone: pass one folder" if within else "pass DIR_B too")
    if within:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = pairs_within(args.dir_a, consecutive=args.consecutive)
        print_warnings(caught)
        return found
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs, only_a, only_b = pair_files(args.dir_a, args.dir_b, ignore_suffix=args.ignore_suffix)
    print_warnings(caught)
    for folder, names in ((args.dir_a, only_a), (args.dir_b, only_b)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            print(f"featurehooks: {len(names)} file(s) only in {folder}, left out: {shown}", file=sys.stderr)
    if not pairs:
        raise UserError(f"no image in {args.dir_a} has a counterpart with the same relative path in {args.dir_b}")
    return pairs


def score_folder_pairs(args: argparse.Namespace, metric: PairMetric, pairs: Sequence[ImagePair]) -> list[float]:
    """``score_pairs`` with the command's options."""
    from ..metrics import score_pairs

    return score_pairs(metric, pairs, **stream_options(args))


def report_scores(args: argparse.Namespace, label: str, pairs: Sequence[ImagePair], scores: list[float]) -> None:
    """Write ``--out`` (``name,score``) and print ``<label>: mean ± std over N pairs``."""
    import statistics

    if args.out is not None:
        write_scores(args.out, [pair.name for pair in pairs], scores)
    spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
    print(f"{label}: {statistics.fmean(scores):.6g} ± {spread:.3g} over {len(scores)} pairs")


def write_scores(path: str, names: list[str], scores: list[float]) -> None:
    """``name,score`` rows, written atomically (a failed run leaves no half-written file)."""
    import csv
    import io

    from .._atomic import write_atomic

    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["name", "score"])
    writer.writerows([name, repr(score)] for name, score in zip(names, scores))
    write_atomic(Path(path), text.getvalue())
