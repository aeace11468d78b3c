"""The options every streaming entry point takes, with their one set of defaults and their one check."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal, TypedDict

from ..errors import InvalidTypeError, InvalidValueError, did_you_mean
from ..images import FROM_WEIGHTS, checked_size

__all__ = ["StreamOptions", "Streaming"]


class StreamOptions(TypedDict, total=False):
    """How images stream through a model: the keyword options of ``dump_features``, ``feature_statistics``,
    ``feature_statistics_by_layer``, ``fid_statistics`` and ``score_pairs``, with one set of defaults.

    Keys (all optional):
        batch_size: images per forward (pairs for ``score_pairs``); a dump's unit of commit and resume.
            Default: 64.
        num_workers: DataLoader processes that decode while the model runs; 0 decodes in this process.
            Default: ``None``, up to 4 (of the CPUs this process may use: one per 4 when the model runs on
            them, one less than their number on a GPU; at most one per batch).
        batch_pixels: pixels per forward, at most: height × width summed over a batch's images once prepared;
            a batch is cut where the next image would go over it (an image larger than it goes alone), which
            leaves the rows of a per-sample model as they are. ``None`` for no limit. Default: ``2**24``
            (64 images of 512 × 512).
        resize_size: resize of image files, the shorter side to this size; ``"weights"`` for the weights'
            own (none for a model without preprocessing, such as ``LPIPS``), ``None`` for none. Default:
            ``"weights"``.
        crop_size: center crop of image files to this square, after the resize; ``"weights"`` or ``None``
            as for ``resize_size``. Default: ``"weights"``.
        progress: a tqdm bar on stderr. Default: ``False`` (the command line shows one unless ``-q``).
        shard: ``(i, n)``: compute only shard ``i`` of ``n`` (``0 <= i < n``), the ``i``-th of ``n`` contiguous runs of
            whole batches of the sorted inputs (the rows torchrun's rank ``i`` of ``n`` takes), into a part of its
            own: a dump of those rows, or statistics of them, that records which shard of which input set it holds;
            ``featurehooks.dump.merge_dumps`` and ``featurehooks.metrics.merge_statistics`` join the parts of all
            ``n`` shards into what one run gives. For jobs that share no filesystem (job arrays), on the entry points
            that collect one set (dumps, statistics). Default: ``None``, every row.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor, StreamOptions, feature_statistics
        >>> options: StreamOptions = {"batch_size": 4, "num_workers": 0}
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> feature_statistics(ext, torch.rand(8, 3, 64, 64), **options).count
        8
    """

    batch_size: int
    num_workers: int | None
    resize_size: int | Literal["weights"] | None
    crop_size: int | Literal["weights"] | None
    progress: bool
    batch_pixels: int | None
    shard: tuple[int, int] | None


@dataclass(frozen=True)
class Streaming:
    """``StreamOptions`` checked, with the defaults filled in (built before any image is read)."""

    batch_size: int = 64
    num_workers: int | None = None
    resize_size: int | str | None = FROM_WEIGHTS
    crop_size: int | str | None = FROM_WEIGHTS
    progress: bool = False
    batch_pixels: int | None = 2**24
    shard: tuple[int, int] | None = None

    @classmethod
    def of(cls, options: Mapping[str, object]) -> Streaming:
        """The options a caller passed as keywords; an unknown name is refused with the closest known one."""
        known = [field.name for field in fields(cls)]
        for name in options:
            if name not in known:
                hint = did_you_mean(name, known)
                listed = f"unexpected option {name!r} (the streaming options are {', '.join(known)})"
                raise InvalidTypeError(listed + (f"; {hint}" if hint else ""))
        return cls(**options)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        if _not_int(self.batch_size) or self.batch_size < 1:
            raise InvalidValueError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.num_workers is not None and (_not_int(self.num_workers) or self.num_workers < 0):
            raise InvalidValueError(f"num_workers must be an int >= 0 or None, got {self.num_workers!r}")
        if self.batch_pixels is not None and (_not_int(self.batch_pixels) or self.batch_pixels < 1):
            raise InvalidValueError(f"batch_pixels must be a positive int or None, got {self.batch_pixels!r}")
        for name in ("resize_size", "crop_size"):
            if getattr(self, name) != FROM_WEIGHTS:
                checked_size(name, getattr(self, name))
        if not isinstance(self.progress, bool):
            raise InvalidTypeError(f"progress must be True or False, got {self.progress!r}")
        if self.shard is not None:
            object.__setattr__(self, "shard", _checked_shard(self.shard))


def _checked_shard(shard: object) -> tuple[int, int]:
    """``shard`` as an ``(i, n)`` tuple, refused unless two ints with ``0 <= i < n``."""
    if not isinstance(shard, (tuple, list)) or len(shard) != 2 or any(_not_int(value) for value in shard):
        raise InvalidTypeError(f"shard must be (i, n), two ints: shard i of n jobs; got {shard!r}")
    index, count = shard
    if not 0 <= index < count:
        raise InvalidValueError(f"shard must be (i, n) with 0 <= i < n (shard i of n jobs), got ({index}, {count})")
    return index, count


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)
