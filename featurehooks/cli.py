"""The ``featurehooks`` command: ``layers`` lists a backbone's tappable layers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import FeatureHooksError
from .layers import list_layers


def _layers(args: argparse.Namespace) -> int:
    rows = list_layers(args.backbone, input_size=args.input_size)
    header = ("name", "alias", "path", "type", "channels", "stride")
    table = [header] + [
        (r.name, r.alias or "-", r.path, r.type, str(r.channels or "-"), str(r.stride or "-")) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``featurehooks`` command."""
    parser = argparse.ArgumentParser(
        prog="featurehooks", description="Named intermediate features from frozen pretrained vision backbones."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    layers = commands.add_parser("layers", help="list a backbone's layers: name, alias, path, type, channels, stride")
    layers.add_argument("backbone", help="torchvision model name (vgg16, resnet50, ...) or timm/<name>")
    layers.add_argument("--input-size", type=int, default=None, help="spatial size used to derive strides")
    layers.set_defaults(run=_layers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user mistakes print one line on stderr and exit with status 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except (FeatureHooksError, ImportError, ValueError, FileNotFoundError) as exc:
        print(f"featurehooks: error: {exc}", file=sys.stderr)
        return 2
