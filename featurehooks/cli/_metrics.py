"""The metric subcommands: ``lpips`` (per-pair scores of two folders), ``fd`` (Fréchet distance and KID
between two image sets) and ``stats`` (save a reference set's feature statistics)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._layout import Pool, as_pool
from ._common import (
    UserError,
    add_command,
    add_kid_subset_option,
    add_model_options,
    add_prdc_k_option,
    add_shard_option,
    add_stream_options,
    build_extractor,
    check_output_file,
    check_precision,
    device_from,
    is_main_rank,
    is_statistics_file,
    non_negative,
    positive,
    prdc_text,
    print_warnings,
    stream_options,
    weights_arg,
    weights_from,
)
from ._pairs import add_pair_options, folder_pairs, report_scores, score_folder_pairs
from ._sample_size import add_sample_size_options, sample_size, sample_size_asked

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from ..metrics import FeatureOrigin, FeatureStatistics

__all__ = ["add_metric_commands"]

_FD_EPILOG = """\
examples:
  featurehooks fd real/ fake/ --backbone inception_v3 --layers avgpool
  featurehooks fd real/ fake/ --backbone timm/vit_small_patch16_224.dino --layers blocks.11 --pool cls --kid
  featurehooks stats real/ --backbone inception_v3 --layers avgpool --out real.npz
  featurehooks fd real.npz fake/ --backbone inception_v3 --layers avgpool
  featurehooks fd real.npz fake/ --backbone inception_v3 --layers avgpool --bootstrap 100 --infinity

Either set may be a statistics file written by `featurehooks stats`; it must come from the same
backbone, weights, layer and pool. A file computed otherwise than --backbone, --layers and any
--weights or --pool given say is refused (options not given are not compared, unless the other set
is computed here: then it must be computed as the file was). FD on torchvision's inception_v3 is not
the FID of pytorch-fid or clean-fid, which use a port of the TensorFlow Inception network.
--bootstrap and --infinity resample B: it is read from images here, or from a file saved with every
vector kept (stats --kid-keep at least its count).
"""


def _statistics_options(parser: argparse.ArgumentParser) -> None:
    add_model_options(parser)
    parser.add_argument(
        "--pool",
        choices=("avg", "max", "cls", "none"),
        default=...,  # not given: avg (see _pool_text); fd compares only a pool that was given
        help="how each image's output becomes one vector: avg/max over positions, the class token (cls), "
        "or none for layers that return vectors (default: avg)",
    )
    add_stream_options(parser)


_LPIPS_EPILOG = """\
examples:
  featurehooks lpips outputs/ references/                      # AlexNet, v0.1, calibrated: what papers report
  featurehooks lpips outputs/ references/ --net vgg --out scores.csv
  featurehooks lpips outputs/ references/ --resize 256 --crop 256 --ignore-suffix

Files are paired by their path relative to each folder; files found in one folder only, and entries
that are not regular files (a FIFO, a socket, a device: never opened), are listed on stderr and left
out. A batch holds at most --batch-size pairs and --batch-pixels pixels (height x width summed over its
pairs), so large images get smaller batches, down to one pair: memory grows with the pixels of a
batch (LPIPS on VGG needs about 1.7 GB per megapixel pair). The calibrated linear heads come from an
installed lpips (or torchmetrics) package, or from --heads FILE.
"""


_LPIPS_ABOUT = """\
LPIPS between the images of two folders, paired by relative path

Score every pair of images with the same relative path in two folders with calibrated LPIPS; print the mean ± std
and the count, and write the per-pair scores with --out.
"""

_FD_ABOUT = """\
Fréchet distance (and KID) between the features of two image sets

Fréchet distance between the pooled features of two image sets (folders, globs or statistics files), per layer, from
streaming statistics: no feature file is written.
"""

_STATS_ABOUT = """\
save the feature statistics of an image set (a reference for fd)

