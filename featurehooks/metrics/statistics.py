"""Streaming statistics of feature vectors: count, mean and covariance in float64, and a bounded sample.

``FeatureStatistics`` is what a Fréchet distance needs (first and second moments) without keeping a
single feature vector: each batch is centered on its own mean and merged with Chan et al.'s pairwise
update, in float64, so a million images cost one ``(D, D)`` matrix and the result equals ``np.cov``
of all of them to rounding. The kernel inception distance needs feature vectors, not moments;
``keep=N`` keeps a uniform random sample of at most ``N`` of them (reservoir sampling, seeded).

Statistics are saved as ``.npz`` (read back with ``allow_pickle=False``) together with where their
features came from (backbone, layer, pool, weights), so comparing a reference set's statistics with
statistics of other features is an error rather than a meaningless number. The file also holds
``mu`` and ``sigma`` under the names pytorch-fid uses; ``_npz.py`` writes and reads the archive, as it does
manifolds'.

Statistics of images and of dumps are collected in ``collect.py``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from .._stream.sharding import Shard
from ..backbones._fid_resize import DEFAULT_LINEAGE, check_lineage
from ..backbones.fid_inception import FID_INCEPTION
from ..errors import InvalidTypeError, InvalidValueError
from ._npz import Check, Header, Mismatch, read_npz, write_npz

__all__ = [
    "FORMAT",
    "KEEP_ALL",
    "SET_FORMAT",
    "FeatureOrigin",
    "FeatureStatistics",
    "load_statistics",
    "save_statistics",
]

FORMAT = "featurehooks.statistics/1"
SET_FORMAT = "featurehooks.statistics-set/1"  # several named statistics in one file (save_statistics)
ArrayLike = Union[Tensor, np.ndarray]
_STRICT = (
    "backbone",
    "layer",
    "pool",
    "weights",
    "lineage",
)  # fields that must match for two statistics to be compared
_ARRAYS = ("mu", "sigma", "features")
_MAX_COUNT = 2**53  # counts beyond this are not exact in float64, and overflow the moment arithmetic
KEEP_ALL = _MAX_COUNT
"""A ``keep`` that keeps every vector, in input order: a sample that never fills (its rows grow as vectors come)."""


@dataclass(frozen=True)
class FeatureOrigin:
    """Where feature vectors came from: what must match for two sets of statistics to be compared.

    ``backbone``, ``layer``, ``pool`` (``None``: the layer returns vectors and was not pooled) and
    ``weights`` (the weights name, ``None`` for random init) must be equal; ``weights_sha256`` (a
    digest of the backbone's state dict) differing only warns, since the same weights in another
    dtype have other bytes; so does ``precision`` (what the backbone computed in; ``None`` in files written
    before it was recorded and in statistics merged from two precisions), named in the warning.
    ``preprocessing`` (resize, crop, interpolation) is kept for the record. ``lineage`` is the FID lineage of
    features of the ``"fid_inception"`` backbone (``"legacy_pytorch"``, ``"legacy_tensorflow"`` or ``"clean"``: the
    resize and scaling inside the network), ``None`` for other backbones; it must be equal too, and for
    ``"fid_inception"`` a missing one (a file written before lineages were recorded) is ``"legacy_pytorch"``.

    Examples:
        >>> from featurehooks.metrics import FeatureOrigin
        >>> ours = FeatureOrigin(backbone="resnet18", layer="layer4", pool="avg", weights="DEFAULT")
        >>> ours.check_matches(ours)  # the same features: comparable
        >>> ours.check_matches(FeatureOrigin("resnet18", "layer3", "avg", "DEFAULT"))
        Traceback (most recent call last):
        ...
        featurehooks.errors.InvalidValueError: the two statistics come from different features (layer ...): ...
    """

    backbone: str
    layer: str
    pool: str | None
    weights: str | None
    weights_sha256: str | None = None
    preprocessing: dict[str, Any] | None = field(default=None, hash=False)
    precision: str | None = None
    lineage: str | None = None

    def __post_init__(self) -> None:
        if self.lineage is not None:
            check_lineage(self.lineage)
        elif self.backbone == FID_INCEPTION:  # before lineages were recorded, FID statistics were pytorch-fid's
            object.__setattr__(self, "lineage", DEFAULT_LINEAGE)

    def check_matches(self, other: FeatureOrigin, what: str = "the two statistics") -> None:
        """Raise ``InvalidValueError`` naming each field in which ``other`` differs (warn for the digest)."""
        differences = [
            f"{name} {getattr(self, name)!r} vs {getattr(other, name)!r}"
            for name in _STRICT
            if getattr(self, name) != getattr(other, name)
        ]
        if differences:
            raise InvalidValueError(
                f"{what} come from different features ({'; '.join(differences)}): distances between them mean "
                "nothing; compute both with the same backbone, weights, layer, pool and FID lineage (mode)"
            )
        if self.precision and other.precision and self.precision != other.precision:
            warnings.warn(  # the digest differs too (another dtype): this says why
                f"{what} were computed in precision {self.precision!r} and {other.precision!r}: their features "
                "differ by the rounding of the lower precision (docs/performance.md#precision)",
                stacklevel=3,
            )
        elif self.weights_sha256 and other.weights_sha256 and self.weights_sha256 != other.weights_sha256:
            warnings.warn(
                f"{what} were computed with weights {self.weights!r} of different bytes (another checkpoint, "
                "seed or dtype): their features may not be comparable",
                stacklevel=3,
            )


def as_matrix(features: Any, name: str) -> Tensor:
    """``features`` as an ``(N, D)`` float64 CPU tensor, refused unless 2-D, real and finite."""
    if isinstance(features, np.ndarray):
        if not (np.issubdtype(features.dtype, np.floating) or np.issubdtype(features.dtype, np.integer)):
            raise InvalidTypeError(f"{name} must hold real numbers, got an array of {features.dtype}")
        matrix = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float64))  # also negative strides
    elif isinstance(features, Tensor):
        if features.is_complex() or features.dtype == torch.bool:
            raise InvalidTypeError(f"{name} must hold real numbers, got a tensor of {features.dtype}")
        matrix = features.detach().to(device="cpu", dtype=torch.float64)
    else:
        raise InvalidTypeError(f"{name} must be an (N, D) torch.Tensor or numpy array, not {type(features).__name__}")
    if matrix.dim() != 2:
        raise InvalidValueError(f"{name} must be (N, D) feature vectors, got shape {tuple(matrix.shape)}")
    if not bool(torch.isfinite(matrix).all()):
        bad = int((~torch.isfinite(matrix)).any(dim=1).sum())
        raise InvalidValueError(
            f"{name} holds NaN or infinite values in {bad} of {matrix.shape[0]} feature vectors "
            "(a diverged model, or fp16 overflow?)"
        )
    return matrix


def check_count(value: Any, name: str, least: int = 0) -> int:
    """``value`` as an int, refused unless an int (not a bool) of at least ``least``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise InvalidValueError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


class FeatureStatistics:
    """Running count, mean and covariance of feature vectors (float64), and optionally a sample of them.

    ``update`` takes batches of any float dtype on any device; they are accumulated on the CPU in
    float64: each batch is centered on its own mean and merged with the running moments by Chan et
    al.'s pairwise update, which stays accurate when features have a large common offset, where
    summing ``x`` and ``x²`` would cancel catastrophically. Memory is one ``(D, D)`` float64 matrix,
    whatever the number of vectors.

    With ``keep > 0``, a uniform random sample of at most ``keep`` vectors is also kept (reservoir
    sampling with a generator seeded by ``seed``, as float32: ``keep * D * 4`` bytes), for the kernel
    inception distance, which needs vectors rather than moments. The same seed and the same batch
    sizes keep the same rows, so statistics of several layers computed in one pass keep the features
    of the same images.

    Args:
        dim: the feature dimension ``D``; ``None`` takes it from the first batch.
        keep: how many feature vectors to keep, at most (0: none).
        seed: seed of the sampling generator.
        origin: where the features come from; statistics whose origins differ refuse to be compared
            or merged. ``None`` (unknown) is compared with anything.

    Shape:
        update: ``(N, D)``; ``mean``: ``(D,)``; ``covariance``: ``(D, D)``; ``features``: ``(k, D)``
        with ``k = min(keep, count)``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import FeatureStatistics
        >>> stats = FeatureStatistics()
        >>> for batch in torch.randn(10, 8, 4).unbind():
        ...     _ = stats.update(batch)
        >>> stats.count, tuple(stats.covariance.shape)
        (80, (4, 4))

    References:
        Chan, Golub, LeVeque (1979). Updating Formulae and a Pairwise Algorithm for Computing Sample
        Variances. Stanford technical report STAN-CS-79-773.
        Vitter (1985). Random Sampling with a Reservoir. ACM Transactions on Mathematical Software.
    """

    def __init__(
        self, dim: int | None = None, *, keep: int = 0, seed: int = 0, origin: FeatureOrigin | None = None
    ) -> None:
        if dim is not None:
            check_count(dim, "dim", least=1)
        self._keep = check_count(keep, "keep")
        self._seed = check_count(seed, "seed")
        if origin is not None and not isinstance(origin, FeatureOrigin):
            raise InvalidTypeError(f"origin must be a FeatureOrigin or None, not {type(origin).__name__}")
        self.origin = origin
        self.shard: Shard | None = None  # the rows of a set these hold when computed with shard=(i, n); None: all
        self._rng = np.random.default_rng(self._seed)
        self._count = 0
        self._dim: int | None = None
        self._mean = torch.zeros(0, dtype=torch.float64)
        self._scatter = torch.zeros(0, 0, dtype=torch.float64)  # sum of outer products of centered vectors
        self._kept = np.zeros((0, 0), dtype=np.float32)  # capacity rows; the first _filled are the sample
        self._filled = 0
        if dim is not None:
            self._start(dim)

    def _start(self, dim: int) -> None:
        self._dim = dim
        self._mean = torch.zeros(dim, dtype=torch.float64)
        self._scatter = torch.zeros(dim, dim, dtype=torch.float64)
        self._kept = np.zeros((0, dim), dtype=np.float32)

    # -- what it holds --------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        """How many feature vectors went in."""
        return self._count

    @property
    def dim(self) -> int | None:
        """The feature dimension ``D`` (``None`` before the first batch when not given)."""
        return self._dim

    @property
    def keep(self) -> int:
        """How many feature vectors are kept, at most."""
        return self._keep

    @property
    def mean(self) -> Tensor:
        """``(D,)`` float64 mean of the vectors so far (a copy)."""
        if self._count == 0:
            raise InvalidValueError("no feature vectors yet: the mean needs at least one")
        return self._mean.clone()

    @property
    def covariance(self) -> Tensor:
        """``(D, D)`` float64 unbiased covariance (divided by ``count - 1``), exactly symmetric (a copy)."""
        if self._count < 2:
            raise InvalidValueError(f"the covariance needs at least 2 feature vectors, got {self._count}")
        scatter = self._scatter
        return (scatter + scatter.T) / (2 * (self._count - 1))

    @property
    def features(self) -> Tensor:
        """``(k, D)`` float32 uniform random sample of the vectors, ``k = min(keep, count)`` (a copy).

        Raises:
            InvalidValueError: the statistics were built with ``keep=0``.
        """
        if self._keep == 0:
            raise InvalidValueError(
                "these statistics kept no feature vectors (keep=0); compute them with keep=N for a kernel "
                "inception distance"
            )
        return torch.from_numpy(self._kept[: self._filled].copy())

    def __repr__(self) -> str:
        where = f", origin={self.origin}" if self.origin is not None else ""
        return f"FeatureStatistics(count={self._count}, dim={self._dim}, keep={self._keep}{where})"

    # -- accumulating ---------------------------------------------------------------------------------
    def _check_dim(self, dim: int, what: str) -> None:
        if self._dim is None:
            self._start(dim)
        elif dim != self._dim:
            raise InvalidValueError(f"{what} has {dim} features per vector, but these statistics have {self._dim}")

    def update(self, features: ArrayLike) -> FeatureStatistics:
        """Add a batch of feature vectors (any float dtype and device; accumulated in float64 on the CPU).

        Shape:
            features: ``(N, D)``; ``N = 0`` adds nothing.

        Returns:
            ``self``, for chaining.

        Raises:
            InvalidValueError: not 2-D, another ``D`` than earlier batches, or NaN/infinite values.
        """
        batch = as_matrix(features, "features")
        self._check_dim(batch.shape[1], "this batch")
        count = batch.shape[0]
        if count == 0:
            return self
        mean = batch.mean(dim=0)
        centered = batch - mean
        self._combine(count, mean, centered.T @ centered)
        if self._keep:
            self._sample(batch.numpy().astype(np.float32))
        return self

    def _combine(self, count: int, mean: Tensor, scatter: Tensor) -> None:
        """Chan et al.'s merge of moments ``(count, mean, scatter)`` into the running ones."""
        before = self._count
        total = before + count
        delta = mean - self._mean
        self._mean += delta * (count / total)
        self._scatter += scatter
        self._scatter.addr_(delta, delta, alpha=before * count / total)
        self._count = total

    def _reserve(self, rows: int) -> None:
        """Room for ``rows`` kept vectors, grown geometrically up to ``keep`` (not allocated up front)."""
        capacity = self._kept.shape[0]
        if rows <= capacity:
            return
        grown = np.zeros((min(self._keep, max(rows, 2 * capacity)), self._kept.shape[1]), dtype=np.float32)
        grown[: self._filled] = self._kept[: self._filled]
        self._kept = grown

    def _sample(self, rows: np.ndarray) -> None:
        """Reservoir sampling (Algorithm R) of ``rows``, which were the last ``len(rows)`` vectors counted."""
        seen = self._count - len(rows)  # vectors offered before these
        free = min(self._keep - self._filled, len(rows))
        if free > 0:
            self._reserve(self._filled + free)
            self._kept[self._filled : self._filled + free] = rows[:free]
            self._filled += free
        rest = rows[free:]
        if not len(rest):
            return
        # The vector at 0-based position t replaces a uniform slot in [0, t] when that slot is < keep.
        positions = seen + free + np.arange(len(rest))
        slots = self._rng.integers(0, positions + 1)
        hits = np.flatnonzero(slots < self._keep)
        if not len(hits):
            return
        # A slot hit twice in this batch holds the later vector, as one-by-one replacement would leave it.
        reversed_slots = slots[hits][::-1]
        unique_slots, first = np.unique(reversed_slots, return_index=True)
        self._kept[unique_slots] = rest[hits[::-1][first]]

    def merge(self, other: FeatureStatistics) -> FeatureStatistics:
        """Add the vectors ``other`` summarizes (``other`` is not changed); same result as one pass over both.

        The kept sample becomes a uniform sample of the union (a hypergeometric share from each side,
        drawn with this object's generator) of at most ``min(self.keep, other.keep)`` vectors: merging
        with statistics that kept none keeps none, and where that many keep every vector of both (``KEEP_ALL``),
        they are this side's then ``other``'s, in order, as one pass over both keeps them.

        Returns:
            ``self``, for chaining.

        Raises:
            InvalidValueError: another feature dimension, or another origin.
        """
        if not isinstance(other, FeatureStatistics):
            raise InvalidTypeError(f"can only merge FeatureStatistics, not {type(other).__name__}")
        if self.shard is not None or other.shard is not None:
            raise InvalidValueError("statistics of a shard are joined by merge_statistics, which checks the shards")
        if self.origin is not None and other.origin is not None:
            self.origin.check_matches(other.origin, "the merged statistics")
        if other._dim is None:
            return self
        self._check_dim(other._dim, "the other statistics")
        if self.origin is None:
            self.origin = other.origin
        elif other.origin is not None and self.origin.precision != other.origin.precision:  # warned: now a mix
            self.origin = replace(self.origin, precision=None, weights_sha256=None)
        mine, theirs = self._kept[: self._filled].copy(), other._kept[: other._filled].copy()
        before, count = self._count, other._count
        if count:
            self._combine(count, other._mean.clone(), other._scatter.clone())
        self._keep = min(self._keep, other._keep)
        size = min(self._keep, self._count)
        if size == before + count:  # every vector of both kept: no sample to draw, the input order stays
            self._kept = np.concatenate([mine, theirs])
            self._filled = size
            return self
        from_mine = int(self._rng.hypergeometric(before, count, size)) if size else 0
        chosen = [
            part[self._rng.choice(len(part), taken, replace=False)]
            for part, taken in ((mine, from_mine), (theirs, size - from_mine))
        ]
        self._kept = np.concatenate(chosen) if self._keep else np.zeros((0, other._dim), dtype=np.float32)
        self._filled = size
        return self

    # -- files ----------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the statistics to ``path`` (exactly that name; ``.npz`` is customary), atomically.

        The file is an uncompressed ``.npz``: ``mu`` ``(D,)`` and ``sigma`` ``(D, D)`` (float64, the
        names pytorch-fid reads; zeros below 1 and 2 vectors), ``features`` ``(k, D)`` float32, and
        ``meta``, a JSON string with the format, count, dimension, sampling state and origin.

        Raises:
            InvalidValueError: nothing was added yet and no ``dim`` was given.
        """
        meta, arrays = self._parts()
        return write_npz(path, meta, **arrays)

    def _parts(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The ``meta`` and the arrays (``mu``, ``sigma``, ``features``) a file holds of these statistics."""
        if self._dim is None:
            raise InvalidValueError("these statistics have no feature dimension yet: add features before saving")
        meta = {
            "format": FORMAT,
            "count": self._count,
            "dim": self._dim,
            "keep": self._keep,
            "seed": self._seed,
            "rng_state": self._rng.bit_generator.state,
            "origin": origin_fields(self.origin),
            **({"shard": self.shard.to_dict()} if self.shard is not None else {}),
        }
        mean = self._mean if self._count else torch.zeros(self._dim, dtype=torch.float64)
        sigma = self.covariance if self._count >= 2 else torch.zeros(self._dim, self._dim, dtype=torch.float64)
        return meta, {"mu": mean.numpy(), "sigma": sigma.numpy(), "features": self._kept[: self._filled]}

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, dim: int | None = None) -> FeatureStatistics:
        """Read statistics written by ``save`` (no pickles are read: ``allow_pickle=False``).

        Every size is checked before anything is unpacked: the arrays' shapes against the file's ``meta`` and
        against ``dim``, the bytes they unpack to against the file's own size and a budget.

        Args:
            path: the file.
            dim: the feature dimension expected; ``None`` takes the file's.

        Raises:
            InputNotFoundError: no such file.
            InvalidValueError: not a featurehooks statistics file (a pickle, another ``.npz``, another
                format version), its arrays are inconsistent, or they hold another ``dim`` than asked.
        """
        if dim is not None:
            check_count(dim, "dim", least=1)
        arrays, meta = read_npz(path, "featurehooks statistics file", _ARRAYS, meta_format=FORMAT, check=_shapes(dim))
        try:
            return cls._from_arrays(arrays, meta or {})
        except InvalidValueError as exc:
            raise InvalidValueError(f"{os.fspath(path)} is not a featurehooks statistics file: {exc}") from None

    @classmethod
    def _from_arrays(cls, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> FeatureStatistics:
        """Statistics from the checked ``meta`` and the members of an archive (read once their shapes fit it)."""
        count, dim, keep = meta["count"], meta["dim"], meta["keep"]
        mu, sigma, kept = (np.asarray(arrays[name], dtype=np.float64) for name in ("mu", "sigma", "features"))
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all() and np.isfinite(kept).all()):
            raise InvalidValueError("it holds NaN or infinite values")
        origin = meta.get("origin")
        try:
            stats = cls(
                dim,
                keep=keep,
                seed=check_count(meta.get("seed", 0), "seed"),
                origin=FeatureOrigin(**origin) if origin is not None else None,
            )
            if "rng_state" in meta:
                stats._rng.bit_generator.state = meta["rng_state"]
            stats.shard = Shard.from_dict(meta["shard"]) if "shard" in meta else None
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise InvalidValueError(f"its meta is malformed ({exc})") from None
        stats._count = count
        stats._mean = torch.from_numpy(mu.copy())
        stats._scatter = torch.from_numpy(sigma * max(count - 1, 0))
        stats._kept = kept.astype(np.float32)
        stats._filled = kept.shape[0]
        return stats

    def check_matches(self, other: FeatureStatistics, what: str = "the two statistics") -> None:
        """Raise ``InvalidValueError`` unless ``other`` has the same dimension and a matching origin (and both
        summarize a whole set, not a shard)."""
        for side in (self, other):
            if side.shard is not None:
                raise InvalidValueError(f"{what}: one holds {side.shard} only; join the shards with merge_statistics")
        if self.origin is not None and other.origin is not None:  # first: another backbone explains another D
            self.origin.check_matches(other.origin, what)
        if self._dim is not None and other._dim is not None and self._dim != other._dim:
            raise InvalidValueError(f"{what} have different feature dimensions: {self._dim} vs {other._dim}")


