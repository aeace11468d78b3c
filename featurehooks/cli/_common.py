"""What the ``featurehooks`` subcommands share: the one-line UserError, argument types, model options, devices."""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import first_line

if TYPE_CHECKING:
    import torch

    from ..extractor import FeatureExtractor, OutputFormat
    from ..metrics import PRDC

__all__ = [
    "UserError",
    "add_command",
    "add_device_option",
    "add_model_options",
    "add_precision_option",
    "add_seed_option",
    "add_shard_option",
    "add_size_options",
    "add_stream_options",
    "add_weights_option",
    "at_least",
    "build_extractor",
    "check_output_file",
    "check_precision",
    "device_from",
    "non_negative",
    "positive",
    "shard_from",
    "size",
    "sizes",
    "stream_options",
    "weights_arg",
    "weights_from",
]


class UserError(Exception):
    """A mistake in the command line, reported in one line."""


# The library's hints name Python arguments; on the command line each is a flag. Exact phrases first
# (messages that already name both), then the general forms.
_PHRASES = (
    ("(resize_size=, crop_size=; --resize, --crop)", "(--resize, --crop)"),
    ("(pool='avg', --pool avg)", "(--pool avg)"),
    ("overwrite=True (--overwrite)", "--overwrite"),
    ("dump_features(..., resume=True)", "`featurehooks extract ... --resume`"),
    ("pool='avg' (or 'max', 'cls')", "--pool avg (or max, cls)"),
    ("(pool='avg', 'max' or 'cls')", "(--pool avg, max or cls)"),
    ("compute them with keep=N", "compute them with `featurehooks stats --keep N`"),
    ("(use a smaller k,", "(use a smaller --prdc-k,"),
    (
        "pass layers= naming the attention modules to capture (list_layers marks them)",
        "name attention modules in --layers (`featurehooks layers` marks them [attention])",
    ),
)
_FORMS = (
    (re.compile(r"\bweights=None\b"), "--weights none"),
    (re.compile(r"\bweights='([^']*)'"), r"--weights \1"),
    (re.compile(r"\bpool=None\b"), "--pool none"),
    (re.compile(r"\bpool='(\w+)'"), r"--pool \1"),
    (re.compile(r"\bresume=True\b"), "--resume"),
    (re.compile(r"\bprecision='(\w+)'"), r"--precision \1"),
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\bkeep=(\w+)"), r"--keep \1"),
    (re.compile(r"featurehooks\.list_layers\([^)]*\)"), "`featurehooks layers`"),
)


def cli_message(text: str) -> str:
    """A library error's message with its Python arguments (``weights=None``) as CLI flags (``--weights none``)."""
    for phrase, flags in _PHRASES:
        text = text.replace(phrase, flags)
    for pattern, flags in _FORMS:
        text = pattern.sub(flags, text)
    return text


def is_main_rank() -> bool:
    """Whether this process writes and prints: the only one, or rank 0 of a torchrun job (``RANK``)."""
    return int(os.environ.get("RANK", "0")) == 0


def weights_from(text: str) -> str | None:
    """``--weights``: a member name or file, or None for ``none``/``random`` (seeded random init)."""
    return None if text.lower() in ("none", "random") else text


def weights_arg(args: argparse.Namespace) -> str:
    """``add_model_options``' ``--weights`` as written, ``DEFAULT`` when not given (``...`` tells the two apart)."""
    return "DEFAULT" if args.weights is ... else args.weights


def at_least(minimum: int, allow_none: bool = False) -> Callable[[str], int | None]:
    """An argparse type for integers >= ``minimum`` (and ``none`` when ``allow_none``)."""
    expected = f"an integer >= {minimum}" + (" or 'none'" if allow_none else "")

    def parse(text: str) -> int | None:
        if allow_none and text.lower() == "none":
            return None
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


size = at_least(1, allow_none=True)
positive = at_least(1)
non_negative = at_least(0)


