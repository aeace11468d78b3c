"""``featurehooks merge OUT PARTS...``: the parts that jobs of ``--shard I/N`` wrote, joined into what one run over the
whole set writes: dump folders into one dump (``merge_dumps``), statistics files into one (``merge_statistics``),
statistics sets of ``eval --save-stats`` into one set (``merge_statistics_sets``)."""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

from ._common import UserError, add_command, check_output_file, print_warnings

__all__ = ["add_merge_command"]

_EPILOG = """\
examples:
  featurehooks extract images/ --backbone resnet50 --layers layer4 --pool avg --shard 0/3 --out part0/   # job 0 of 3
  featurehooks merge feats/ part0/ part1/ part2/
  featurehooks stats real/ --backbone inception_v3 --layers avgpool --shard slurm --out real-$SLURM_ARRAY_TASK_ID.npz
  featurehooks merge real.npz real-0.npz real-1.npz real-2.npz
  featurehooks eval --save-stats real/ ref-$SLURM_ARRAY_TASK_ID.npz --metrics fid,fd_dinov2 --shard slurm
  featurehooks merge ref.npz ref-0.npz ref-1.npz ref-2.npz       # every backbone's statistics, for eval ref.npz FAKE

PARTS are every shard's dump folder (extract --shard) or every shard's statistics file (stats --shard, fid
--save-stats --shard, or feature_statistics(..., shard=(i, n)).save), or every shard's statistics set (eval
--save-stats --shard, or save_statistics of evaluate(real, None, shard=(i, n)).real), in any order. The merged
dump is the one a single run writes, byte for byte (arrays, index.csv, manifest.json); merged statistics equal
one run's to float64 rounding (the vectors kept for KID are a uniform sample of the set; those eval keeps, every
vector in row order), each statistics of a set merged alike. Parts of another input set, computed with other
settings or weights, overlapping, missing or unfinished are refused, naming them, before anything is written;
an interrupted merge of dumps is finished by running it again.
"""


_MERGE_ABOUT = """\
join the parts of --shard jobs: dump folders into one dump, statistics files into one file

Join the parts that jobs of `extract --shard I/N` (dump folders), `stats --shard I/N` (statistics files) or `eval
--save-stats --shard I/N` (statistics sets) wrote, one per shard, into what one run over the whole set writes.
"""


def add_merge_command(commands: Any) -> None:
    """Add ``merge`` to the ``featurehooks`` command's subparsers."""
    merge = add_command(commands, "merge", _MERGE_ABOUT, _EPILOG)
    merge.add_argument("out", metavar="OUT", help="the merged dump's folder, or the merged statistics .npz")
    merge.add_argument("parts", nargs="+", metavar="PART", help="every shard's dump folder or statistics file")
    merge.add_argument(
        "--overwrite", action="store_true", help="replace another dump in OUT (a statistics file OUT is replaced)"
    )
    merge.set_defaults(run=_merge)


def _merge(args: argparse.Namespace) -> int:
    folders = [part for part in args.parts if os.path.isdir(part)]
    if folders and len(folders) < len(args.parts):
        files = [part for part in args.parts if part not in folders]
        raise UserError(
            f"PART mixes dump folders ({folders[0]}) and files ({files[0]}): merge the dumps of one set, or the "
            "statistics files of one set"
        )
    with warnings.catch_warnings(record=True) as caught:  # one line each on stderr, not Python's form
        warnings.simplefilter("always")
        try:
            text = _dumps(args) if folders else _statistics(args)
        finally:
            print_warnings(caught)
    print(text)
    return 0


def _dumps(args: argparse.Namespace) -> str:
    """Merge dump folders; what the command prints."""
    from ..dump import merge_dumps

    result = merge_dumps(args.out, args.parts, overwrite=args.overwrite)
    if not result.rows_computed:
        return f"already complete: {result.out_dir} ({result.num_rows} rows)"
    return f"merged {len(args.parts)} parts into {result.out_dir}: {result.num_rows} rows"


def _statistics(args: argparse.Namespace) -> str:
    """Merge statistics files (each of one statistics, or each a set); what the command prints."""
    from ..metrics import merge_statistics
    from ..metrics.merge import holds_statistics_set

    check_output_file(args.out)
    if holds_statistics_set(args.parts[0]):
        return _statistics_sets(args)
    stats = merge_statistics(args.parts)
    path = stats.save(args.out)
    layer = f"{stats.origin.layer}, " if stats.origin is not None else ""
    return f"wrote {path}: {layer}{stats.count} images from {len(args.parts)} parts, {stats.dim} features"


def _statistics_sets(args: argparse.Namespace) -> str:
    """Merge the statistics sets of ``eval --save-stats --shard``; what the command prints."""
    from ..metrics import save_statistics
    from ..metrics.merge import merge_statistics_sets

    merged = merge_statistics_sets(args.parts)
    path = save_statistics(args.out, merged)
    counts = ", ".join(f"{name} {stats.count} images x {stats.dim}" for name, stats in merged.items())
    return f"wrote {path}: the statistics set of {len(args.parts)} parts ({counts})"
