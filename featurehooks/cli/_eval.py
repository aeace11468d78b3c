"""The ``eval`` subcommand: FID, FD_DINOv2, CMMD, the Inception Score, KID, PRDC and sFID of two image sets from one
decode of each image (``featurehooks.metrics.evaluate``), one line per metric or one JSON object."""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import InvalidValueError, WeightsUnavailableError, did_you_mean
from ..metrics import FD_DINOV2_MODELS, FID_MODES, METRICS, PRDC
from ._common import (
    UserError,
    add_command,
    add_device_option,
    add_kid_subset_option,
    add_prdc_k_option,
    add_seed_option,
    add_shard_option,
    add_stream_options,
    check_output_file,
    device_from,
    is_main_rank,
    is_statistics_file,
    positive,
    prdc_text,
    print_warnings,
    stream_options,
    weights_from,
)
from ._sample_size import SampleSize, add_sample_size_options, sample_size, sample_size_asked

if TYPE_CHECKING:
    from ..metrics import Evaluation, FeatureStatistics

__all__ = ["add_eval_command"]

# per backbone of evaluate: its weights flag, what its random init is not, and how the library's messages name it
_BACKBONES = {
    "inception": ("--inception-weights", "the FID Inception", "fid_inception"),
    "dinov2": ("--dinov2-weights", "DINOv2", "dinov2_"),
    "clip": ("--clip-weights", "CLIP ViT-L/14@336", "clip_vit_"),
}
_FRECHET = ("fid", "fd_dinov2", "sfid")  # the Fréchet distances, which --bootstrap and --infinity qualify
_WEIGHTS_ARGUMENT = re.compile(r"\bweights=(None|'([^']*)')")

_EPILOG = """\
examples:
  featurehooks eval real/ fake/                            # all seven metrics, one line each
  featurehooks eval real/ fake/ --metrics fid,kid,prdc --kid-subset-size 100 --prdc-k 3
  featurehooks eval real/ fake/ --metrics fid,is,sfid --fid-mode legacy_tensorflow --json  # as ADM's evaluator
  torchrun --nproc-per-node 4 -m featurehooks eval real/ fake/ --metrics fd_dinov2,cmmd
  featurehooks eval --save-stats real/ real.npz --metrics fid,fd_dinov2   # a reference set, computed once
  featurehooks eval real.npz fake/ --metrics fid,fd_dinov2
  featurehooks eval --save-stats real/ real-$SLURM_ARRAY_TASK_ID.npz --metrics fid,fd_dinov2 --shard slurm  # a part
  featurehooks merge real.npz real-0.npz real-1.npz real-2.npz               # the parts joined: the set of one run

Each image is read once; every backbone the metrics need prepares it as that metric's own function does,
and each number equals that function's (featurehooks.metrics.evaluate). fid, kid, prdc and is use the FID
Inception's pool features in the lineage --fid-mode (is: of FAKE only), sfid its spatial features from the
same forward (mixed_6/conv, as the ADM evaluator), fd_dinov2 DINOv2's class token
(--dinov2-model; vitl14 is FD_DINOv2), cmmd CLIP ViT-L/14@336's embedding. REAL is PRDC's reference.
Weights come from the caches (the torch hub's for the Inception and DINOv2, Hugging Face's for CLIP), or
--inception-weights/--dinov2-weights/--clip-weights FILE; 'none' is a random init seeded by --seed, which
is no benchmark's network. Every vector is kept for cmmd, is, kid and prdc (N x 2048 float32 per set for
the Inception). --json prints one object: floats, {"mean", "std"} for is and kid, the four PRDC fields, and
"images": the count of each set. --bootstrap and --infinity add to each Fréchet distance (fid, fd_dinov2,
sfid) its 95% interval over resamples of FAKE and FD∞ (JSON: "fid_bootstrap": [low, high], "fid_infinity"),
keeping every vector of both sets. A statistics file of --save-stats holds what its --metrics needed (every
vector, where they needed them); it must come from the same weights, --fid-mode and --dinov2-model. With
--shard I/N it holds shard I of N of REAL only (one job of a job array); `featurehooks merge` joins the parts
into the file one run writes (every vector kept, in row order).
"""


_EVAL_ABOUT = """\
FID, FD_DINOv2, CMMD, IS, KID, PRDC and sFID of two image sets, each image decoded once (torchrun-aware)

The generative metrics of FAKE against REAL (image folders, globs or files): every backbone they need from one
decode of each image, one line per metric in the order asked.
"""