def device_from(name: str) -> torch.device:
    """The torch device for ``--device``: one this machine can compute on, else a UserError."""
    import torch

    if name == "auto":
        return _local_cuda() if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:1, ... or auto") from None
    if device.type == "meta":
        raise UserError("--device meta: meta tensors have shapes but no values, so there is nothing to extract")
    if device.type != "cuda":
        _check_usable(device, name)
        return device
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device if device.index is not None else _local_cuda()


def _local_cuda() -> torch.device:
    """This process's GPU: under torchrun each rank takes its own (LOCAL_RANK), not all of them GPU 0."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _check_usable(device: torch.device, name: str) -> None:
    """Allocate an empty tensor on ``device``: a backend this torch lacks (mps, xla, xpu, ...) fails here."""
    import torch

    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001 - backends fail in their own ways: RuntimeError, AssertionError, ...
        raise UserError(f"--device {name} cannot be used here ({first_line(exc)}); use --device cpu") from None


def build_extractor(args: argparse.Namespace, output_format: OutputFormat = "native") -> FeatureExtractor:
    """The FeatureExtractor that ``add_model_options``' arguments describe, on ``--device``, without a graph."""
    import torch

    from ..extractor import FeatureExtractor

    device = device_from(args.device)  # a bad --device fails before the model is built
    check_precision(args, device)
    weights = weights_from(weights_arg(args))
    if weights is None:
        torch.manual_seed(args.seed)  # random init, identical on every rank and every run
    extractor = FeatureExtractor(
        args.backbone,
        args.layers,
        weights=weights,
        mode="detach",
        output_format=output_format,
        memory_format=args.memory_format,
        precision=args.precision,
    )
    return extractor.to(device)


def check_precision(args: argparse.Namespace, device: torch.device) -> None:
    """Refuse a ``--precision`` that ``device`` cannot run before any model is built or image read (the library
    would refuse it at the first forward)."""
    from .._precision import check_device

    check_device(args.precision, device)


def add_precision_option(parser: argparse.ArgumentParser) -> None:
    """``--precision float32|bf16|fp16``: what the backbone computes in."""
    parser.add_argument(
        "--precision",
        choices=("float32", "bf16", "fp16"),
        default="float32",
        help="what the backbone computes in (default: float32); bf16 or fp16 run faster where the device has them "
        "(bf16 on CPUs with AVX512-BF16 or AMX and on recent GPUs, fp16 on GPUs), with values that differ from "
        "float32's",
    )


