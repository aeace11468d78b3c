"""``featurehooks cka A B``: linear CKA of every layer of dump A with every layer of dump B
(``featurehooks.metrics.cka.cka_matrix_from_dumps``), printed as a table and drawn as a heatmap with ``--out``."""

from __future__ import annotations

import argparse
import io
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .._atomic import write_atomic
from ..viz import add_caption, colorize
from ._common import add_command, at_least, check_output_file, print_warnings

__all__ = ["add_cka_command"]

_EPILOG = """\
examples:
  featurehooks extract images/ --backbone resnet50 --layers layer1 layer2 layer3 layer4 --pool avg --out a/
  featurehooks extract images/ --backbone resnet50 --weights tuned.pth --layers layer1 layer2 layer3 layer4 \\
      --pool avg --out b/
  featurehooks cka a/ b/ --out cka.png
  featurehooks cka a/ a/ --out self.png        # the layers of one model against each other

A and B are dump folders of `featurehooks extract` over the same images: rows are matched by the paths of
their index.csv, in any order; dumps whose paths differ (an image missing from one, or renamed) are
refused, naming them. Features are flattened per row (maps as they are, or pooled with --pool at extract).
CKA is linear, estimated over minibatches of --minibatch-size rows with the unbiased HSIC (Nguyen, Raghu,
Kornblith 2021), so memory holds two minibatches whatever the number of images. The table has A's layers
as rows and B's as columns; --out draws it (viridis, 0 to 1, the value in each cell).
"""

_CELL = 36  # pixels a side of a cell of the heatmap
_MARGIN = 4
_BAR = 12  # width of the colour bar
_NAN_GRAY = (128, 128, 128)


_CKA_ABOUT = """\
linear CKA of every layer of one dump with every layer of another, as a table and a heatmap

Layer x layer linear CKA (minibatch, unbiased HSIC) of dump A (rows) and dump B (columns) of the same images, their
rows matched by id.
"""


def add_cka_command(commands: Any) -> None:
    """Add ``cka`` to the ``featurehooks`` command's subparsers."""
    parser = add_command(commands, "cka", _CKA_ABOUT, _EPILOG)
    parser.add_argument("a", metavar="A", help="a dump folder (featurehooks extract): its layers are the rows")
    parser.add_argument("b", metavar="B", help="a dump folder of the same images: its layers are the columns")
    parser.add_argument("--out", metavar="PNG", default=None, help="draw the matrix as a heatmap to this file")
    parser.add_argument("--layers-a", nargs="+", metavar="LAYER", default=None, help="A's layers (default: all)")
    parser.add_argument("--layers-b", nargs="+", metavar="LAYER", default=None, help="B's layers (default: all)")
    parser.add_argument(
        "--minibatch-size",
        type=at_least(4),
        default=256,
        metavar="N",
        help="rows per minibatch of the estimator (default: 256, Nguyen et al.'s)",
    )
    parser.set_defaults(run=_cka)


def _cka(args: argparse.Namespace) -> int:
    from ..metrics.cka_sources import cka_matrix_from_dumps

    if args.out is not None:
        check_output_file(args.out)
    with warnings.catch_warnings(record=True) as caught:  # one line each on stderr, not Python's form
        warnings.simplefilter("always")
        try:
            matrix = cka_matrix_from_dumps(
                args.a, args.b, layers_a=args.layers_a, layers_b=args.layers_b, minibatch_size=args.minibatch_size
            )
        finally:
            print_warnings(caught)
    what = f"linear CKA of {matrix.count} images (minibatches of {matrix.minibatch_size}, unbiased HSIC)"
    print(f"{what}: rows A = {args.a}, columns B = {args.b}")
    print(_table(matrix.values, matrix.layers_a, matrix.layers_b))
    if args.out is not None:
        picture = add_caption(
            _heatmap(matrix.values, matrix.layers_a, matrix.layers_b),
            f"{what}\nA (rows): {args.a}\nB (columns): {args.b}",
        )
        path = Path(args.out)
        encoded = io.BytesIO()
        Image.fromarray(picture).save(encoded, format=Image.registered_extensions().get(path.suffix.lower(), "PNG"))
        write_atomic(path, encoded.getvalue())
        print(f"wrote {path}")
    return 0