def add_eval_command(commands: Any) -> None:
    """Add ``eval`` to the ``featurehooks`` command's subparsers."""
    parser = add_command(commands, "eval", _EVAL_ABOUT, _EPILOG)
    parser.add_argument(
        "real",
        metavar="REAL",
        help="the reference images: folder (recursive), glob or file; or a statistics .npz of eval --save-stats",
    )
    parser.add_argument(
        "fake",
        metavar="FAKE",
        help="the generated images, as REAL; with --save-stats, the .npz to write REAL's statistics to",
    )
    parser.add_argument(
        "--save-stats",
        action="store_true",
        help="write the statistics of the images REAL that --metrics need to the file FAKE instead (a reference "
        "set, computed once)",
    )
    parser.add_argument(
        "--metrics",
        default=",".join(METRICS),
        metavar="LIST",
        help=f"comma-separated, printed in this order: {', '.join(METRICS)} (default: all)",
    )
    parser.add_argument(
        "--fid-mode",
        default=FID_MODES[0],
        metavar="NAME",
        help=f"the FID lineage of the Inception's features (fid, is, kid, prdc, sfid): {', '.join(FID_MODES)} "
        f"(default: {FID_MODES[0]}; see `featurehooks fid --help`)",
    )
    parser.add_argument(
        "--dinov2-model",
        default="vitl14",
        metavar="NAME",
        help=f"the DINOv2 of fd_dinov2: {', '.join(FD_DINOV2_MODELS)} (default: vitl14, FD_DINOv2's)",
    )
    add_kid_subset_option(parser, "images")
    add_prdc_k_option(parser)
    parser.add_argument(
        "--is-splits", type=positive, default=10, metavar="N", help="parts of the Inception Score (default: 10)"
    )
    for backbone, (flag, network, _) in _BACKBONES.items():
        parser.add_argument(
            flag,
            dest=f"{backbone}_weights",
            type=weights_from,
            default="DEFAULT",
            metavar="FILE",
            help=f"weights of {network}: a file, or 'none' for a seeded random init (default: the released "
            "weights from the cache)",
        )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of one line per metric")
    add_sample_size_options(parser, "FAKE")
    add_seed_option(parser)
    add_stream_options(parser)
    add_shard_option(parser, "statistics file (with --save-stats)")
    add_device_option(parser)
    parser.set_defaults(run=_eval)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from .._stream import list_images
    from .._stream.sharding import process_group
    from ..metrics import evaluate, save_statistics

    metrics = _metrics(args.metrics)
    _check_name("--fid-mode", args.fid_mode, FID_MODES)
    _check_name("--dinov2-model", args.dinov2_model, FD_DINOV2_MODELS)
    device = device_from(args.device)  # a bad --device fails before anything is read
    if args.save_stats:
        check_output_file(args.fake)
    elif args.shard is not None:
        raise UserError(
            "--shard computes a part of REAL's statistics: pass it with --save-stats, then merge the parts with "
            "`featurehooks merge` (the metrics compare two whole sets)"
        )
    sides = [_read_side(source) if is_statistics_file(source) else list_images([source]) for source in _sets(args)]
    _check_sizes(args, metrics, *(_count(side) for side in sides))
    weights = {backbone: getattr(args, f"{backbone}_weights") for backbone in _BACKBONES}
    if None in weights.values():
        torch.manual_seed(args.seed)  # random init, identical on every rank and every run
    with warnings.catch_warnings(record=True) as caught, process_group(device):  # under torchrun: one group
        warnings.simplefilter("always")
        try:
            found = evaluate(
                sides[0],
                sides[1] if len(sides) > 1 else None,
                metrics,
                fid_mode=args.fid_mode,
                dinov2_model=args.dinov2_model,
                weights=weights,
                device=device,
                kid_subset_size=args.kid_subset_size,
                prdc_k=args.prdc_k,
                is_splits=args.is_splits,
                keep_vectors=sample_size_asked(args),
                **stream_options(args),
            )
        except WeightsUnavailableError as exc:
            raise UserError(_with_flag(str(exc).strip().splitlines()[0], weights)) from None
        finally:
            if is_main_rank():
                print_warnings(caught)
    if not is_main_rank():  # under torchrun every rank holds the merged statistics; one reports
        return 0
    used = {stats.origin.backbone for stats in found.real.values() if stats.origin is not None}
    for backbone, (flag, network, marker) in _BACKBONES.items():
        if weights[backbone] is None and any(name.startswith(marker) for name in used):
            note = f"{flag} none is a random init, not {network}: its numbers are no benchmark's"
            print(f"featurehooks: warning: {note}", file=sys.stderr)
    if args.save_stats:
        path = save_statistics(args.fake, found.real)
        counts = ", ".join(f"{kind} {stats.count} images x {stats.dim}" for kind, stats in found.real.items())
        shard = next(iter(found.real.values())).shard
        part = f" of {shard}" if shard else ""
        print(f"wrote {path}: the statistics of REAL{part} for {', '.join(metrics)} ({counts})")
        return 0
    sizes = {
        name: sample_size(args, *found.statistics_of(name), "FAKE")
        for name in metrics
        if name in _FRECHET and sample_size_asked(args)
    }
    if args.json:
        print(json.dumps(_as_json(found, metrics, sizes)))
    else:
        for name in metrics:
            more = sizes[name].text(args.bootstrap) if name in sizes else ""
            print(f"{name}: {_text(found.numbers[name], args.prdc_k)}{more}")
    return 0


def _metrics(text: str) -> list[str]:
    """``--metrics``' names in the order given, each once; an unknown one is a UserError naming the closest."""
    names = [name.strip() for name in text.split(",")]
    for name in names:
        if name not in METRICS:
            hint = did_you_mean(name, METRICS)
            raise UserError(
                f"--metrics: unknown metric {name!r}" + (f"; {hint}" if hint else "") + f" (the metrics: "
                f"{', '.join(METRICS)})"
            )
    return list(dict.fromkeys(names))


