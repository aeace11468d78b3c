"""Joining the statistics of the shards of an image set (``shard=(i, n)``: one job each, nothing shared) into the
statistics of the whole set.

``merge_statistics`` checks the parts (each a shard of one set, computed alike, together covering the set once)
and merges them in row order with Chan et al.'s pairwise update, as torchrun's ranks are merged: count exact, mean
and covariance equal to one process's to float64 rounding. The vectors kept for KID become a uniform sample of the
whole set (``FeatureStatistics.merge``), not the rows one process keeps.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from .._stream.sharding import check_cover
from ..errors import InvalidTypeError, InvalidValueError
from .statistics import FeatureStatistics

__all__ = ["merge_statistics"]

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
            missing: a job killed or still running writes no file).
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
    if isinstance(parts, (str, os.PathLike, FeatureStatistics)):
        raise InvalidTypeError("parts must be a list of statistics files or FeatureStatistics, not one of them")
    if not parts:
        raise InvalidValueError("no parts given: pass the statistics of every shard")
    named = dict(_read(part, number) for number, part in enumerate(parts))
    if len(named) < len(parts):
        raise InvalidValueError("a statistics file is given twice: pass each shard once")
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


def _read(part: str | os.PathLike[str] | FeatureStatistics, number: int) -> tuple[str, FeatureStatistics]:
    """A part and the name errors call it by: its path, or ``parts[<number>]``."""
    if isinstance(part, FeatureStatistics):
        return f"parts[{number}]", part
    if not isinstance(part, (str, os.PathLike)):
        raise InvalidTypeError(
            f"parts[{number}] is a {type(part).__name__}, not a statistics file or FeatureStatistics"
        )
    return os.fspath(part), FeatureStatistics.load(part)


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
