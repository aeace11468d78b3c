"""The ``featurehooks`` command: ``extract`` (dump features), ``layers`` (list taps), ``show`` (feature-map grid).

Exit status: 0 success, 1 the run failed (I/O error, another rank), 2 bad input (unknown backbone
or layer, missing images, unusable weights, an existing output without ``--resume``/``--overwrite``),
130 interrupted (finish with ``--resume``), 141 output pipe closed (``featurehooks layers vgg16 | head``).
Errors print one line. Only featurehooks' own errors (``FeatureHooksError``) and command-line
mistakes count as bad input; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import FeatureHooksError, RunFailedError, first_line
from .layers import list_layers

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class UserError(Exception):
    """A mistake in the command line, reported in one line."""


def _layers(args: argparse.Namespace) -> int:
    rows = list_layers(args.backbone, weights=args.weights, input_size=args.input_size)
    header = ("name", "alias", "path", "type", "layout", "channels", "stride", "calls")
    table = [header] + [
        (
            r.name,
            r.alias or "-",
            r.path,
            r.type,
            (r.layout or "-") + (f"+{r.prefix_tokens}" if r.prefix_tokens else ""),
            str(r.channels or "-"),
            str(r.stride or "-"),
            str(r.calls),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _weights(text: str) -> str | None:
    return None if text.lower() in ("none", "random") else text


def _integer(minimum: int, allow_none: bool = False) -> Callable[[str], int | None]:
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


_size = _integer(1, allow_none=True)
_positive = _integer(1)
_non_negative = _integer(0)


def _device(name: str) -> Any:
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


def _local_cuda() -> Any:
    """This process's GPU: under torchrun each rank takes its own (LOCAL_RANK), not all of them GPU 0."""
    import torch

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _check_usable(device: Any, name: str) -> None:
    """Allocate an empty tensor on ``device``: a backend this torch lacks (mps, xla, xpu, ...) fails here."""
    import torch

    try:
        torch.empty(0, device=device)
    except Exception as exc:  # noqa: BLE001 - backends fail in their own ways: RuntimeError, AssertionError, ...
        raise UserError(f"--device {name} cannot be used here ({first_line(exc)}); use --device cpu") from None


def _extractor(args: argparse.Namespace, output_format: str) -> Any:
    import torch

    from .extractor import FeatureExtractor

    device = _device(args.device)  # a bad --device fails before the model is built
    weights = _weights(args.weights)
    if weights is None:
        torch.manual_seed(args.seed)  # random init, identical on every rank and every run
    extractor = FeatureExtractor(
        args.backbone, args.layers, weights=weights, mode="detach", output_format=output_format
    )
    return extractor.to(device)


def _sizes(args: argparse.Namespace) -> dict[str, Any]:
    sizes: dict[str, Any] = {}
    if args.resize is not ...:
        sizes["resize_size"] = args.resize
    if args.crop is not ...:
        sizes["crop_size"] = args.crop
    return sizes


def _extract(args: argparse.Namespace) -> int:
    from .dump import list_images

    sources = list_images(args.sources)  # fail on a missing input before building the model
    result = _dump(_extractor(args, args.output_format), sources, args)
    if int(os.environ.get("RANK", "0")) == 0:
        manifest = result.manifest
        shapes = ", ".join(f"{name} {tuple(shape)}" for name, shape in manifest["shapes"].items())
        skipped = len(manifest["skipped"])
        note = f"; {skipped} unreadable input(s) zero-filled, see manifest.json" if skipped else ""
        done = f"wrote {manifest['num_rows']} rows to" if result.rows_computed else "already complete:"
        print(f"{done} {result.out_dir}: {shapes} {manifest['dtype']}{note}")
    return 0


def _dump(extractor: Any, sources: list[str], args: argparse.Namespace) -> Any:
    """``dump_features`` with the command's options; an output that needs --resume/--overwrite is a UserError."""
    from .dump import dump_features

    try:
        return dump_features(
            extractor,
            sources,
            args.out,
            batch_size=args.batch_size,
            num_workers=args.workers,
            pool=args.pool,
            dtype=args.dtype,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.quiet,
            **_sizes(args),
        )
    except FileExistsError as exc:
        raise UserError(str(exc)) from None


def _show(args: argparse.Namespace) -> int:
    import torch

    from .images import prepare_image, read_image
    from .viz import save_feature_grid

    try:  # before the model is built, like extract
        picture = read_image(args.image)
    except FileNotFoundError:
        raise UserError(f"no such image: {args.image}") from None
    except Exception as exc:  # Pillow's errors for unreadable files vary
        raise UserError(f"cannot read image {args.image}: {exc}") from None
    extractor = _extractor(args, "nchw")  # token and channels-last layers drawn as maps
    image = prepare_image(picture, extractor, **_sizes(args))
    with torch.no_grad():
        features = extractor(image)
    _check_drawable(features, args.backbone)
    path = save_feature_grid(
        args.out, features, image, channels=args.channels, tile_size=args.tile_size, input_range=extractor.input_range
    )
    print(f"wrote {path} ({', '.join(features)}; {args.channels} most active channels each)")
    return 0