Stream an image set through a backbone and save the mean and covariance of one layer's pooled features (and a sample
of them for KID) to a .npz file that `featurehooks fd` reads.
"""


def add_metric_commands(commands: Any) -> None:
    """Add ``lpips``, ``fd`` and ``stats`` to the ``featurehooks`` command's subparsers."""
    lpips = add_command(commands, "lpips", _LPIPS_ABOUT, _LPIPS_EPILOG)
    add_pair_options(lpips)
    lpips.add_argument("--net", choices=("alex", "vgg", "squeeze"), default="alex", help="backbone (default: alex)")
    lpips.add_argument("--version", choices=("0.0", "0.1"), default="0.1", help="LPIPS version (default: 0.1)")
    lpips.add_argument("--uncalibrated", action="store_true", help="the baseline without the learned heads")
    lpips.add_argument("--heads", metavar="FILE", default=None, help="a file with the calibrated linear heads")
    lpips.set_defaults(run=_lpips)

    fd = add_command(commands, "fd", _FD_ABOUT, _FD_EPILOG)
    fd.add_argument("set_a", metavar="A", help="image folder, glob or file; or a statistics .npz")
    fd.add_argument("set_b", metavar="B", help="image folder, glob or file; or a statistics .npz")
    _statistics_options(fd)
    fd.add_argument("--kid", action="store_true", help="also the kernel inception distance (mean ± std)")
    fd.add_argument(
        "--kid-keep", type=positive, default=10_000, metavar="N", help="vectors kept per set for KID (default: 10000)"
    )
    add_kid_subset_option(fd, "vectors")
    fd.add_argument(
        "--prdc",
        action="store_true",
        help="also precision, recall, density and coverage, with A as the reference (real) set",
    )
    add_prdc_k_option(fd)
    fd.add_argument(
        "--prdc-keep",
        type=positive,
        default=10_000,
        metavar="N",
        help="vectors kept per set for PRDC (default: 10000; with --kid, the larger of the two keeps)",
    )
    add_sample_size_options(fd)
    fd.set_defaults(run=_fd)

    stats = add_command(commands, "stats", _STATS_ABOUT, _FD_EPILOG)
    stats.add_argument("sources", nargs="+", metavar="SRC", help="image folders (recursive), files or glob patterns")
    stats.add_argument("--out", required=True, metavar="NPZ", help="where to write the statistics")
    _statistics_options(stats)
    stats.add_argument(
        "--keep", type=non_negative, default=10_000, metavar="N", help="vectors kept for KID (default: 10000)"
    )
    add_shard_option(stats, "statistics file")
    stats.set_defaults(run=_stats)


def _lpips(args: argparse.Namespace) -> int:
    import torch

    from ..metrics import LPIPS

    device = device_from(args.device)
    check_precision(args, device)
    pairs = folder_pairs(args)
    weights = weights_from(args.weights)
    if weights is None:
        torch.manual_seed(args.seed)
    metric = LPIPS(
        args.net,
        args.version,
        calibrated=not args.uncalibrated,
        reduction="none",
        weights=weights,
        heads=args.heads,
        precision=args.precision,
    ).to(device)
    kind = "uncalibrated" if args.uncalibrated else "calibrated"
    report_scores(args, f"LPIPS ({args.net}, v{args.version}, {kind})", pairs, score_folder_pairs(args, metric, pairs))
    return 0


def _pool_text(args: argparse.Namespace) -> str:
    """``--pool`` as written, ``avg`` when not given."""
    return "avg" if args.pool is ... else args.pool


def _pool(args: argparse.Namespace) -> Pool | None:
    return None if _pool_text(args) == "none" else as_pool(_pool_text(args))


def _stats(args: argparse.Namespace) -> int:
    from .._stream import list_images
    from ..metrics import feature_statistics

    if len(args.layers) != 1:
        raise UserError(f"a statistics file holds one layer; got --layers {' '.join(args.layers)}")
    check_output_file(args.out)
    sources = list_images(args.sources)
    with _warnings_as_lines():
        stats = feature_statistics(
            build_extractor(args),
            sources,
            pool=_pool(args),
            keep=args.keep,
            **stream_options(args),
        )
    if is_main_rank():  # under torchrun every rank holds the merged statistics; one writes them
        path = stats.save(args.out)
        part = f" of {stats.shard}" if stats.shard else ""
        print(f"wrote {path}: {args.layers[0]}, {stats.count} images{part}, {stats.dim} features")
    return 0


def _fd(args: argparse.Namespace) -> int:
    from .._stream.sharding import process_group
    from ..metrics import frechet_distance, kernel_inception_distance
    from ..metrics.statistics import KEEP_ALL

    sources = (args.set_a, args.set_b)
    files = {source: _statistics_file(args, source) for source in sources if is_statistics_file(source)}
    computed = next((source for source in sources if source not in files), None)
    for source, stats in files.items():  # every file checked before any image is read
        _check_setup(args, source, stats.origin, computed)
    model = functools.cache(lambda: build_extractor(args))  # one model for both sets, none for two files
    keep = max(args.kid_keep if args.kid else 0, args.prdc_keep if args.prdc else 0)  # one sample serves both
    keeps = (keep, KEEP_ALL if sample_size_asked(args) else keep)  # resampling B needs all of B
    with process_group(device_from(args.device)):  # under torchrun: one group for both sets
        sides = [
            {args.layers[0]: files[s]} if s in files else _computed(args, s, model, k) for s, k in zip(sources, keeps)
        ]
    if not is_main_rank():  # under torchrun every rank holds the merged statistics; one reports
        return 0
    for layer in args.layers:
        a, b = sides[0][layer], sides[1][layer]
        with warnings.catch_warnings(record=True) as caught:  # one line each on stderr, not Python's form
            warnings.simplefilter("always")
            line = f"{layer}: FD {frechet_distance(a, b):.6g}"
            line += sample_size(args, a, b).text(args.bootstrap)
        print_warnings(caught, f"{layer}: ")
        if args.kid:
            kept = min(_kept(a), _kept(b))
            if kept < args.kid_subset_size:
                raise UserError(
                    f"KID of {layer}: a set has {kept} feature vectors for KID, fewer than --kid-subset-size "
                    f"{args.kid_subset_size}; each set needs at least that many (see --kid-keep): pass "
                    f"--kid-subset-size {max(kept, 2)} or less for sets this small"
                )
            mean, std = kernel_inception_distance(a, b, subset_size=args.kid_subset_size)
            line += f", KID {mean:.6g} ± {std:.3g}"
        if args.prdc:
            line += ", " + _prdc_text(a, b, args.prdc_k, layer)
        print(f"{line} (A: {a.count} images, B: {b.count} images)")
    return 0


