"""Joining the statistics of the shards of an image set (``shard=(i, n)``: one job each, nothing shared) into the
statistics of the whole set.

``merge_statistics`` checks the parts (each a shard of one set, computed alike, together covering the set once)
and merges them in row order with Chan et al.'s pairwise update, as torchrun's ranks are merged: count exact, mean
and covariance equal to one process's to float64 rounding. The vectors kept for KID become a uniform sample of the
whole set (``FeatureStatistics.merge``), not the rows one process keeps; parts that kept every vector (``evaluate``'s,
for CMMD, IS, KID and PRDC) give every vector of the set, in row order, as one process keeps them.
``merge_statistics_sets`` does the same for each named statistics of the parts of a set (``evaluate(real, None,
shard=(i, n))``, ``featurehooks eval --save-stats --shard I/N``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, TypeVar, Union

from .._stream.sharding import check_cover
from ..errors import InvalidTypeError, InvalidValueError
from ._npz import read_npz
from .statistics import FORMAT, SET_FORMAT, FeatureStatistics, load_statistics

__all__ = ["holds_statistics_set", "merge_statistics", "merge_statistics_sets"]

StatisticsFile = Union[str, "os.PathLike[str]"]
P = TypeVar("P")  # a part as given
T = TypeVar("T")  # a part as read

_AGREE = "the parts of one merge come from one command with one --shard i/N each"


def merge_statistics(parts: Sequence[str | os.PathLike[str] | FeatureStatistics]) -> FeatureStatistics:
    """The statistics of a whole image set from those of its shards (``feature_statistics(..., shard=(i, n))``,
    ``featurehooks stats --shard i/N``), given as files or ``FeatureStatistics`` in any order (never changed).

    Returns:
        ``FeatureStatistics`` of every row of the set, with no shard: what one run computes (its vectors kept for
        KID a uniform sample of the set, at most the parts' ``keep``); ``.save`` writes it.

    Raises:
        InvalidValueError: naming the parts, one that is not a shard, parts of another input set, parts computed
            otherwise (backbone, layer, pool, weights and their hash, preprocessing, precision, lineage, dimension,
            vectors kept), two parts of one shard, parts whose rows overlap, or rows no part holds (the shards
            missing: a job killed or still running writes no file), or a file of a statistics set (which
            ``merge_statistics_sets`` merges).
        InputNotFoundError: a file does not exist.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics, merge_statistics
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()), ["1"])
        >>> images = torch.rand(10, 3, 8, 8)
        >>> parts = [feature_statistics(ext, images, pool=None, batch_size=2, shard=(i, 3)) for i in range(3)]
        >>> [part.count for part in parts], str(parts[1].shard)
        ([4, 4, 2], 'shard 1/3 (rows 4:8 of 10)')
        >>> merged, whole = merge_statistics(parts), feature_statistics(ext, images, pool=None, batch_size=2)
        >>> merged.count, merged.shard, torch.allclose(merged.covariance, whole.covariance, rtol=1e-12, atol=0)
        (10, None, True)
    """
    one = (str, os.PathLike, FeatureStatistics)
    return _merged(_named_parts(parts, one, _read, "statistics files or FeatureStatistics", "statistics"))


def merge_statistics_sets(
    parts: Sequence[StatisticsFile | Mapping[str, FeatureStatistics]],
) -> dict[str, FeatureStatistics]:
    """The statistics set of a whole image set from those of its shards (``evaluate(real, None, shard=(i, n)).real``,
    ``featurehooks eval --save-stats REAL PART.npz --shard I/N``), given as files or mappings in any order (never
    changed): each named statistics merged as ``merge_statistics`` merges single ones.

    Returns:
        ``{name: FeatureStatistics}`` of every row of the set, with no shard, in the first part's order: what one run
        computes (the vectors kept for CMMD, IS, KID and PRDC every vector, in row order); ``save_statistics`` writes
        it, and ``evaluate`` takes it as ``real``.

    Raises:
        InvalidValueError: as ``merge_statistics``, each part named with its member (``real-1.npz['dinov2']``), and
            parts that hold other names (computed for other metrics).
        InputNotFoundError: a file does not exist.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics_by_layer, merge_statistics_sets
        >>> ext = FeatureExtractor(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 4)), ["0", "1"])
        >>> images = torch.rand(5, 3, 8, 8)
        >>> parts = [feature_statistics_by_layer(ext, images, pool=None, batch_size=2, shard=(i, 2)) for i in range(2)]
        >>> [(name, stats.count, stats.shard) for name, stats in merge_statistics_sets(parts).items()]
        [('0', 5, None), ('1', 5, None)]
    """
    sets = _named_parts(
        parts, (str, os.PathLike, Mapping), _read_set, "statistics-set files or mappings", "statistics set"
    )
    (first_name, first), *_ = sets.items()
    for name, members in sets.items():
        if set(members) != set(first):
            raise InvalidValueError(
                f"{name} holds the statistics of {', '.join(members)}, {first_name} of {', '.join(first)}; "
                f"{_AGREE} (and one --metrics)"
            )
    return {member: _merged({f"{name}[{member!r}]": held[member] for name, held in sets.items()}) for member in first}


def holds_statistics_set(path: StatisticsFile) -> bool:
    """Whether the featurehooks statistics file ``path`` holds a set of named statistics (``save_statistics``,
    ``eval --save-stats``) rather than one (``FeatureStatistics.save``); ``InvalidValueError`` for any other file."""
    _, meta = read_npz(path, "featurehooks statistics file", [], meta_format=(FORMAT, SET_FORMAT))
    return (meta or {}).get("format") == SET_FORMAT


def _named_parts(
    parts: Sequence[P], one: tuple[type, ...], read: Callable[[P, int], tuple[str, T]], kinds: str, what: str
) -> dict[str, T]:
    """The parts read (``read``) by the name errors call them, refusing a single part (an instance of ``one``), none,
    or one given twice; ``kinds`` and ``what`` name them in the errors."""
    if isinstance(parts, one):
        raise InvalidTypeError(f"parts must be a list of {kinds}, not one of them")
    if not parts:
        raise InvalidValueError(f"no parts given: pass the {what} of every shard")
    named = dict(read(part, number) for number, part in enumerate(parts))
    if len(named) < len(parts):
        raise InvalidValueError("a statistics file is given twice: pass each shard once")
    return named


def _merged(named: Mapping[str, FeatureStatistics]) -> FeatureStatistics:
    """The parts ``named`` (by what errors call them) checked and merged in row order."""
    first_name, first = next(iter(named.items()))
    for name, stats in named.items():
        _check_alike(first_name, first, name, stats)
    ordered = check_cover([(name, stats.shard) for name, stats in named.items()])  # type: ignore[misc]
    merged = copy.deepcopy(named[ordered[0][0]])
    merged.shard = None
    for name, _ in ordered[1:]:
        part = copy.copy(named[name])  # shallow: merge reads it, and only its shard is cleared
        part.shard = None
        merged.merge(part)
    return merged


def _read(part: StatisticsFile | FeatureStatistics, number: int) -> tuple[str, FeatureStatistics]:
    """A part and the name errors call it by: its path, or ``parts[<number>]``."""
    if isinstance(part, FeatureStatistics):
        return f"parts[{number}]", part
    if not isinstance(part, (str, os.PathLike)):
        raise InvalidTypeError(
            f"parts[{number}] is a {type(part).__name__}, not a statistics file or FeatureStatistics"
        )
    if holds_statistics_set(part):
        raise InvalidValueError(
            f"{os.fspath(part)} holds a set of named statistics (eval --save-stats, save_statistics), not one: "
            "merge_statistics_sets joins the parts of a set"
        )
    return os.fspath(part), FeatureStatistics.load(part)


def _read_set(
    part: StatisticsFile | Mapping[str, FeatureStatistics], number: int
) -> tuple[str, dict[str, FeatureStatistics]]:
    """A part of a statistics set and the name errors call it by: its path, or ``parts[<number>]``."""
    if isinstance(part, Mapping):
        for member, stats in part.items():
            if not isinstance(stats, FeatureStatistics):
                raise InvalidTypeError(
                    f"parts[{number}][{member!r}] is a {type(stats).__name__}, not FeatureStatistics"
                )
        if not part:
            raise InvalidValueError(f"parts[{number}] holds no statistics")
        return f"parts[{number}]", dict(part)
    if not isinstance(part, (str, os.PathLike)):
        raise InvalidTypeError(
            f"parts[{number}] is a {type(part).__name__}, not a statistics-set file or a mapping of FeatureStatistics"
        )
    if not holds_statistics_set(part):
        raise InvalidValueError(
            f"{os.fspath(part)} holds one statistics (stats, fid --save-stats, FeatureStatistics.save), not a set of "
            "named statistics: merge_statistics joins the parts of one"
        )
    return os.fspath(part), load_statistics(part)


def _check_alike(first_name: str, first: FeatureStatistics, name: str, stats: FeatureStatistics) -> None:
    """Refuse a part of another input set than the first, or computed otherwise."""
    if first.shard is None or stats.shard is None:
        raise InvalidValueError(
            f"{name if stats.shard is None else first_name} holds the statistics of a whole set, not of a shard: "
            "merge those of shard=(i, n) (--shard i/N)"
        )
    ours, theirs = first.shard, stats.shard
    if (ours.set_count, ours.set_sha256) != (theirs.set_count, theirs.set_sha256):
        raise InvalidValueError(
            f"{name} is a shard of another image set than {first_name} ({theirs.set_count} images vs "
            f"{ours.set_count}, sha256 of their names {theirs.set_sha256[:12]}... vs {ours.set_sha256[:12]}...); "
            f"{_AGREE}"
        )
    expected, found = _settings(first), _settings(stats)
    keys = {**expected, **found}
    differ = [
        f"{key} {found.get(key)!r} vs {expected.get(key)!r}" for key in keys if found.get(key) != expected.get(key)
    ]
    if differ:
        raise InvalidValueError(f"{name} was computed otherwise than {first_name} ({'; '.join(differ)}); {_AGREE}")


def _settings(stats: FeatureStatistics) -> dict[str, Any]:
    """What parts of one merge share: dimension, vectors kept, and every field of the origin (an unknown precision,
    as a file reads back float32's, taken for float32)."""
    origin: dict[str, Any] = asdict(stats.origin) if stats.origin is not None else {"origin": None}
    if origin.get("precision", "") is None:
        origin["precision"] = "float32"
    return {"dimension": stats.dim, "keep": stats.keep, **origin}
