"""The ``featurehooks`` command: ``extract`` (dump features), ``layers`` (list taps), ``show`` (feature-map grid, or
attention maps and their rollout with ``--attention``),
the metrics ``lpips``, ``fd`` and ``stats`` (see ``cli._metrics``), ``dists``, ``fid``, ``eval``, and ``merge`` (the
parts of sharded dumps and statistics, ``cli._merge``).

Exit status: 0 success, 1 the run failed (I/O error, another rank), 2 bad input (unknown backbone
or layer, missing images, unusable weights, an existing output without ``--resume``/``--overwrite``),
130 interrupted (finish with ``--resume``), 141 output pipe closed (``featurehooks layers vgg16 | head``).
Errors print one line; a dump that fails once started says in it to finish with ``--resume``. Only
featurehooks' own errors (``FeatureHooksError``) and command-line mistakes count as bad input; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FeatureHooksError, InvalidValueError, RunFailedError
from ..layers import list_layers
from ._cka import add_cka_command
from ._common import (
    UserError,
    add_command,
    add_model_options,
    add_shard_option,
    add_stream_options,
    add_weights_option,
    at_least,
    build_extractor,
    cli_message,
    is_main_rank,
    positive,
    sizes,
    stream_options,
    weights_arg,
    weights_from,
)
from ._dists import add_dists_command
from ._eval import add_eval_command
from ._fid import add_fid_command
from ._merge import add_merge_command
from ._metrics import add_metric_commands

if TYPE_CHECKING:
    from torch import Tensor, nn

    from ..dump import DumpResult
    from ..extractor import FeatureExtractor

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def _layers(args: argparse.Namespace) -> int:
    rows = list_layers(args.backbone, weights=args.weights, input_size=args.input_size)
    header = ("name", "alias", "path", "type", "layout", "channels", "stride", "calls")
    table = [header] + [
        (
            r.name,
            r.alias or "-",
            r.path,
            r.type + (" [attention]" if r.attention else ""),
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


def _extract(args: argparse.Namespace) -> int:
    from .._stream import list_images

    sources = list_images(args.sources)  # fail on a missing input before building the model
    _check_dump_folder(args.out)
    result = _dump(build_extractor(args, args.output_format), sources, args)
    if is_main_rank():
        settings = result.manifest.settings
        shapes = ", ".join(f"{name} {shape}" for name, shape in settings.shapes.items())
        skipped = len(result.skipped)
        note = f"; {skipped} unreadable input(s) zero-filled, see manifest.json" if skipped else ""
        done = f"wrote {result.num_rows} rows to" if result.rows_computed else "already complete:"
        part = f" ({settings.shard}; join the parts with `featurehooks merge`)" if settings.shard else ""
        print(f"{done} {result.out_dir}: {shapes} {settings.dtype}{note}{part}")
    return 0


def _check_dump_folder(out: str) -> None:
    """Refuse, before the model is built, an ``--out`` that is a file or lies under one: a dump is a folder."""
    from ..dump.store import check_dump_folder

    try:
        check_dump_folder(out)
    except InvalidValueError as exc:
        raise UserError(f"--out {exc}") from None


def _dump(extractor: FeatureExtractor, sources: list[str], args: argparse.Namespace) -> DumpResult:
    """``dump_features`` with the command's options; an output that needs --resume/--overwrite is a UserError, and
    an error once the dump has started says how to finish it (``_resume_hint``)."""
    from ..dump import dump_features

    before = _manifest_file(args.out)
    try:
        return dump_features(
            extractor,
            sources,
            args.out,
            pool=None if args.pool == "none" else args.pool,
            dtype=args.dtype,
            resume=args.resume,
            overwrite=args.overwrite,
            **stream_options(args),
        )
    except FileExistsError as exc:
        raise UserError(str(exc)) from None
    except Exception as exc:
        hint = _resume_hint(args.out, before, exc)
        if hint is None:
            raise
        if isinstance(exc, (RunFailedError, OSError)):
            raise RunFailedError(f"{_first_line(exc)}; {hint}") from exc
        if isinstance(exc, FeatureHooksError):
            raise UserError(f"{_first_line(exc)}; {hint}") from exc
        print(f"featurehooks: {hint}", file=sys.stderr)  # a bug keeps its traceback, and how to go on once fixed
        raise


def _manifest_file(out: str) -> tuple[int, int] | None:
    """Which ``manifest.json`` ``out`` holds now (inode and modification time), to tell whether a run wrote it."""
    try:
        found = os.stat(Path(out) / "manifest.json")
    except OSError:
        return None
    return found.st_ino, found.st_mtime_ns


def _resume_hint(out: str, before: tuple[int, int] | None, exc: Exception) -> str | None:
    """The hint to rerun with --resume, for an error once the dump in ``out`` has started; None for one before it.

    Started: the manifest says "running" and either this run wrote it, or (resuming an unfinished dump with
    the manifest as it was) the error is a failed run or a bug, which planning never raises.
    """
    from ..dump import DumpLockedError, Manifest

    if isinstance(exc, DumpLockedError) or "--resume" in cli_message(str(exc)):
        return None
    try:
        manifest = Manifest.read(Path(out) / "manifest.json")
    except FeatureHooksError:
        return None
    if manifest is None or manifest.status != "running":
        return None
    wrote = _manifest_file(out) != before
    if not wrote and isinstance(exc, FeatureHooksError) and not isinstance(exc, RunFailedError):
        return None
    return f"the dump in {out} is unfinished: rerun with --resume to finish it"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return cli_message(lines[0]) if lines else type(exc).__name__


def _show(args: argparse.Namespace) -> int:
    import torch

    from ..images import prepare_image
    from ..viz import save_feature_grid

    _check_show_flags(args)
    picture = _read_picture(args.image)  # before the model is built, like extract
    if args.attention:
        return _show_attention(args, picture)
    extractor = build_extractor(args, "nchw")  # token and channels-last layers drawn as maps
    image = prepare_image(picture, extractor, **sizes(args))
    with torch.no_grad():
        features = extractor(image)
    _check_drawable(features, extractor.output_layouts, args.backbone)
    path = save_feature_grid(args.out, features, image, channels=args.channels, **_drawing(args, extractor))
    print(f"wrote {path} ({', '.join(features)}; {args.channels} most active channels each)")
    return 0


def _check_show_flags(args: argparse.Namespace) -> None:
    """``--layers`` is required for feature maps, optional with ``--attention``; ``--heads``/``--rollout`` need it."""
    if not args.attention:
        if args.rollout or args.heads is not None:
            raise UserError(f"{'--rollout' if args.rollout else '--heads'} draws attention: add --attention")
        if not args.layers:
            raise UserError("--layers is required (or --attention, which draws the last attention module's maps)")


def _read_picture(path: str) -> Tensor:
    """The image ``show`` draws, as ``read_image`` gives it: a file, or a row of an archive (``samples.zip/0.png``,
    ``samples.npz/arr_0/3``); a missing or unreadable one is a UserError."""
    from .._stream import read_row

    try:
        return read_row(path)
    except FileNotFoundError:
        raise UserError(f"no such image: {path}") from None
    except Exception as exc:  # Pillow's errors for unreadable files vary
        raise UserError(f"cannot read image {path}: {exc}") from None


def _drawing(args: argparse.Namespace, extractor: FeatureExtractor) -> dict[str, Any]:
    """The keywords both pictures of ``show`` take: tile size, input range and caption."""
    return {
        "tile_size": args.tile_size,
        "input_range": extractor.input_range,
        "caption": _random_caption(args, extractor),
    }


def _random_caption(args: argparse.Namespace, extractor: FeatureExtractor) -> str | None:
    """A picture drawn with random weights says so in itself, wherever it ends up; trained weights draw no band."""
    if extractor.weights is not None:
        return None
    return f"RANDOM weights (seed {args.seed}): shows the mechanics, not what trained weights see"


def _show_attention(args: argparse.Namespace, picture: Tensor) -> int:
    """``show --attention``: per-head maps of the chosen attention modules over the image, and with ``--rollout``
    the rollout of every attention module, all from one forward."""
    import torch

    from .._layout import prefix_tokens_of
    from .._taps import call_name
    from ..attention import capture_attention
    from ..images import prepare_image
    from ..layers import select_modules
    from ..viz import attention_saliency, rollout_saliency, save_attention_grid

    listed = list_layers(args.backbone, weights=weights_from(weights_arg(args)))
    every = [row.name for row in listed if row.attention]
    if not every:
        raise UserError(
            f"--attention: {args.backbone} has no attention module whose maps featurehooks reads (ViT, DeiT, DINO, "
            f"Swin, nn.MultiheadAttention...; `featurehooks layers {args.backbone}` marks them [attention])"
        )
    chosen = args.layers or every[-1:]
    # the extractor prepares the image and holds the model; the model runs on its own, inside the capture
    extractor = build_extractor(argparse.Namespace(**{**vars(args), "layers": every[-1:]}))
    image = prepare_image(picture, extractor, **sizes(args))
    model = extractor.backbone
    prefix = prefix_tokens_of(model)
    if prefix is None:
        raise UserError(f"--attention: {args.backbone} does not say how many class or register tokens it has")
    with torch.no_grad(), capture_attention(model, [*chosen, *every] if args.rollout else chosen) as captured:
        model(extractor.normalize(image).to(extractor.compute_dtype))
    maps = dict(captured)
    grid = _patch_grid(maps, image, prefix, model)
    selection = select_modules(model, chosen, default=lambda _: every, what="draw the attention of")
    wanted = {call_name(path, k) for path in selection.paths for k in range(len(maps)) if selection.wants(path, k)}
    drawn = [name for name in maps if name in wanted]
    panels = {name: attention_saliency(maps[name], grid, prefix)[0, : args.heads] for name in drawn}
    if args.rollout:
        panels["rollout"] = rollout_saliency(maps, grid, prefix)[:1]  # the one image's, as one map
    path = save_attention_grid(args.out, panels, image, **_drawing(args, extractor))
    rollout = f"; the rollout of {len(maps)} attention modules" if args.rollout else ""
    print(f"wrote {path} (attention per head of {', '.join(drawn)}{rollout})")
    return 0


def _patch_grid(maps: dict[str, Tensor], image: Tensor, prefix: int, model: nn.Module) -> tuple[int, int]:
    """The ``(rows, columns)`` grid of the patch tokens the first map attends to. Maps of windows (Swin) are refused:
    they have no class token and no token that attends to the whole image, so no one map of the image."""
    from .._layout import patch_size_of, token_grid

    name, value = next(iter(maps.items()))
    height, width = image.shape[-2:]
    try:
        return token_grid(value.shape[-1] - prefix, (height, width), patch_size_of(model), name)
    except InvalidValueError:
        raise UserError(
            f"--attention: {name} attends to {value.shape[-1]} keys, not {prefix} prefix token(s) and the patches of "
            f"the {height}x{width} image: window attention (Swin) and spatial reduction (PVT, Twins) have no map of "
            "the whole image to draw; --attention draws ViT-like models (ViT, DeiT, DINO, EVA, BEiT)"
        ) from None


def _check_drawable(features: dict[str, Any], layouts: dict[str, Any], backbone: str) -> None:
    """Refuse outputs that are no maps once laid out: vectors (a classifier's (B, C)), attention internals, windows."""
    for name, value in features.items():
        if layouts[name].kind != "NCHW":
            shape = tuple(value.shape) if hasattr(value, "shape") else type(value).__name__
            raise UserError(
                f"layer {name!r} has shape {shape} ({layouts[name].kind}), not a feature map of the image; pick a "
                f"convolutional or token layer (see `featurehooks layers {backbone}`)"
            )


_EXTRACT_EPILOG = """\
examples:
  featurehooks extract images/ --backbone vgg16 --layers relu3_3 relu4_3 --out feats/
  featurehooks extract 'data/**/*.jpg' --backbone resnet50 --layers layer4 --pool avg --dtype float16 --out feats/
  torchrun --nproc-per-node 4 -m featurehooks extract images/ --backbone resnet50 --layers layer4 --out feats/
  featurehooks extract images/ --backbone resnet50 --layers layer4 --shard 0/3 --out part0/   # one job of 3, then:
  featurehooks merge feats/ part0/ part1/ part2/

writes <layer>.npy (rows x feature shape), index.csv (row,valid,path) and manifest.json to --out.
Unreadable images keep their row, zero-filled, with valid=0 and a reason in manifest.json.
An interrupted run is finished with --resume; a complete output is replaced only with --overwrite.
"""


_SHOW_EPILOG = """\
examples:
  featurehooks show cat.jpg --backbone vgg16 --layers relu2_2 relu3_3 relu4_3 --out grid.png
  featurehooks show cat.jpg --backbone timm/vit_small_patch16_224.dino --attention --rollout --out attention.png

--attention draws ViT-like models (a class token, or global attention over the patches); window attention (Swin)
is refused: it has no class token and no token that attends to the whole image.
"""


_EXTRACT_ABOUT = """\
dump features of image files to <layer>.npy + manifest.json (resumable, torchrun-aware)

Extract features of every image in SRC and write them to --out, one .npy per layer.
"""

_SHOW_ABOUT = """\
save a PNG grid of each layer's most active feature maps, or its attention maps, for one image

Draw, for each layer, the input image and its most active channels (viridis, min-max scaled); with --attention, the
class token's attention of each head over the image, and the attention rollout.
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``featurehooks`` command."""
    parser = argparse.ArgumentParser(
        prog="featurehooks",
        description="Named intermediate features from frozen pretrained vision backbones.",
        epilog="exit status: 0 ok, 1 failed, 2 bad input, 130 interrupted (rerun with --resume)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    extract = add_command(commands, "extract", _EXTRACT_ABOUT, _EXTRACT_EPILOG)
    extract.add_argument("sources", nargs="+", metavar="SRC", help="image folders (recursive), files or glob patterns")
    extract.add_argument("--out", required=True, metavar="DIR", help="output folder")
    add_model_options(extract)
    add_stream_options(extract)
    add_shard_option(extract)
    extract.add_argument(
        "--pool",
        choices=("avg", "max", "cls", "none"),
        default=None,
        help="avg/max over each layer's positions (patch tokens, never class tokens), or the class token (cls) "
        "of token layers; none (the default) keeps maps",
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
    extract.set_defaults(run=_extract)

    layers = commands.add_parser(
        "layers",
        help="list a backbone's layer calls: name, alias, path, type ([attention]: its maps can be drawn), layout, "
        "channels, stride, calls",
    )
    layers.add_argument("backbone", help="torchvision model name (vgg16, resnet50, ...) or timm/<name>")
    add_weights_option(layers, "weights whose architecture to list (SWAG ViTs differ)", type=weights_from)
    layers.add_argument(
        "--input-size", type=positive, default=None, metavar="N", help="spatial size used to derive strides"
    )
    layers.set_defaults(run=_layers)

    show = add_command(commands, "show", _SHOW_ABOUT, _SHOW_EPILOG)
    show.add_argument(
        "image", metavar="IMAGE", help="an image file, or a row of an archive (samples.zip/0.png, samples.npz/arr_0/3)"
    )
    show.add_argument("--out", required=True, metavar="PNG", help="where to write the picture")
    add_model_options(show, "with --attention, attention modules (default: the last one)")  # _check_show_flags
    show.add_argument("--channels", type=positive, default=8, metavar="K", help="maps per layer (default: 8)")
    show.add_argument(
        "--tile-size", type=at_least(8), default=96, metavar="PX", help="tile side in pixels (default: 96)"
    )
    show.add_argument(
        "--attention",
        action="store_true",
        help="draw attention maps instead: per head, the class token's attention over the patches (the mean each "
        "patch receives without a class token), of the --layers attention modules (default: the last one)",
    )
    show.add_argument(
        "--heads", type=positive, default=None, metavar="K", help="with --attention, the first K heads (default: all)"
    )
    show.add_argument(
        "--rollout", action="store_true", help="with --attention, also the rollout of every attention module"
    )
    show.set_defaults(run=_show)
    add_metric_commands(commands)
    add_dists_command(commands)
    add_fid_command(commands)
    add_eval_command(commands)
    add_merge_command(commands)
    add_cka_command(commands)
    return parser


def _error(message: object) -> None:
    text = str(message).strip().splitlines()
    if isinstance(message, FeatureHooksError):  # the library's hints name Python arguments: name the flags
        text = [cli_message(line) for line in text]
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
