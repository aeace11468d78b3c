"""The ``fid`` subcommand: the FID ``python -m pytorch_fid`` prints (or another lineage's, ``--mode``), from image
sets or statistics files."""

from __future__ import annotations

import argparse
import functools
import re
import sys
import warnings
import zipfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from ..errors import InvalidValueError
from ._common import (
    UserError,
    add_command,
    add_device_option,
    add_precision_option,
    add_seed_option,
    add_shard_option,
    add_stream_options,
    add_weights_option,
    check_output_file,
    check_precision,
    device_from,
    is_main_rank,
    is_statistics_file,
    print_warnings,
    stream_options,
    weights_from,
)
from ._sample_size import add_sample_size_options, sample_size, sample_size_asked

if TYPE_CHECKING:
    import torch

    from ..extractor import FeatureExtractor
    from ..metrics import FeatureStatistics

__all__ = ["add_fid_command"]

_DIMS = (64, 192, 768, 2048)  # pytorch-fid's --dims (featurehooks.metrics.FID_LAYERS, not imported before it runs)
_MODES = ("legacy_pytorch", "legacy_tensorflow", "clean")  # featurehooks.metrics.FID_MODES, likewise
_SINGULAR = "fewer than dimensions + 1"  # frechet_distance's warning for small sets, said here per set instead
_DIMS_ARGUMENT = re.compile(r"\bdims?=")  # the readers' dims=/dim=, which is --dims here

_EPILOG = """\
examples:
  featurehooks fid real/ fake/                        # prints "FID:  <value>", as python -m pytorch_fid does
  featurehooks fid --save-stats real/ real.npz        # a reference set's statistics, computed once
  featurehooks fid real.npz fake/
  featurehooks fid fid_stats_cifar10_train.npz fake/  # pytorch-fid's and TTUR's mu/sigma files are read too
  featurehooks fid --mode legacy_tensorflow real/ fake/  # torch-fidelity's (StyleGAN's, ADM's, EDM's) number
  featurehooks fid --mode clean real/ fake/            # clean-fid's number
  featurehooks fid real.npz fake/ --bootstrap 100 --infinity  # then a 95% interval and FD∞ on the same line

The network is pytorch-fid's port of TensorFlow's FID Inception (backbone fid_inception) with its weights
file pt_inception-2015-12-05-6726825d.pth, read from $TORCH_HOME/hub/checkpoints/ (where pytorch-fid's own
download puts it) or given with --weights FILE. Every image enters at its own size and is resized to
299x299 inside the network as --mode says: legacy_pytorch (the default) as pytorch-fid does (bilinear, no
antialiasing; the number equals its number on the same images), legacy_tensorflow as TensorFlow 1 and
torch-fidelity do (bilinear without half-pixel centers, on uint8 levels), clean as clean-fid does (Pillow's
bicubic, antialiased). The three numbers differ: compare FIDs of one mode only. Folders are searched
recursively (pytorch-fid reads a folder's own files only).

A statistics file is one written by --save-stats or `featurehooks stats` (refused unless it holds these
features, of this --mode; files written before modes were recorded are legacy_pytorch), or any .npz with
arrays mu and sigma (pytorch-fid's --save-stats, TTUR's precomputed files), taken as it is. Sets of 2048
images or fewer give a singular covariance and a number dominated by the estimate's bias: FID needs at least
2049 images per set, and is usually reported on 10,000 or 50,000. There, pytorch-fid's scipy sqrtm is
inaccurate (2e-5 off the exact value on three photos a set, or it fails), while this command computes the
singular case exactly; above 2048 images both agree to rounding.
"""

Side = Union["FeatureStatistics", "tuple[torch.Tensor, torch.Tensor]"]


_FID_ABOUT = """\
FID between two image sets (or statistics files), the number python -m pytorch_fid prints

Fréchet Inception Distance between two image sets (folders, globs or files) or statistics files, on the TensorFlow
Inception network of pytorch-fid, with its preprocessing.
"""


