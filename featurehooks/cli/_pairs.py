"""What the per-pair metric commands (``lpips``, ``dists``) share: their options, the pairing of two folders (or of
one folder's images with each other), the scoring loop and the report, streamed: rows are written as the scores
come and the summary is a running one, so every pair of thousands of images runs in bounded memory."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..metrics.pair_scores import BATCH_PIXELS
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
    import numpy as np

    from ..metrics.pair_scores import PairMetric
    from ..metrics.pairs import ImagePair

__all__ = ["add_pair_options", "folder_pairs", "report_scores", "score_folder_pairs"]


def add_pair_options(parser: argparse.ArgumentParser) -> None:
    """``DIR_A DIR_B`` and the options of every per-pair metric command: --weights, --seed, --out,
    --ignore-suffix, --resize, --crop, --batch-size, --batch-pixels, --workers, --device, --precision, -q."""
    parser.add_argument(
        "dir_a", metavar="DIR_A", help="a folder of images (e.g. outputs), or a ZIP, tar shard, .npy or .npz of them"
    )
    parser.add_argument(
        "dir_b",
        metavar="DIR_B",
        nargs="?",
        help="a folder (or archive) of images with the same relative paths (none with --all-pairs)",
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


def score_folder_pairs(
    args: argparse.Namespace, metric: PairMetric, pairs: Sequence[ImagePair]
) -> Iterator[np.ndarray]:
    """``iter_pair_scores`` with the command's options: the scores in order, computed as ``report_scores`` reads
    them (options are checked now)."""
    from ..metrics.pair_scores import iter_pair_scores

    return iter_pair_scores(metric, pairs, **stream_options(args))


def report_scores(
    args: argparse.Namespace, label: str, pairs: Sequence[ImagePair], scores: Iterable[np.ndarray]
) -> None:
    """Write ``--out`` (``name,score``) as the scores come and print ``<label>: mean ± std over N pairs``.

    Neither the rows nor the scores are held: each chunk of scores is written, then counted into an exact
    running summary (equal to ``statistics.fmean`` and ``statistics.stdev`` of them all).
    """
    from ..metrics.pair_scores import RunningSummary

    running = RunningSummary()
    with contextlib.ExitStack() as stack:
        write = stack.enter_context(_score_file(Path(args.out))) if args.out is not None else None
        names = (pair.name for pair in pairs)
        for chunk in scores:
            if write is not None:
                write(_rows(itertools.islice(names, len(chunk)), chunk.tolist()))
            running.add(chunk)
    summary = running.summary()
    print(f"{label}: {summary.mean:.6g} ± {summary.std:.3g} over {summary.count} pairs")


def _rows(names: Iterable[str], scores: list[float]) -> str:
    """``name,score`` CSV rows (``repr`` of each score: it reads back as the same float)."""
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([name, repr(score)] for name, score in zip(names, scores))
    return text.getvalue()


@contextlib.contextmanager
def _score_file(path: Path) -> Iterator[Callable[[str], None]]:
    """A ``write(text)`` of rows to ``path``, whole or not at all (``_atomic.growing_atomic``); the header first."""
    from .._atomic import growing_atomic

    with growing_atomic(path) as write:
        write("name,score\n")
        yield write
