"""The ``dists`` subcommand: DISTS between the images of two folders, paired by relative path.

It runs on the pair-scoring pipeline of ``lpips`` (``metrics.pair_files`` and ``metrics.score_pairs``)
and takes the same options where they mean the same: ``add_pair_options``, ``folder_pairs`` and
``report_scores`` hold what any per-pair metric command needs, so another one (or ``lpips``) is the
metric's own options and one call of each.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import InvalidValueError, WeightsUnavailableError
from ._common import add_command, check_precision, device_from, weights_from
from ._pairs import add_pair_options, folder_pairs, report_scores, score_folder_pairs

if TYPE_CHECKING:
    pass

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


_DISTS_ABOUT = """\
DISTS between the images of two folders, paired by relative path

Score every pair of images with the same relative path in two folders with DISTS (deep image structure and texture
similarity); print the mean ± std and the count, and write the per-pair scores with --out.
"""


def add_dists_command(commands: Any) -> None:
    """Add ``dists`` to the ``featurehooks`` command's subparsers."""
    dists = add_command(commands, "dists", _DISTS_ABOUT, _DISTS_EPILOG)
    add_pair_options(dists)
    dists.add_argument("--uncalibrated", action="store_true", help="weigh every channel alike (no learned alpha/beta)")
    dists.add_argument("--alpha-beta", metavar="FILE", default=None, help="a file with the learned alpha and beta")
    dists.set_defaults(run=_dists)


def _dists(args: argparse.Namespace) -> int:
    import torch

    from ..metrics.dists import DISTS

    device = device_from(args.device)  # a bad --device fails before any folder is read
    check_precision(args, device)
    pairs = folder_pairs(args)
    weights = weights_from(args.weights)
    if weights is None:
        torch.manual_seed(args.seed)
    try:
        metric = DISTS(
            calibrated=not args.uncalibrated,
            reduction="none",
            weights=weights,
            alpha_beta=args.alpha_beta,
            precision=args.precision,
        )
    except (WeightsUnavailableError, InvalidValueError) as exc:  # their hints name Python arguments: name flags
        message = str(exc)
        for phrase, flag in _FLAGS:
            message = message.replace(phrase, flag)
        raise type(exc)(message) from None
    scores = score_folder_pairs(args, metric.to(device), pairs)
    report_scores(args, f"DISTS ({'uncalibrated' if args.uncalibrated else 'calibrated'})", pairs, scores)
    return 0