def add_fid_command(commands: Any) -> None:
    """Add ``fid`` to the ``featurehooks`` command's subparsers."""
    fid = add_command(commands, "fid", _FID_ABOUT, _EPILOG)
    fid.add_argument("set_a", metavar="A", help="image folder (recursive), glob or file; or a statistics .npz")
    fid.add_argument(
        "set_b",
        metavar="B",
        help="image folder (recursive), glob or file; or a statistics .npz; with --save-stats, the .npz to write",
    )
    fid.add_argument(
        "--save-stats",
        action="store_true",
        help="write the statistics of the images A to the file B instead (pytorch-fid's --save-stats)",
    )
    fid.add_argument(
        "--dims",
        type=int,
        choices=_DIMS,
        default=2048,
        help="features: 2048 (pool3) is FID; 64, 192, 768 are pytorch-fid's earlier blocks (default: 2048)",
    )
    fid.add_argument(
        "--mode",
        default=_MODES[0],
        metavar="NAME",
        help="the FID lineage, the resize and scaling before the network: legacy_pytorch (pytorch-fid), "
        "legacy_tensorflow (torch-fidelity, TensorFlow, StyleGAN, ADM, EDM) or clean (clean-fid) "
        "(default: legacy_pytorch)",
    )
    add_weights_option(
        fid,
        "the weights file (default: DEFAULT, pt_inception-2015-12-05-6726825d.pth from the torch hub cache), "
        "or 'none' for a seeded random init, which is not the FID network",
        metavar="FILE",
    )
    add_sample_size_options(fid)
    add_seed_option(fid)
    add_stream_options(fid)
    add_shard_option(fid, "statistics file (with --save-stats)")
    add_device_option(fid)
    add_precision_option(fid)
    fid.set_defaults(run=_fid)


def _fid(args: argparse.Namespace) -> int:
    import torch

    from .._stream import list_images
    from .._stream.sharding import process_group
    from ..metrics import fid_extractor, frechet_distance
    from ..metrics.statistics import KEEP_ALL

    _check_mode(args.mode)
    device = device_from(args.device)  # a bad --device fails before anything is read
    check_precision(args, device)
    weights = weights_from(args.weights)
    if args.save_stats:
        return _save_stats(args, device, weights)
    if args.shard is not None:
        raise UserError(
            "--shard computes a part of a set's statistics: pass it with --save-stats, then merge the "
            "parts with `featurehooks merge`"
        )
    sources = (args.set_a, args.set_b)
    files = {source: _read_file(args, source, weights) for source in sources if is_statistics_file(source)}
    images = {source: list_images([source]) for source in sources if source not in files}  # before any compute

    @functools.cache
    def model() -> FeatureExtractor:  # one network for both sets, none for two files
        if weights is None:
            torch.manual_seed(args.seed)
            if is_main_rank():  # once, not once per torchrun rank
                print("featurehooks: warning: --weights none is a random init, not the FID network", file=sys.stderr)
        return fid_extractor(weights, dims=args.dims, mode=args.mode, device=device, precision=args.precision)

    resampled = sample_size_asked(args)
    if resampled and args.set_b in files:
        _check_resamplable(args.set_b, files[args.set_b])
    with process_group(device):  # under torchrun: one group for both sets
        keeps = (0, KEEP_ALL if resampled else 0)  # resampling B needs every vector of B
        sides = [files[s] if s in files else _computed(args, images[s], model, k) for s, k in zip(sources, keeps)]
    if not is_main_rank():  # under torchrun every rank holds the merged statistics; one reports
        return 0
    for label, source, side in zip("AB", sources, sides):
        _warn_if_small(label, source, side, args.dims)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = frechet_distance(sides[0], sides[1])
        more = sample_size(args, sides[0], sides[1]).text(args.bootstrap) if resampled else ""  # type: ignore[arg-type]
    print_warnings([w for w in caught if _SINGULAR not in str(w.message)])
    print("FID: ", value, end=f"{more}\n")  # pytorch-fid's line (two spaces, the float's shortest repr), then any more
    return 0


def _check_resamplable(source: str, side: Side) -> None:
    """Refuse, before any compute, a B file whose images cannot be resampled: it kept not every vector."""
    if isinstance(side, tuple) or not side.keep or side.features.shape[0] < side.count:
        raise UserError(
            f"--bootstrap and --infinity resample B's images, and {source} holds their mean and covariance only: "
            "pass B's images, or statistics saved with every vector kept (`featurehooks stats --kid-keep N`)"
        )


def _save_stats(args: argparse.Namespace, device: torch.device, weights: str | None) -> int:
    import torch

    from .._stream import list_images
    from ..metrics import fid_extractor

    _check_mode(args.mode)
    if is_statistics_file(args.set_a):
        raise UserError(f"--save-stats computes the statistics of images, and {args.set_a} is a statistics file")
    check_output_file(args.set_b)
    files = list_images([args.set_a])
    if weights is None:
        torch.manual_seed(args.seed)
    stats = _computed(
        args,
        files,
        lambda: fid_extractor(weights, dims=args.dims, mode=args.mode, device=device, precision=args.precision),
    )
    if not is_main_rank():  # every rank holds the merged statistics; one writes them
        return 0
    path = stats.save(args.set_b)
    if stats.shard is None:  # a part is small by design; the merged statistics are what FID is computed from
        _warn_if_small("A", args.set_a, stats, args.dims)
    part = f" of {stats.shard}" if stats.shard else ""
    print(f"wrote {path}: FID statistics of {stats.count} images{part}, {stats.dim} features, mode {args.mode}")
    return 0