def _check_drawable(features: dict[str, Any], backbone: str) -> None:
    """Refuse layers whose outputs are no maps (B, C, H, W) or tokens (B, N, C), such as a classifier's (B, C)."""
    for name, value in features.items():
        if not hasattr(value, "dim") or value.dim() not in (3, 4):
            shape = tuple(value.shape) if hasattr(value, "shape") else type(value).__name__
            raise UserError(
                f"layer {name!r} has shape {shape}, not a feature map (B, C, H, W); pick a convolutional layer "
                f"(see `featurehooks layers {backbone}`)"
            )


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backbone", required=True, help="torchvision model name (vgg16, resnet50, ...) or timm/<name>"
    )
    parser.add_argument(
        "--layers",
        required=True,
        nargs="+",
        metavar="LAYER",
        help="layer names or module paths (see `featurehooks layers`)",
    )
    parser.add_argument(
        "--weights",
        default="DEFAULT",
        help="DEFAULT, a weights name (IMAGENET1K_V1), a local .pth/.safetensors file, "
        "or 'none' for seeded random init (default: DEFAULT)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init with --weights none (default: 0)")
    parser.add_argument(
        "--resize",
        type=_size,
        default=...,
        metavar="N",
        help="shorter-side resize, or 'none' (default: from the weights)",
    )
    parser.add_argument(
        "--crop", type=_size, default=..., metavar="N", help="center crop, or 'none' (default: from the weights)"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")


_EXTRACT_EPILOG = """\
examples:
  featurehooks extract images/ --backbone vgg16 --layers relu3_3 relu4_3 --out feats/
  featurehooks extract 'data/**/*.jpg' --backbone resnet50 --layers layer4 --pool avg --dtype float16 --out feats/
  torchrun --nproc-per-node 4 -m featurehooks extract images/ --backbone resnet50 --layers layer4 --out feats/

writes <layer>.npy (rows x feature shape), index.csv (row,valid,path) and manifest.json to --out.
Unreadable images keep their row, zero-filled, with valid=0 and a reason in manifest.json.
An interrupted run is finished with --resume; a complete output is replaced only with --overwrite.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``featurehooks`` command."""
    parser = argparse.ArgumentParser(
        prog="featurehooks",
        description="Named intermediate features from frozen pretrained vision backbones.",
        epilog="exit status: 0 ok, 1 failed, 2 bad input, 130 interrupted (rerun with --resume)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    extract = commands.add_parser(
        "extract",
        help="dump features of image files to <layer>.npy + manifest.json (resumable, torchrun-aware)",
        description="Extract features of every image in SRC and write them to --out, one .npy per layer.",
        epilog=_EXTRACT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    extract.add_argument("sources", nargs="+", metavar="SRC", help="image folders (recursive), files or glob patterns")
    extract.add_argument("--out", required=True, metavar="DIR", help="output folder")
    _model_options(extract)
    extract.add_argument("--batch-size", type=_positive, default=64, metavar="N", help="images per batch (default: 64)")
    extract.add_argument(
        "--workers", type=_non_negative, default=None, metavar="N", help="decoding processes (default: up to 4)"
    )
    extract.add_argument(
        "--pool",
        choices=("avg", "max", "cls"),
        default=None,
        help="avg/max over each layer's positions (patch tokens, never class tokens), or the class token (cls) "
        "of token layers (default: keep maps)",
    )
    extract.add_argument(
        "--output-format",
        choices=("native", "nchw"),
        default="native",
        help="native: module outputs as they are; nchw: token (ViT) and channels-last (Swin) outputs as "
        "(B, C, H, W) maps without prefix tokens (default: native)",
    )
    extract.add_argument("--dtype", choices=("float16", "float32"), default="float32", help="on-disk dtype")
    mode = extract.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="finish an interrupted dump in DIR")
    mode.add_argument("--overwrite", action="store_true", help="replace the dump in DIR")
    extract.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    extract.set_defaults(run=_extract)

    layers = commands.add_parser(
        "layers", help="list a backbone's layer calls: name, alias, path, type, layout, channels, stride, calls"
    )
    layers.add_argument("backbone", help="torchvision model name (vgg16, resnet50, ...) or timm/<name>")
    layers.add_argument(
        "--weights", type=_weights, default="DEFAULT", help="weights whose architecture to list (SWAG ViTs differ)"
    )
    layers.add_argument(
        "--input-size", type=_positive, default=None, metavar="N", help="spatial size used to derive strides"
    )
    layers.set_defaults(run=_layers)

    show = commands.add_parser(
        "show",
        help="save a PNG grid of each layer's most active feature maps for one image",
        description="Draw, for each layer, the input image and its most active channels (viridis, min-max scaled).",
        epilog="example:\n  featurehooks show cat.jpg --backbone vgg16 --layers relu2_2 relu3_3 relu4_3 --out grid.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("image", metavar="IMAGE", help="an image file")
    show.add_argument("--out", required=True, metavar="PNG", help="where to write the picture")
    _model_options(show)
    show.add_argument("--channels", type=_positive, default=8, metavar="K", help="maps per layer (default: 8)")
    show.add_argument(
        "--tile-size", type=_integer(8), default=96, metavar="PX", help="tile side in pixels (default: 96)"
    )
    show.set_defaults(run=_show)
    return parser


def _error(message: object) -> None:
    text = str(message).strip().splitlines()
    print(f"featurehooks: error: {text[0] if text else type(message).__name__}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; bad input prints one line on stderr and exits 2, a failed run exits 1.

    Only featurehooks' own errors and command-line mistakes are reported this way: any other
    exception is a bug in featurehooks, and keeps its traceback (exit status 1).
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except RunFailedError as exc:
        _error(exc)
        return EXIT_FAILED
    except (UserError, FeatureHooksError) as exc:
        _error(exc)
        return EXIT_USAGE
    except BrokenPipeError:
        # `featurehooks layers vgg16 | head`: stop quietly, and keep Python from failing on the final flush
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("featurehooks: interrupted; rerun with --resume to finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:  # disk full, permissions, a vanished file: the run failed, not the input
        _error(exc)
        return EXIT_FAILED