def _table(values: np.ndarray, rows: Sequence[str], columns: Sequence[str]) -> str:
    """The matrix as aligned text: a header of ``columns``, then one line per row, four decimals a value."""
    cells = [["", *columns]] + [[row, *(f"{value:.4f}" for value in line)] for row, line in zip(rows, values)]
    widths = [max(len(line[column]) for line in cells) for column in range(len(cells[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths)).rstrip() for line in cells)


def _heatmap(values: np.ndarray, rows: Sequence[str], columns: Sequence[str]) -> np.ndarray:
    """An RGB ``uint8`` picture of ``values`` in [0, 1]: one viridis cell per value with the value written in it
    (NaN in gray), ``rows`` named on the left, ``columns`` written upwards above, a colour bar from 0 to 1 on the
    right."""
    font = ImageFont.load_default()
    left = int(max(font.getlength(name) for name in rows)) + 2 * _MARGIN
    top = int(max(font.getlength(name) for name in columns)) + 2 * _MARGIN
    height, width = len(rows) * _CELL, len(columns) * _CELL
    canvas = Image.new("RGB", (left + width + 3 * _MARGIN + _BAR + 24, top + height + _MARGIN), (255, 255, 255))
    pen = ImageDraw.Draw(canvas)
    colors = colorize(np.nan_to_num(np.clip(values, 0.0, 1.0), nan=0.0))
    for i, name in enumerate(rows):
        _write(pen, font, name, (_MARGIN, top + i * _CELL + _CELL // 2), (0, 0, 0))
        for j, value in enumerate(values[i]):
            corner = (left + j * _CELL, top + i * _CELL)
            fill = _NAN_GRAY if np.isnan(value) else tuple(int(c) for c in colors[i, j])
            pen.rectangle((corner, (corner[0] + _CELL - 1, corner[1] + _CELL - 1)), fill=fill)
            ink = (0, 0, 0) if not np.isnan(value) and value > 0.5 else (255, 255, 255)
            centre = (corner[0] + _CELL // 2, corner[1] + _CELL // 2)
            _write(pen, font, "nan" if np.isnan(value) else f"{value:.2f}", centre, ink, centred=True)
    for j, name in enumerate(columns):  # written across a strip, turned a quarter to read upwards
        strip = Image.new("RGB", (top, _CELL), (255, 255, 255))
        _write(ImageDraw.Draw(strip), font, name, (_MARGIN, _CELL // 2), (0, 0, 0))
        canvas.paste(strip.rotate(90, expand=True), (left + j * _CELL, 0))
    bar_left = left + width + 2 * _MARGIN
    ramp = colorize(np.linspace(1.0, 0.0, height)[:, None].repeat(_BAR, axis=1))
    canvas.paste(Image.fromarray(ramp), (bar_left, top))
    _write(pen, font, "1", (bar_left + _BAR + _MARGIN, top + _MARGIN), (0, 0, 0))
    _write(pen, font, "0", (bar_left + _BAR + _MARGIN, top + height - _MARGIN), (0, 0, 0))
    return np.asarray(canvas)


def _write(
    pen: ImageDraw.ImageDraw,
    font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
    text: str,
    at: tuple[int, int],
    ink: tuple[int, int, int],
    *,
    centred: bool = False,
) -> None:
    """``text`` with the middle of its box at height ``at[1]``, and its left end (or its middle) at ``at[0]``
    (measured from its box: Pillow's bitmap fonts take no anchor)."""
    box_left, box_top, box_right, box_bottom = font.getbbox(text)
    x = at[0] - (box_left + box_right) / 2 if centred else at[0] - box_left
    pen.text((x, at[1] - (box_top + box_bottom) / 2), text, fill=ink, font=font)