def _prdc_text(a: FeatureStatistics, b: FeatureStatistics, k: int, layer: str) -> str:
    """Precision, recall, density and coverage of B against the reference A, from their kept vectors."""
    from ..metrics import precision_recall

    with warnings.catch_warnings(record=True) as caught:  # one line each on stderr, not Python's form
        warnings.simplefilter("always")
        found = precision_recall(a, b, k=k)
    print_warnings(caught, f"{layer}: ")
    return prdc_text(found, k)


def _kept(stats: FeatureStatistics) -> int:
    """How many feature vectors a set keeps for KID (0: none)."""
    features = getattr(stats, "features", None)
    return 0 if features is None else int(features.shape[0])


def _statistics_file(args: argparse.Namespace, source: str) -> FeatureStatistics:
    """The ``FeatureStatistics`` of a ``.npz``, refused unless it holds the one layer of ``--layers``."""
    from ..metrics import FeatureStatistics

    if len(args.layers) != 1:
        raise UserError(f"{source} holds the statistics of one layer; pass that one to --layers")
    stats = FeatureStatistics.load(source)
    if stats.origin is not None and stats.origin.layer != args.layers[0]:
        raise UserError(f"{source} holds statistics of layer {stats.origin.layer!r}, not {args.layers[0]!r}")
    return stats


def _check_setup(args: argparse.Namespace, source: str, origin: FeatureOrigin | None, computed: str | None) -> None:
    """Refuse a statistics file computed with another ``--backbone``, ``--weights`` or ``--pool`` than asked.

    Between two files only the options given are compared (``--backbone`` always is): nothing is
    computed, so a default the user did not choose says nothing. When the other set (``computed``) is
    computed here, it is computed with the defaults of the options not given, so those must match
    too; checked now, from the weights' names, rather than by the library after the whole compute.
    A file without an origin (saved from Python without one) is not checked.
    """
    if origin is None:
        return
    from ..backbones import build_architecture

    weights_given, pool_given = args.weights is not ..., args.pool is not ...
    differences = []  # (what the file says, what is asked)
    if origin.backbone != args.backbone:
        differences.append((f"--backbone {origin.backbone}", f"--backbone {args.backbone}"))
    if weights_given or computed is not None:
        text = weights_arg(args)
        resolved = build_architecture(args.backbone, weights_from(text)).weights  # no weights are read
        if resolved != origin.weights:
            named = () if resolved in (None, text) else (str(resolved),)
            differences.append(
                (f"--weights {_weights_value(origin.weights)}", _asked("--weights", text, weights_given, named))
            )
    if (pool_given or computed is not None) and _pool_text(args) != (origin.pool or "none"):
        differences.append((f"--pool {origin.pool or 'none'}", _asked("--pool", _pool_text(args), pool_given)))
    if differences:
        says, asked = (" ".join(side) for side in zip(*differences))
        where = f"{computed} would be computed with" if computed is not None else "the command asks for"
        raise UserError(
            f"{source} holds statistics computed with {says}, but {where} {asked}: distances between other "
            f"features mean nothing; pass {says}"
        )


def _weights_value(weights: str | None) -> str:
    """The ``--weights`` value that gives a statistics file's weights: ``none``, ``DEFAULT`` for timm's, or the name."""
    if weights is None:
        return "none"
    return "DEFAULT" if weights.startswith("timm:") else weights


def _asked(flag: str, value: str, given: bool, details: tuple[str, ...] = ()) -> str:
    """``--flag value``, noting a default the user did not choose and what the value stands for."""
    notes = (*(() if given else ("the default",)), *details)
    return f"{flag} {value}" + (f" ({', '.join(notes)})" if notes else "")


def _computed(
    args: argparse.Namespace, source: str, model: Callable[[], FeatureExtractor], keep: int
) -> dict[str, FeatureStatistics]:
    """Statistics of one image set by layer, computed from its images."""
    from .._stream import list_images
    from ..metrics import feature_statistics_by_layer

    with _warnings_as_lines():
        return feature_statistics_by_layer(
            model(),
            list_images([source]),
            layers=args.layers,
            pool=_pool(args),
            keep=keep,
            **stream_options(args),
        )


@contextlib.contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """The library's warnings (unreadable inputs left out) as one line each on stderr, not in Python's form."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            print_warnings(caught)