def _read_file(args: argparse.Namespace, source: str, weights: str | None) -> Side:
    """A statistics file: featurehooks' own (checked against what this command computes), or a mu/sigma pair; of
    --dims features, which the reader checks before it unpacks anything."""
    from ..metrics import FeatureStatistics, load_mu_sigma

    try:
        if not _has_meta(source):
            return load_mu_sigma(source, dims=args.dims)
        stats = FeatureStatistics.load(source, dim=args.dims)
    except InvalidValueError as exc:  # the reader names Python arguments: name the flag
        raise InvalidValueError(_DIMS_ARGUMENT.sub("--dims ", str(exc))) from None
    _check_origin(args, source, stats, weights)
    return stats


def _check_mode(mode: str) -> None:
    """Refuse a --mode that names no FID lineage, with the closest names, before anything is read."""
    from ..backbones._fid_resize import check_lineage

    try:
        check_lineage(mode)
    except InvalidValueError as exc:
        raise UserError(f"--mode: {exc}") from None


def _has_meta(source: str) -> bool:
    """Whether an ``.npz`` is featurehooks' own statistics file (it has a ``meta`` array), not a bare mu/sigma."""
    try:
        with zipfile.ZipFile(source) as archive:
            return "meta.npy" in archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return False  # load_mu_sigma says what is wrong with it


def _check_origin(args: argparse.Namespace, source: str, stats: FeatureStatistics, weights: str | None) -> None:
    """Refuse, before any compute, a featurehooks statistics file of other features than this command's."""
    from ..backbones.fid_inception import FID_INCEPTION, fid_inception_architecture
    from ..metrics import FID_LAYERS

    origin = stats.origin
    if origin is None:  # saved from Python without an origin: nothing to check
        return
    layer = FID_LAYERS[args.dims]
    if (origin.backbone, origin.layer, origin.pool) != (FID_INCEPTION, layer, "avg"):
        raise UserError(
            f"{source} holds statistics of {origin.backbone} {origin.layer} (pool {origin.pool}), not FID's "
            f"({FID_INCEPTION} {layer}, pool avg): compute them with `featurehooks fid --save-stats`, or compare "
            "them with `featurehooks fd`"
        )
    if origin.lineage != args.mode:
        raise UserError(
            f"{source} holds FID statistics of --mode {origin.lineage}, but this command computes --mode {args.mode}: "
            f"FIDs of two modes are not comparable; pass --mode {origin.lineage}"
        )
    expected = fid_inception_architecture(weights).weights  # what this command records: nothing is read
    if origin.weights != expected:
        asked = "none" if weights is None else args.weights
        raise UserError(
            f"{source} holds statistics computed with weights {origin.weights or 'none (random init)'}, but this "
            f"command uses --weights {asked} ({expected or 'random init'}): pass the weights the file was computed with"
        )


def _computed(
    args: argparse.Namespace, files: list[str], model: Callable[[], FeatureExtractor], keep: int = 0
) -> FeatureStatistics:
    """FID statistics of ``files`` (``keep`` vectors kept), their warnings (unreadable images) printed as one line
    each."""
    from ..metrics import fid_statistics

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = fid_statistics(files, extractor=model(), keep=keep, **stream_options(args))
    print_warnings(caught)
    return stats


def _warn_if_small(label: str, source: str, side: Side, dims: int) -> None:
    """One line on stderr for a set of no more images than features: its covariance is singular."""
    if isinstance(side, tuple):  # a mu/sigma file does not say how many images it summarizes
        return
    count = side.count
    if count <= dims:
        print(
            f"featurehooks: warning: {label} ({source}) holds {count} images, fewer than {dims + 1}: its {dims}x{dims} "
            f"covariance is singular and FID is dominated by the estimate's bias (and python -m pytorch_fid's sqrtm "
            f"is inaccurate: it may print another number, or fail); use at least {dims + 1} images (FID is usually "
            "reported on 10,000 or 50,000), and compare only FIDs of equal numbers of images",
            file=sys.stderr,
        )
