"""The ``dists`` subcommand: DISTS between the images of two folders, paired by relative path.

It runs on the pair-scoring pipeline of ``lpips`` (``metrics.pair_files`` and ``metrics.score_pairs``)
and takes the same options where they mean the same: ``add_pair_options``, ``folder_pairs`` and
``report_scores`` hold what any per-pair metric command needs, so another one (or ``lpips``) is the
metric's own options and one call of each.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import TYPE_CHECKING, Any

from ..errors import InvalidValueError, WeightsUnavailableError
from ..metrics.pairs import BATCH_PIXELS
from ._common import UserError, check_output_file, device_from, non_negative, positive, size, weights_from
from ._metrics import _print_warnings, _write_scores

if TYPE_CHECKING:
    from ..metrics.pairs import ImagePair, PairMetric

__all__ = ["add_dists_command", "add_pair_options", "folder_pairs", "report_scores", "score_folder_pairs"]

_DISTS_EPILOG = """\
examples:
  featurehooks dists outputs/ references/                       # VGG16, the learned alpha/beta: what papers report
  featurehooks dists outputs/ references/ --out scores.csv
  featurehooks dists outputs/ references/ --resize 256 --ignore-suffix

Files are paired by their path relative to each folder, as for `featurehooks lpips`; files found in
one folder only, and entries that are not regular files (a FIFO, a socket, a device: never opened),
are listed on stderr and left out. A batch holds at most --batch-size pairs and --batch-pixels pixels
(height x width summed over its pairs), so large images get smaller batches, down to one pair.
Images are scored at their own size (at least 17 x 17), as DISTS_pytorch's DISTS module scores them.
Its script (prepare_image(resize=True)) and piq's DISTS first shrink a shorter side above 256 to 256:
--resize 256 gives the script's resize (Pillow, bilinear) for such images, but enlarges smaller ones
too. The learned alpha and beta come from an installed DISTS_pytorch package, or from --alpha-beta FILE.
"""

# The library's hints name Python arguments; on this command each is a flag.
_FLAGS = (
    ("alpha_beta='path/to/weights.pt'", "--alpha-beta path/to/weights.pt"),
    ("alpha_beta=", "--alpha-beta"),
    ("calibrated=False", "--uncalibrated"),
)


def add_pair_options(parser: argparse.ArgumentParser, metric: str) -> None:
    """``DIR_A DIR_B`` and the options of every per-pair metric command: --weights, --seed, --out,
    --ignore-suffix, --resize, --crop, --batch-size, --batch-pixels, --workers, --device, -q."""
    parser.add_argument("dir_a", metavar="DIR_A", help="a folder of images (e.g. outputs)")
    parser.add_argument("dir_b", metavar="DIR_B", help="a folder of images with the same relative paths")
    parser.add_argument(
        "--weights", default="DEFAULT", help="backbone weights: DEFAULT, a member name, a local file, or none"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init with --weights none")
    parser.add_argument("--out", metavar="CSV", default=None, help="write name,score per pair")
    parser.add_argument("--ignore-suffix", action="store_true", help="pair x/1.png with x/1.jpg")
    parser.add_argument("--resize", type=size, default=None, metavar="N", help="resize the shorter side first")
    parser.add_argument("--crop", type=size, default=None, metavar="N", help="then center-crop to N x N")
    parser.add_argument(
        "--batch-size", type=positive, default=16, metavar="N", help="pairs per batch, at most (default: 16)"
    )
    parser.add_argument(
        "--batch-pixels",
        type=positive,
        default=BATCH_PIXELS,
        metavar="N",
        help="pixels per batch, at most: height x width summed over its pairs; a larger pair goes alone "
        f"(default: {BATCH_PIXELS}, 16 pairs of 256x256, one of 1024x1024)",
    )
    parser.add_argument(
        "--workers", type=non_negative, default=None, metavar="N", help="decoding processes (default: up to 4)"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("-q", "--quiet", action="store_true", help=f"no progress bar while {metric} runs")


def folder_pairs(args: argparse.Namespace) -> list[ImagePair]:
    """The pairs of ``DIR_A`` and ``DIR_B``, once ``--out`` is known to be writable (before any compute).

    What is left out (files in one folder only, unreadable entries) is listed on stderr; no pair at all
    is a UserError.
    """
    from ..metrics import pair_files

    if args.out is not None:
        check_output_file(args.out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs, only_a, only_b = pair_files(args.dir_a, args.dir_b, ignore_suffix=args.ignore_suffix)
    _print_warnings(caught)
    for folder, names in ((args.dir_a, only_a), (args.dir_b, only_b)):
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            print(f"featurehooks: {len(names)} file(s) only in {folder}, left out: {shown}", file=sys.stderr)
    if not pairs:
        raise UserError(f"no image in {args.dir_a} has a counterpart with the same relative path in {args.dir_b}")
    return pairs


def score_folder_pairs(args: argparse.Namespace, metric: PairMetric, pairs: list[ImagePair]) -> list[float]:
    """``score_pairs`` with the command's options."""
    from ..metrics import score_pairs

    return score_pairs(
        metric,
        pairs,
        batch_size=args.batch_size,
        batch_pixels=args.batch_pixels,
        num_workers=args.workers,
        resize_size=args.resize,
        crop_size=args.crop,
        progress=not args.quiet,
    )


def report_scores(args: argparse.Namespace, label: str, pairs: list[ImagePair], scores: list[float]) -> None:
    """Write ``--out`` (``name,score``) and print ``<label>: mean ± std over N pairs``."""
    import statistics

    if args.out is not None:
        _write_scores(args.out, [pair.name for pair in pairs], scores)
    spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
    print(f"{label}: {statistics.fmean(scores):.6g} ± {spread:.3g} over {len(scores)} pairs")


def add_dists_command(commands: Any) -> None:
    """Add ``dists`` to the ``featurehooks`` command's subparsers."""
    dists = commands.add_parser(
        "dists",
        help="DISTS between the images of two folders, paired by relative path",
        description="Score every pair of images with the same relative path in two folders with DISTS "
        "(deep image structure and texture similarity); print the mean ± std and the count, and write the "
        "per-pair scores with --out.",
        epilog=_DISTS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pair_options(dists, "DISTS")
    dists.add_argument("--uncalibrated", action="store_true", help="weigh every channel alike (no learned alpha/beta)")
    dists.add_argument("--alpha-beta", metavar="FILE", default=None, help="a file with the learned alpha and beta")
    dists.set_defaults(run=_dists)


def _dists(args: argparse.Namespace) -> int:
    import torch

    from ..metrics.dists import DISTS

    device = device_from(args.device)  # a bad --device fails before any folder is read
    pairs = folder_pairs(args)
    weights = weights_from(args.weights)
    if weights is None:
        torch.manual_seed(args.seed)
    try:
        metric = DISTS(calibrated=not args.uncalibrated, reduction="none", weights=weights, alpha_beta=args.alpha_beta)
    except (WeightsUnavailableError, InvalidValueError) as exc:  # their hints name Python arguments: name flags
        message = str(exc)
        for phrase, flag in _FLAGS:
            message = message.replace(phrase, flag)
        raise type(exc)(message) from None
    scores = score_folder_pairs(args, metric.to(device), pairs)
    report_scores(args, f"DISTS ({'uncalibrated' if args.uncalibrated else 'calibrated'})", pairs, scores)
    return 0
