"""Where ``MinibatchCKA``'s rows come from: two extractors over one stream of images (``cka_matrix``, each image
decoded once), or two finished dumps whose rows are matched by the ids of their ``index.csv``
(``cka_matrix_from_dumps``)."""

from __future__ import annotations

import csv
import os
import warnings
from collections import Counter
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor, nn
from typing_extensions import Unpack

from .._precision import check_device
from .._stream import (
    Progress,
    SourceSpec,
    Streaming,
    StreamOptions,
    extract_batches,
    inputs_digest,
    resolve_inputs,
    worker_deaths,
)
from ..dump import DumpResult
from ..errors import (
    CorruptDumpError,
    InvalidValueError,
    LayerNotFoundError,
    did_you_mean,
)
from ..images import from_input_range, to_input_range
from .collect import _output_names, finished_dump

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor

from .cka import MINIBATCH_SIZE, CKAMatrix, MinibatchCKA, _check_minibatch_size, _layer_list, _named

__all__ = ["cka_matrix", "cka_matrix_from_dumps"]


# -- two extractors over one stream of images ----------------------------------------------------------------------
class _Pair(nn.Module):
    """Both extractors on each batch (B's images mapped into its own ``input_range``), their outputs handed to child
    modules, where the taps of the extractor that streams the pair take them."""

    def __init__(
        self, a: FeatureExtractor, b: FeatureExtractor, layers_a: Sequence[str], layers_b: Sequence[str]
    ) -> None:
        super().__init__()
        self.a, self.b, self.layers_a, self.layers_b = a, b, list(layers_a), list(layers_b)
        self.outputs_a = nn.ModuleList(nn.Identity() for _ in layers_a)
        self.outputs_b = nn.ModuleList(nn.Identity() for _ in layers_b)

    def forward(self, images: Tensor) -> None:
        found_a = self.a(images.to(self.a.device))
        if self.b is self.a:
            found_b = found_a
        else:
            scaled = images if self.b.input_range == self.a.input_range else self._in_range_of_b(images)
            found_b = self.b(scaled.to(self.b.device))
        for tap, layer in zip(self.outputs_a, self.layers_a):
            tap(found_a[layer])
        for tap, layer in zip(self.outputs_b, self.layers_b):
            tap(found_b[layer])

    def _in_range_of_b(self, images: Tensor) -> Tensor:
        return to_input_range(from_input_range(images, self.a.input_range), self.b.input_range)


def _layers_of(extractor: FeatureExtractor, layers: Sequence[str] | None, side: str) -> tuple[str, ...]:
    """``layers`` (default: every output of the extractor), each an output of it."""
    available = _output_names(extractor)
    chosen = _layer_list(available if layers is None else layers, side)
    for layer in chosen:
        if layer not in available:
            raise LayerNotFoundError(
                f"extractor {side} returns no layer {layer!r} (it returns {available}); "
                + did_you_mean(layer, available)
            )
    return chosen