def check_output_file(path: str) -> None:
    """Refuse, before any compute (not after an hour of it), an output file that cannot be written.

    The file is written atomically (a temporary file in its folder, then renamed over ``path``), so
    what must hold is: the folder exists and may be written, and ``path`` is not a folder, a FIFO, a
    socket or a device (a rename would fail on a folder, or replace the special file).
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        problem = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UserError(f"cannot write {path}: the folder {folder} {problem}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: the folder {folder} is not writable")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise UserError(f"cannot write {path}: it is a folder; name a file in it")
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise UserError(f"cannot write {path}: it is not a regular file (a FIFO, socket or device); name a file")


def add_command(commands: Any, name: str, about: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand: ``about``'s first paragraph is its one-line help, the second its description; the epilog
    (examples, notes) keeps its line breaks."""
    summary, description = (" ".join(paragraph.split("\n")) for paragraph in about.strip().split("\n\n"))
    return commands.add_parser(
        name, help=summary, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_weights_option(parser: argparse.ArgumentParser, help: str, **how: Any) -> None:
    """``--weights`` (``how``: argparse's default, type or metavar where a command differs)."""
    parser.add_argument("--weights", help=help, **{"default": "DEFAULT", **how})


def add_seed_option(parser: argparse.ArgumentParser) -> None:
    """``--seed`` of the random init with ``--weights none``."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init with --weights none (default: 0)")


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--device``."""
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")


def add_size_options(parser: argparse.ArgumentParser, default: str = "from the weights") -> None:
    """``--resize`` and ``--crop``; not given, the library's default (``"weights"``), which ``default`` says."""
    parser.add_argument(
        "--resize", type=size, default=..., metavar="N", help=f"shorter-side resize, or 'none' (default: {default})"
    )
    parser.add_argument(
        "--crop", type=size, default=..., metavar="N", help=f"then center crop to N x N, or 'none' (default: {default})"
    )


def add_stream_options(parser: argparse.ArgumentParser, unit: str = "images", batch_pixels: int | None = None) -> None:
    """``--batch-size``, ``--workers``, ``--batch-pixels`` (default: ``batch_pixels``, else the library's) and
    ``-q``: the ``StreamOptions`` a command passes on (``stream_options``)."""
    from .._stream import Streaming

    parser.add_argument(
        "--batch-size",
        type=positive,
        default=Streaming.batch_size,
        metavar="N",
        help=f"{unit} per batch, at most (default: {Streaming.batch_size})",
    )
    parser.add_argument(
        "--workers",
        "--num-workers",
        dest="workers",
        type=non_negative,
        default=None,
        metavar="N",
        help="decoding processes (default: up to 4, from the CPUs this process may use)",
    )
    pixels = Streaming.batch_pixels if batch_pixels is None else batch_pixels
    parser.add_argument(
        "--batch-pixels",
        type=size,
        default=pixels,
        metavar="N",
        help=f"pixels per batch, at most: height x width summed over its {unit} once prepared; a larger "
        f"{unit.removesuffix('s')} goes alone; 'none' for no limit (default: {pixels})",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


_SLURM = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX")


def add_kid_subset_option(parser: argparse.ArgumentParser, unit: str) -> None:
    """``--kid-subset-size`` (``unit``: what a KID subset draws, images or feature vectors)."""
    parser.add_argument(
        "--kid-subset-size",
        type=at_least(2),
        default=1000,
        metavar="N",
        help=f"{unit} per KID subset; each set needs at least N (default: 1000)",
    )


def add_prdc_k_option(parser: argparse.ArgumentParser) -> None:
    """``--prdc-k``: the k of PRDC's k-nearest-neighbour radii."""
    parser.add_argument("--prdc-k", type=positive, default=5, metavar="K", help="PRDC's nearest neighbour (default: 5)")


def add_shard_option(parser: argparse.ArgumentParser, what: str = "dump") -> None:
    """``--shard I/N`` (or ``slurm``): the streaming option ``shard`` of a command that writes a part (``what``)."""
    parser.add_argument(
        "--shard",
        type=shard_from,
        default=None,
        metavar="I/N",
        help=f"compute only shard I of N (0 <= I < N: the whole batches torchrun's rank I of N would take) into a "
        f"{what} of its own, joined with the others by `featurehooks merge`; 'slurm' takes I and N from a job "
        "array's SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT",
    )


def shard_from(text: str, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``--shard``: ``I/N``, or ``slurm`` for a SLURM job array's task (its index from the array's lowest, of the
    array's count), which must be a range of consecutive indices (``--array=0-9``, not ``--array=0-9:2`` or
    ``1,4,7``)."""
    if text.lower() == "slurm":
        return _slurm_shard(os.environ if environ is None else environ)
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None or not int(match[1]) < int(match[2]):
        raise argparse.ArgumentTypeError(f"expected I/N with 0 <= I < N (shard I of N jobs) or 'slurm', got {text!r}")
    return int(match[1]), int(match[2])


def _slurm_shard(environ: Mapping[str, str]) -> tuple[int, int]:
    """The shard of this SLURM array task, from the variables SLURM sets for each task of a job array."""
    try:
        task, count, low, high = (int(environ[name]) if name in environ else None for name in _SLURM)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard slurm: {', '.join(_SLURM)} are not integers") from None
    if task is None or count is None:
        raise argparse.ArgumentTypeError(
            "--shard slurm: SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT are not set: run it as a task of a "
            "SLURM job array (sbatch --array=0-N), or pass --shard I/N"
        )
    low = 0 if low is None else low
    step = environ.get("SLURM_ARRAY_TASK_STEP", "1")
    if step != "1" or (high is not None and high - low + 1 != count) or not 0 <= task - low < count:
        raise argparse.ArgumentTypeError(
            f"--shard slurm: task {task} of an array of {count} whose indices are not one range of consecutive "
            f"numbers (min {low}, max {high}, step {step}); use --array=0-{count - 1}, or pass --shard I/N"
        )
    return task - low, count


def sizes(args: argparse.Namespace) -> dict[str, Any]:
    """``resize_size``/``crop_size`` keyword arguments for the sizes given on the command line (none given: the
    library's default)."""
    given = {"resize_size": getattr(args, "resize", ...), "crop_size": getattr(args, "crop", ...)}
    return {option: value for option, value in given.items() if value is not ...}


def stream_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``StreamOptions`` the command line gives: batch size, workers, pixel budget, progress, and sizes and
    the shard where given."""
    shard = getattr(args, "shard", None)
    return {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "batch_pixels": args.batch_pixels,
        "progress": not args.quiet,
        **sizes(args),
        **({"shard": shard} if shard is not None else {}),
    }


def add_model_options(parser: argparse.ArgumentParser, layers_optional: str | None = None) -> None:
    """--backbone, --layers, --weights, --seed, --resize, --crop, --device, --memory-format and --precision;
    ``layers_optional``: when --layers may be left out, what it then means (the command checks the rest)."""
    parser.add_argument(
        "--backbone", required=True, help="torchvision model name (vgg16, resnet50, ...) or timm/<name>"
    )
    parser.add_argument(
        "--layers",
        required=layers_optional is None,
        nargs="+",
        metavar="LAYER",
        help="layer names or module paths (see `featurehooks layers`)"
        + (f"; {layers_optional}" if layers_optional else ""),
    )
    add_weights_option(
        parser,
        "DEFAULT, a weights name (IMAGENET1K_V1), a local .pth/.safetensors file, "
        "or 'none' for seeded random init (default: DEFAULT)",
        default=...,  # not given: DEFAULT (see weights_arg); fd compares only weights that were given
    )
    add_seed_option(parser)
    add_size_options(parser)
    add_device_option(parser)
    parser.add_argument(
        "--memory-format",
        choices=("auto", "channels_last", "contiguous"),
        default="auto",
        help="the backbone's memory format (default: auto, channels_last for convolutional backbones on cpu/cuda "
        "and images large enough for it to pay, NCHW otherwise)",
    )
    add_precision_option(parser)


def print_warnings(caught: list[warnings.WarningMessage], prefix: str = "") -> None:
    """The library's warnings as one line each on stderr, not in Python's form; a repeated one once."""
    for message in dict.fromkeys(str(warning.message) for warning in caught):
        print(f"featurehooks: warning: {prefix}{message}", file=sys.stderr)


def prdc_text(found: PRDC, k: int) -> str:
    """Precision, recall, density and coverage as the commands print them."""
    return (
        f"precision {found.precision:.4f}, recall {found.recall:.4f}, density {found.density:.4f}, "
        f"coverage {found.coverage:.4f} (k={k})"
    )


def is_statistics_file(source: str) -> bool:
    """Whether a set is given as a statistics ``.npz`` (any case: ``.NPZ`` too) rather than images: one with a
    ``meta`` (featurehooks' files) or ``mu`` (pytorch-fid's, TTUR's, the ADM evaluator's reference batches), or one
    the readers will say is damaged. An ``.npz`` of images alone (ADM's samples, ``arr_0``) is a set of images."""
    if not (source.lower().endswith(".npz") and Path(source).is_file()):
        return False
    try:
        with zipfile.ZipFile(source) as archive:
            members = set(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return True  # the statistics reader says what is wrong with it
    return bool(members & {"meta.npy", "mu.npy"}) or not members