def _check_name(flag: str, name: str, names: tuple[str, ...]) -> None:
    """Refuse a ``flag`` value not in ``names``, naming the closest, before anything is read."""
    if name not in names:
        hint = did_you_mean(name, names)
        raise UserError(f"{flag}: unknown name {name!r}" + (f"; {hint}" if hint else "") + f" ({', '.join(names)})")


def _sets(args: argparse.Namespace) -> list[str]:
    """The sets to read: REAL and FAKE, or REAL alone with --save-stats (refused as a statistics file)."""
    if not args.save_stats:
        return [args.real, args.fake]
    if is_statistics_file(args.real):
        raise UserError(f"--save-stats computes the statistics of images, and {args.real} is a statistics file")
    return [args.real]


def _read_side(source: str) -> dict[str, FeatureStatistics]:
    """A set given as the statistics file of an ``eval --save-stats`` (one line for any other file)."""
    from ..metrics import load_statistics
    from ..metrics.statistics import FORMAT

    try:
        return load_statistics(source)
    except InvalidValueError as exc:
        if repr(FORMAT) in str(exc):
            raise UserError(
                f"{source} holds the statistics of one layer (fid --save-stats, stats --out); eval reads the "
                "statistics of every backbone its metrics need: write them with eval --save-stats"
            ) from None
        raise


def _count(side: list[str] | dict[str, FeatureStatistics]) -> int:
    """Images in a set: files listed, or the count its statistics summarize."""
    return len(side) if isinstance(side, list) else min(stats.count for stats in side.values())


def _check_sizes(args: argparse.Namespace, metrics: list[str], real: int, fake: int | None = None) -> None:
    """Refuse, before any compute, sets too small for KID's subsets, PRDC's k or the Inception Score's splits (an
    unreadable image, left out later, can still make one too small: the library then says so); with --save-stats,
    REAL alone."""
    smaller = real if fake is None else min(real, fake)
    if "kid" in metrics and smaller < args.kid_subset_size:
        raise UserError(
            f"kid: a set has {smaller} images, fewer than --kid-subset-size {args.kid_subset_size}; pass "
            f"--kid-subset-size {max(smaller, 2)} or less for sets this small"
        )
    if "prdc" in metrics and smaller <= args.prdc_k:
        raise UserError(
            f"prdc: a set has {smaller} images, and --prdc-k {args.prdc_k} needs at least {args.prdc_k + 1}; pass "
            f"--prdc-k {max(smaller - 1, 1)} or less for sets this small"
        )
    if "is" in metrics and fake is not None and fake < args.is_splits:
        raise UserError(
            f"is: FAKE has {fake} images, fewer than --is-splits {args.is_splits}; pass --is-splits {fake} or less"
        )


def _with_flag(message: str, weights: dict[str, str | None]) -> str:
    """A weights error's message naming this command's flag (``--dinov2-weights FILE``), not ``weights=``."""
    for backbone, (flag, _, marker) in _BACKBONES.items():
        given = weights[backbone]
        if marker in message or (given not in (None, "DEFAULT") and str(given) in message):
            named = _WEIGHTS_ARGUMENT.sub(_as_flag(flag), message)
            return named if named != message else f"{flag}: {message}"
    return message


def _as_flag(flag: str) -> Callable[[re.Match[str]], str]:
    """``weights=None`` as ``FLAG none``, ``weights='FILE'`` as ``FLAG FILE``."""
    return lambda found: f"{flag} {'none' if found[2] is None else found[2]}"


def _text(value: Any, k: int) -> str:
    """One metric's number as printed: ``12.3456``, ``mean ± std``, or PRDC's four fields."""
    if isinstance(value, PRDC):
        return prdc_text(value, k)
    if isinstance(value, tuple):
        mean, std = value
        return f"{mean:.6g} ± {std:.3g}"
    return f"{value:.6g}"


def _as_json(found: Evaluation, metrics: list[str], sizes: dict[str, SampleSize]) -> dict[str, Any]:
    """The numbers as JSON values (floats, ``{"mean", "std"}``, PRDC's fields), an FD's ``<name>_bootstrap``
    ``[low, high]`` and ``<name>_infinity`` where asked for, and the image count of each set."""
    out: dict[str, Any] = {}
    for name in metrics:
        value = found.numbers[name]
        if isinstance(value, PRDC):
            out[name] = {field: float(number) for field, number in value._asdict().items()}
        elif isinstance(value, tuple):
            out[name] = {"mean": float(value[0]), "std": float(value[1])}
        else:
            out[name] = float(value)
        found_size = sizes.get(name, SampleSize(None, None))
        if found_size.bootstrap is not None:
            out[f"{name}_bootstrap"] = list(found_size.bootstrap)
        if found_size.infinity is not None:
            out[f"{name}_infinity"] = found_size.infinity
    counts = (next(iter(side.values())).count for side in (found.real, found.fake))
    out["images"] = dict(zip(("real", "fake"), counts))
    return out