def cka_matrix(
    extractor_a: FeatureExtractor,
    extractor_b: FeatureExtractor,
    source: SourceSpec,
    *,
    layers_a: Sequence[str] | None = None,
    layers_b: Sequence[str] | None = None,
    minibatch_size: int = MINIBATCH_SIZE,
    **options: Unpack[StreamOptions],
) -> CKAMatrix:
    """Linear CKA of every layer of ``extractor_a`` with every layer of ``extractor_b`` over one stream of images.

    Each image is decoded once and both extractors see the same pixels: prepared as ``extractor_a``'s weights say
    (or as ``resize_size``/``crop_size`` say), each extractor normalizing them its own way (``extractor_b`` gets them
    mapped into its ``input_range``). Their features stream into a ``MinibatchCKA``, so memory holds a batch and a
    minibatch, whatever the number of images; the result equals ``cka_matrix_from_dumps`` of the two extractors'
    dumps of those images (same sizes, ``pool=None``). The same extractor twice runs once (its layers against each
    other). Images that cannot be read are left out, with a warning naming them. It runs in one process (under
    torchrun every rank would compute the whole matrix): dump each model's features, which torchrun shares out, and
    compare the dumps.

    Args:
        extractor_a: model A, its layers the matrix's rows.
        extractor_b: model B, its layers the columns (``extractor_a`` itself for a model's own layers).
        source: a folder, a glob, an image path, a list of these, a ``Dataset`` or an ``(N, C, H, W)`` tensor (as for
            ``dump_features``).
        layers_a: A's outputs to compare (default: all).
        layers_b: B's outputs to compare (default: all).
        minibatch_size: rows per minibatch of the estimator (see ``MinibatchCKA``).
        **options: the ``StreamOptions`` but ``shard`` (CKA takes every image): ``batch_size``, ``num_workers``,
            ``batch_pixels``, ``resize_size``, ``crop_size``, ``progress``.

    Returns:
        A ``CKAMatrix``: ``values[i, j]`` is CKA of ``layers_a[i]`` with ``layers_b[j]``.

    Raises:
        LayerNotFoundError: a layer the extractor does not return.
        InvalidValueError: bad options, ``shard``, images of several sizes without a crop, or fewer than 4 images.
        InputNotFoundError: ``source`` finds no inputs.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import cka_matrix
        >>> _ = torch.manual_seed(0)
        >>> ext = FeatureExtractor("resnet18", ["layer1", "layer2"], weights=None)
        >>> matrix = cka_matrix(ext, ext, torch.rand(16, 3, 32, 32), minibatch_size=8)
        >>> matrix.layers_a, matrix.values.round(6).diagonal().tolist()
        (('layer1', 'layer2'), [1.0, 1.0])
    """
    from ..extractor import FeatureExtractor

    streaming = Streaming.of(options)
    if streaming.shard is not None:
        raise InvalidValueError(
            "cka_matrix takes every image: shard= is for parts that a merge joins, which CKA has none of"
        )
    _check_minibatch_size(minibatch_size)
    chosen_a, chosen_b = _layers_of(extractor_a, layers_a, "A"), _layers_of(extractor_b, layers_b, "B")
    for extractor in (extractor_a, extractor_b):
        check_device(extractor.precision, extractor.device)
    inputs = resolve_inputs(extractor_a, source, streaming.resize_size, streaming.crop_size, None)
    pair = _Pair(extractor_a, extractor_b, chosen_a, chosen_b)
    taps_a = [f"outputs_a.{index}" for index in range(len(chosen_a))]
    taps_b = [f"outputs_b.{index}" for index in range(len(chosen_b))]
    passing = FeatureExtractor(pair, taps_a + taps_b, mode="detach", input_range=extractor_a.input_range)
    total, size = len(inputs.names), streaming.batch_size
    batches = [list(range(start, min(start + size, total))) for start in range(0, total, size)]
    accumulator = MinibatchCKA(chosen_a, chosen_b, minibatch_size=minibatch_size)
    skipped: list[str] = []
    with closing(passing), worker_deaths(), Progress(total, streaming.progress, label="CKA") as bar:
        found = extract_batches(passing, inputs, batches, pool=None, dtype="float32", streaming=streaming, progress=bar)
        with closing(found):
            for batch in found:
                skipped.extend(inputs.names[row] for row, _ in batch.skipped)
                valid = batch.valid
                if valid:
                    accumulator.update(
                        {layer: batch.arrays[tap][valid] for layer, tap in zip(chosen_a, taps_a)},
                        {layer: batch.arrays[tap][valid] for layer, tap in zip(chosen_b, taps_b)},
                    )
    if skipped:
        warnings.warn(
            f"{len(skipped)} of {total} inputs could not be read and are left out of CKA ({_named(skipped)})",
            stacklevel=2,
        )
    return accumulator.compute()


# -- two dumps --------------------------------------------------------------------------------------------------
def _index(result: DumpResult) -> tuple[list[str], set[int]]:
    """The ids of a dump's rows (``index.csv``'s paths, in row order) and its rows that could not be read."""
    path = result.out_dir / "index.csv"
    try:
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as handle:
            lines = list(csv.reader(handle))
    except (OSError, csv.Error) as exc:
        raise CorruptDumpError(f"{path} cannot be read ({exc})") from None
    if not lines or lines[0] != ["row", "valid", "path"] or any(len(line) != 3 for line in lines[1:]):
        raise CorruptDumpError(f"{path} is not a table of row,valid,path")
    names = [line[2] for line in lines[1:]]
    if len(names) != result.num_rows or inputs_digest(names) != result.manifest.settings.inputs.sha256:
        raise CorruptDumpError(f"{path}: its paths are not the rows that {result.out_dir / 'manifest.json'} names")
    return names, {row for row, line in enumerate(lines[1:]) if line[1] == "0"}


def _rows_of_b(names_a: list[str], names_b: list[str], dirs: tuple[Path, Path]) -> np.ndarray:
    """B's row of each of A's rows, matched by id; ids repeated in a dump, or in one dump only, refused by name."""
    for names, side, folder in ((names_a, "A", dirs[0]), (names_b, "B", dirs[1])):
        repeated = [name for name, times in Counter(names).items() if times > 1]
        if repeated:
            raise InvalidValueError(
                f"dump {side} in {folder} holds an image twice ({_named(repeated)}): rows cannot be matched by id"
            )
    row_of_b = {name: row for row, name in enumerate(names_b)}
    only_a = [name for name in names_a if name not in row_of_b]
    in_a = set(names_a)
    only_b = [name for name in names_b if name not in in_a]
    if only_a or only_b:
        parts = [f"{len(only_a)} of A not in B ({_named(only_a)})"] if only_a else []
        parts += [f"{len(only_b)} of B not in A ({_named(only_b)})"] if only_b else []
        raise InvalidValueError(
            f"dumps {dirs[0]} (A) and {dirs[1]} (B) hold other images, by the ids of their index.csv: "
            f"{' and '.join(parts)}; CKA compares the same images: dump both from the same files"
        )
    return np.array([row_of_b[name] for name in names_a], dtype=np.int64)