def origin_fields(origin: FeatureOrigin | None) -> dict[str, Any] | None:
    """``origin`` as saved: its precision only when another than float32, and its lineage only when another than
    pytorch-fid's, so that versions which did not record them still read the file (absent, the precision reads back
    as unknown, the lineage of ``"fid_inception"`` as ``"legacy_pytorch"``); a version that knows no lineage refuses
    a file of another lineage rather than read it as pytorch-fid's."""
    if origin is None:
        return None
    fields = asdict(origin)
    if fields["precision"] in (None, "float32"):
        del fields["precision"]
    if fields["lineage"] is None or (origin.backbone == FID_INCEPTION and fields["lineage"] == DEFAULT_LINEAGE):
        del fields["lineage"]
    return fields


def _shapes(dim: int | None) -> Check:
    """The check of a statistics file's headers before reading: its ``meta`` in range, each array's shape what
    ``meta``'s ``dim``, ``count`` and ``keep`` say, and ``dim`` the one asked (when one is)."""

    def check(headers: dict[str, Header], meta: dict[str, Any] | None) -> None:
        count, found, keep = (_check_meta(meta or {})[name] for name in ("count", "dim", "keep"))
        if dim is not None and found != dim:
            origin = (meta or {}).get("origin")
            named = f" of {origin.get('backbone')} {origin.get('layer')}" if isinstance(origin, dict) else ""
            raise Mismatch(f"holds the statistics of {found} features{named}, not dim={dim}")
        expected = {"mu": (found,), "sigma": (found, found), "features": (min(keep, count), found)}
        shapes = {name: headers[name][0] for name in expected}
        if shapes != expected:
            raise InvalidValueError(
                f"shapes mu {shapes['mu']}, sigma {shapes['sigma']}, features {shapes['features']} do not fit "
                f"count {count}, dim {found}, keep {keep}"
            )

    return check