def _dump_layers(result: DumpResult, layers: Sequence[str] | None, side: str) -> tuple[str, ...]:
    available = list(result.manifest.files)
    chosen = _layer_list(available if layers is None else layers, side)
    for layer in chosen:
        if layer not in available:
            raise LayerNotFoundError(
                f"dump {side} in {result.out_dir} has no layer {layer!r}; {did_you_mean(layer, available)}"
            )
    return chosen


def cka_matrix_from_dumps(
    dump_a: str | os.PathLike[str] | DumpResult,
    dump_b: str | os.PathLike[str] | DumpResult,
    *,
    layers_a: Sequence[str] | None = None,
    layers_b: Sequence[str] | None = None,
    minibatch_size: int = MINIBATCH_SIZE,
) -> CKAMatrix:
    """Linear CKA of every layer of one finished dump with every layer of another, rows matched by image id.

    A row's id is its path in the dump's ``index.csv`` (``dataset[i]`` for a dataset or tensor). The two dumps must
    hold the same ids, in any order: B's rows are taken in A's order, and dumps whose ids differ (an image missing
    from one, or renamed) are refused, naming the ids, before anything is read. Rows either dump could not read are
    left out of both, with a warning. Rows stream in minibatches from the memory-mapped arrays (``MinibatchCKA``):
    memory holds two minibatches, whatever the number of images.

    Args:
        dump_a: dump A's folder or ``DumpResult``; its layers are the matrix's rows.
        dump_b: dump B's, its layers the columns.
        layers_a: A's layers to compare (default: all).
        layers_b: B's layers to compare (default: all).
        minibatch_size: rows per minibatch of the estimator.

    Returns:
        A ``CKAMatrix``; over A's row order, it equals ``cka_matrix`` of the two extractors over the same images.

    Raises:
        InputNotFoundError: no dump in a folder.
        LayerNotFoundError: a layer a dump does not hold.
        InvalidValueError: an unfinished dump, ids that differ or repeat, fewer than 4 images.
        CorruptDumpError: an ``index.csv`` that does not match its manifest.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> from featurehooks.metrics import cka_matrix_from_dumps
        >>> _ = torch.manual_seed(0)
        >>> ext = FeatureExtractor("resnet18", ["layer3", "layer4"], weights=None)
        >>> images, a, b = torch.rand(8, 3, 32, 32), tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> _ = dump_features(ext, images, a, progress=False)
        >>> _ = dump_features(ext, images, b, pool="avg", progress=False)
        >>> matrix = cka_matrix_from_dumps(a, b, minibatch_size=8)
        >>> matrix.values.shape, matrix.count
        ((2, 2), 8)
    """
    _check_minibatch_size(minibatch_size)
    a, b = finished_dump(dump_a, "dump A"), finished_dump(dump_b, "dump B")
    chosen_a, chosen_b = _dump_layers(a, layers_a, "A"), _dump_layers(b, layers_b, "B")
    (names_a, invalid_a), (names_b, invalid_b) = _index(a), _index(b)
    rows_of_b = _rows_of_b(names_a, names_b, (a.out_dir, b.out_dir))
    kept = np.array(
        [row for row in range(len(names_a)) if row not in invalid_a and rows_of_b[row] not in invalid_b], dtype=np.int64
    )
    if len(kept) < len(names_a):
        left_out = [names_a[row] for row in sorted(set(range(len(names_a))) - set(kept.tolist()))]
        warnings.warn(
            f"{len(left_out)} images that dump A or B could not read are left out of CKA ({_named(left_out)})",
            stacklevel=2,
        )
    arrays_a = {layer: a.load(layer) for layer in chosen_a}
    arrays_b = {layer: b.load(layer) for layer in chosen_b}
    accumulator = MinibatchCKA(chosen_a, chosen_b, minibatch_size=minibatch_size)
    for start in range(0, len(kept), minibatch_size):
        rows = kept[start : start + minibatch_size]
        accumulator.update(
            {layer: np.asarray(array[rows]) for layer, array in arrays_a.items()},
            {layer: np.asarray(array[rows_of_b[rows]]) for layer, array in arrays_b.items()},
        )
    return accumulator.compute()