def _check_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` once its count, dim, keep and seed are ints in range."""
    for name, least in (("count", 0), ("dim", 1), ("keep", 0), ("seed", 0)):
        value = check_count(meta.get(name, 0) if name == "seed" else meta.get(name), name, least)
        if value > _MAX_COUNT:
            raise InvalidValueError(f"its {name} {value} is out of range (at most 2**53)")
    return meta


def save_statistics(path: str | os.PathLike[str], statistics: Mapping[str, FeatureStatistics]) -> Path:
    """Write several named statistics to one ``.npz`` at exactly ``path``, atomically: e.g. ``Evaluation.real``, a
    reference set of every backbone ``evaluate`` used, for later calls.

    Each is stored as ``FeatureStatistics.save`` stores one, its arrays under ``<name>.mu``, ``<name>.sigma`` and
    ``<name>.features``; ``meta`` lists the names and each one's own meta. ``load_statistics`` reads it back.

    Raises:
        InvalidValueError: no statistics, a name that is no identifier, or statistics without a dimension.

    Examples:
        >>> import os, tempfile, torch
        >>> from featurehooks.metrics import FeatureStatistics, load_statistics, save_statistics
        >>> stats = FeatureStatistics().update(torch.randn(10, 4))
        >>> path = save_statistics(os.path.join(tempfile.mkdtemp(), "ref.npz"), {"inception": stats})
        >>> {name: found.count for name, found in load_statistics(path).items()}
        {'inception': 10}
    """
    if not statistics:
        raise InvalidValueError("no statistics to save")
    metas: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for name, stats in statistics.items():
        if not (isinstance(name, str) and name.isidentifier()):
            raise InvalidValueError(f"statistics names must be identifiers (letters, digits, _), got {name!r}")
        if not isinstance(stats, FeatureStatistics):
            raise InvalidTypeError(f"statistics[{name!r}] must be FeatureStatistics, not {type(stats).__name__}")
        metas[name], parts = stats._parts()
        arrays |= {f"{name}.{part}": value for part, value in parts.items()}
    return write_npz(path, {"format": SET_FORMAT, "statistics": metas}, **arrays)


def load_statistics(path: str | os.PathLike[str]) -> dict[str, FeatureStatistics]:
    """The named statistics that ``save_statistics`` wrote to ``path``, each checked as ``FeatureStatistics.load``
    checks one file before anything is unpacked (no pickles are read).

    Raises:
        InputNotFoundError: no such file.
        InvalidValueError: not a file of named statistics, or one of them is inconsistent.

    Examples:
        >>> import os, tempfile, torch
        >>> from featurehooks.metrics import FeatureStatistics, load_statistics, save_statistics
        >>> path = save_statistics(os.path.join(tempfile.mkdtemp(), "ref.npz"), {"clip": FeatureStatistics(dim=3)})
        >>> load_statistics(path)["clip"].dim
        3
    """
    what = "featurehooks file of named statistics"
    _, meta = read_npz(path, what, [], meta_format=SET_FORMAT)
    metas = (meta or {}).get("statistics")
    if not isinstance(metas, dict) or not metas or not all(isinstance(name, str) for name in metas):
        raise InvalidValueError(f"{os.fspath(path)} is not a {what}: its meta names no statistics")
    names = [f"{name}.{part}" for name in metas for part in _ARRAYS]

    def check(headers: dict[str, Header], _: dict[str, Any] | None) -> None:
        for name, one in metas.items():
            if not isinstance(one, dict):
                raise InvalidValueError(f"the meta of {name!r} is not an object")
            _shapes(None)({part: headers[f"{name}.{part}"] for part in _ARRAYS}, one)

    arrays, _ = read_npz(path, what, names, meta_format=SET_FORMAT, exact=True, check=check)
    found = {}
    for name, one in metas.items():
        try:
            found[name] = FeatureStatistics._from_arrays({part: arrays[f"{name}.{part}"] for part in _ARRAYS}, one)
        except InvalidValueError as exc:
            raise InvalidValueError(f"{os.fspath(path)} is not a {what}: {name}: {exc}") from None
    return found
