"""Streaming statistics of feature vectors: count, mean and covariance in float64, and a bounded sample.

``FeatureStatistics`` is what a Fréchet distance needs (first and second moments) without keeping a
single feature vector: each batch is centered on its own mean and merged with Chan et al.'s pairwise
update, in float64, so a million images cost one ``(D, D)`` matrix and the result equals ``np.cov``
of all of them to rounding. The kernel inception distance needs feature vectors, not moments;
``keep=N`` keeps a uniform random sample of at most ``N`` of them (reservoir sampling, seeded).

Statistics are saved as ``.npz`` (read back with ``allow_pickle=False``) together with where their
features came from (backbone, layer, pool, weights), so comparing a reference set's statistics with
statistics of other features is an error rather than a meaningless number. The file also holds
``mu`` and ``sigma`` under the names pytorch-fid uses.

``feature_statistics`` streams images through a ``FeatureExtractor`` with the input pipeline dumps use
(``featurehooks.stream``: listing, decoding, resize and crop, DataLoader workers, pooling) and writes no
feature file;
``statistics_from_dump`` reads the pooled features of a finished dump in memory-mapped chunks.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import warnings
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
from torch import Tensor

from .._atomic import write_atomic
from .._layout import Pool
from ..dump import DumpResult, read_manifest
from ..errors import (
    InputNotFoundError,
    InvalidTypeError,
    InvalidValueError,
    LayerNotFoundError,
    RunFailedError,
    did_you_mean,
)
from ..stream import Inputs, Progress, SourceSpec, check_options, extract_batches, resolve_inputs
from ..stream.sharding import Distributed, split_contiguous

if TYPE_CHECKING:
    from ..extractor import FeatureExtractor
    from ..images import ImageTransform

__all__ = [
    "FORMAT",
    "FeatureOrigin",
    "FeatureStatistics",
    "feature_statistics",
    "feature_statistics_by_layer",
    "statistics_from_dump",
]

FORMAT = "featurehooks.statistics/1"
ArrayLike = Union[Tensor, np.ndarray]
_STRICT = ("backbone", "layer", "pool", "weights")  # fields that must match for two statistics to be compared
_NAMED_SKIPS = 3  # unreadable inputs named in the warning; the rest are counted
_DUMP_CHUNK_ROWS = 8192
_ARRAYS = ("mu", "sigma", "features", "meta")
_MAX_META_BYTES = 1 << 20  # meta is a short JSON text (format, counts, sampling state, origin)
_MAX_META_DEPTH = 32  # nesting of meta's lists and objects (what save writes is 4 deep)
_MAX_COUNT = 2**53  # counts beyond this are not exact in float64, and overflow the moment arithmetic
_MAX_DEFLATE_RATIO = 1100  # deflate cannot expand data more than ~1032 times: a member declaring more lies
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


@dataclass(frozen=True)
class FeatureOrigin:
    """Where feature vectors came from: what must match for two sets of statistics to be compared.

    ``backbone``, ``layer``, ``pool`` (``None``: the layer returns vectors and was not pooled) and
    ``weights`` (the weights name, ``None`` for random init) must be equal; ``weights_sha256`` (a
    digest of the backbone's state dict) differing only warns, since the same weights in another
    dtype have other bytes; so does ``precision`` (what the backbone computed in; ``None`` in files written
    before it was recorded and in statistics merged from two precisions), named in the warning.
    ``preprocessing`` (resize, crop, interpolation) is kept for the record.

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
                "nothing; compute both with the same backbone, weights, layer and pool"
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


def _as_matrix(features: Any, name: str) -> Tensor:
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


def _check_count(value: Any, name: str, least: int = 0) -> int:
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
            _check_count(dim, "dim", least=1)
        self._keep = _check_count(keep, "keep")
        self._seed = _check_count(seed, "seed")
        if origin is not None and not isinstance(origin, FeatureOrigin):
            raise InvalidTypeError(f"origin must be a FeatureOrigin or None, not {type(origin).__name__}")
        self.origin = origin
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
        batch = _as_matrix(features, "features")
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
        with statistics that kept none keeps none.

        Returns:
            ``self``, for chaining.

        Raises:
            InvalidValueError: another feature dimension, or another origin.
        """
        if not isinstance(other, FeatureStatistics):
            raise InvalidTypeError(f"can only merge FeatureStatistics, not {type(other).__name__}")
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
        }
        mean = self._mean if self._count else torch.zeros(self._dim, dtype=torch.float64)
        sigma = self.covariance if self._count >= 2 else torch.zeros(self._dim, self._dim, dtype=torch.float64)
        return write_npz(path, meta, mu=mean.numpy(), sigma=sigma.numpy(), features=self._kept[: self._filled])

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FeatureStatistics:
        """Read statistics written by ``save`` (no pickles are read: ``allow_pickle=False``).

        Raises:
            InputNotFoundError: no such file.
            InvalidValueError: not a featurehooks statistics file (a pickle, another ``.npz``, another
                format version), or its arrays are inconsistent.
        """
        where = os.fspath(path)
        if not os.path.isfile(where):
            raise InputNotFoundError(f"no statistics file {where}")
        try:
            return cls._from_arrays(_read_archive(where))
        except InvalidValueError as exc:
            raise InvalidValueError(f"{where} is not a featurehooks statistics file: {exc}") from None
        except (  # pickles, corrupt archives
            ValueError,
            OSError,
            KeyError,
            TypeError,
            EOFError,
            OverflowError,
            RecursionError,
            MemoryError,
            NotImplementedError,
            zipfile.BadZipFile,
            zlib.error,
        ) as exc:
            raise InvalidValueError(f"{where} is not a featurehooks statistics file ({exc})") from None

    @classmethod
    def _from_arrays(cls, arrays: dict[str, Any]) -> FeatureStatistics:
        """Statistics from the checked ``meta`` and the members of an archive (read once their shapes fit it)."""
        meta = arrays["meta"]
        count, dim, keep = meta["count"], meta["dim"], meta["keep"]
        mu, sigma, kept = (np.asarray(arrays[name], dtype=np.float64) for name in ("mu", "sigma", "features"))
        if mu.shape != (dim,) or sigma.shape != (dim, dim) or kept.shape != (min(keep, count), dim):
            raise InvalidValueError(
                f"shapes mu {mu.shape}, sigma {sigma.shape}, features {kept.shape} do not fit count {count}, "
                f"dim {dim}, keep {keep}"
            )
        if not (np.isfinite(mu).all() and np.isfinite(sigma).all() and np.isfinite(kept).all()):
            raise InvalidValueError("it holds NaN or infinite values")
        origin = meta.get("origin")
        try:
            stats = cls(
                dim,
                keep=keep,
                seed=_check_count(meta.get("seed", 0), "seed"),
                origin=FeatureOrigin(**origin) if origin is not None else None,
            )
            if "rng_state" in meta:
                stats._rng.bit_generator.state = meta["rng_state"]
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise InvalidValueError(f"its meta is malformed ({exc})") from None
        stats._count = count
        stats._mean = torch.from_numpy(mu.copy())
        stats._scatter = torch.from_numpy(sigma * max(count - 1, 0))
        stats._kept = kept.astype(np.float32)
        stats._filled = kept.shape[0]
        return stats

    def check_matches(self, other: FeatureStatistics, what: str = "the two statistics") -> None:
        """Raise ``InvalidValueError`` unless ``other`` has the same dimension and a matching origin."""
        if self.origin is not None and other.origin is not None:  # first: another backbone explains another D
            self.origin.check_matches(other.origin, what)
        if self._dim is not None and other._dim is not None and self._dim != other._dim:
            raise InvalidValueError(f"{what} have different feature dimensions: {self._dim} vs {other._dim}")


def origin_fields(origin: FeatureOrigin | None) -> dict[str, Any] | None:
    """``origin`` as saved: its precision only when another than float32, so that versions which did not record it
    still read the file (absent, it reads back as unknown)."""
    if origin is None:
        return None
    fields = asdict(origin)
    if fields["precision"] in (None, "float32"):
        del fields["precision"]
    return fields


def write_npz(path: str | os.PathLike[str], meta: dict[str, Any], **arrays: np.ndarray) -> Path:
    """Write ``arrays`` and ``meta`` (a JSON string member) to an uncompressed ``.npz`` at exactly ``path``,
    atomically: the file format of statistics and manifolds."""
    buffer = io.BytesIO()
    members: dict[str, Any] = {**arrays, "meta": np.array(json.dumps(meta))}
    np.savez(buffer, **members)
    target = Path(path)
    write_atomic(target, buffer.getvalue())
    return target


def _read_archive(where: str) -> dict[str, Any]:
    """``meta`` (checked) and the arrays ``mu``, ``sigma`` and ``features`` of the statistics file ``where``.

    Nothing is decompressed before its size is known to be what ``meta`` says: each member's ``.npy`` header
    is read first and its shape checked against ``meta``'s ``dim``, ``count`` and ``keep``, its declared size
    against the member's, and the member's against the bytes stored for it. A small file declaring a huge
    array is refused without allocating it.
    """
    if not zipfile.is_zipfile(where):
        raise InvalidValueError("it is not an .npz archive (a pickle, a single .npy array, or a damaged file)")
    with zipfile.ZipFile(where) as archive:
        members = {info.filename: info for info in archive.infolist()}
        missing = [name for name in _ARRAYS if f"{name}.npy" not in members]
        if missing:
            raise InvalidValueError(f"no {', '.join(sorted(missing))} arrays")
        size = os.path.getsize(where)
        headers = {name: _member_header(archive, members[f"{name}.npy"], size) for name in _ARRAYS}
        meta = _read_meta(archive, members["meta.npy"], headers["meta"])
        count, dim, keep = meta["count"], meta["dim"], meta["keep"]
        expected = {"mu": (dim,), "sigma": (dim, dim), "features": (min(keep, count), dim)}
        shapes = {name: headers[name][0] for name in expected}
        if shapes != expected:
            raise InvalidValueError(
                f"shapes mu {shapes['mu']}, sigma {shapes['sigma']}, features {shapes['features']} do not fit "
                f"count {count}, dim {dim}, keep {keep}"
            )
        for name in expected:
            if headers[name][1].kind not in "fiu":
                raise InvalidValueError(f"its {name} holds {headers[name][1]}, not real numbers")
        arrays: dict[str, Any] = {name: _read_member(archive, members[f"{name}.npy"]) for name in expected}
    arrays["meta"] = meta
    return arrays


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """The checked member ``info`` as an array (never a pickle)."""
    with archive.open(info) as handle:
        return np.lib.format.read_array(handle, allow_pickle=False)


def _member_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, archive_size: int
) -> tuple[tuple[int, ...], np.dtype]:
    """``(shape, dtype)`` from the ``.npy`` header of ``info``, once its sizes are known to be consistent."""
    name = info.filename
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size or info.compress_size > archive_size:
            raise InvalidValueError(f"its {name} declares {info.file_size:,} bytes but stores {info.compress_size:,}")
    elif info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 4096:
        raise InvalidValueError(
            f"its {name} declares {info.file_size:,} bytes, more than {info.compress_size:,} compressed bytes can hold"
        )
    with archive.open(info) as handle:
        version = np.lib.format.read_magic(handle)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
        else:
            raise InvalidValueError(f"its {name} is an .npy of version {version}, not 1.0 or 2.0")
        header_size = handle.tell()
    if dtype.hasobject:
        raise InvalidValueError(f"its {name} holds Python objects (a pickle), which are never read")
    declared = header_size + math.prod(shape) * dtype.itemsize
    if declared != info.file_size:
        raise InvalidValueError(
            f"its {name} declares shape {shape} of {dtype} ({declared:,} bytes) in a member of {info.file_size:,}"
        )
    return tuple(shape), dtype


def _read_meta(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, header: tuple[tuple[int, ...], np.dtype]
) -> dict[str, Any]:
    """``meta`` parsed, its size, nesting and numbers bounded, its format, count, dim and keep checked."""
    shape, dtype = header
    if shape != () or dtype.kind != "U":
        raise InvalidValueError("its meta is not a JSON string")
    if info.file_size > _MAX_META_BYTES:
        raise InvalidValueError(f"its meta is {info.file_size:,} bytes, more than {_MAX_META_BYTES:,}")
    text = str(_read_member(archive, info)[()])
    depth = _json_depth(text)
    if depth > _MAX_META_DEPTH:
        raise InvalidValueError(f"its meta nests {depth} levels deep, more than {_MAX_META_DEPTH}")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise InvalidValueError(f"its meta is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise InvalidValueError(f"format {found!r}, expected {FORMAT!r}")
    for name, least in (("count", 0), ("dim", 1), ("keep", 0), ("seed", 0)):
        value = _check_count(meta.get(name, 0) if name == "seed" else meta.get(name), name, least)
        if value > _MAX_COUNT:
            raise InvalidValueError(f"its {name} {value} is out of range (at most 2**53)")
    return meta


def _json_depth(text: str) -> int:
    """How deep the lists and objects of JSON ``text`` nest (strings, whose brackets do not count, skipped)."""
    depth = deepest = 0
    for char in _JSON_STRING.sub('""', text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


# -- from images ---------------------------------------------------------------------------------------
def _output_names(extractor: FeatureExtractor) -> list[str]:
    """The names an extractor returns (its ``.prefix`` outputs too, when the layouts are known)."""
    try:
        return list(extractor.output_layouts)
    except RuntimeError:  # a model that cannot be traced: its requested names
        return list(extractor.layers)


def _preprocessing(transform: ImageTransform | None) -> dict[str, Any]:
    described = transform.describe() if transform is not None else {}
    return {key: described.get(key) for key in ("resize_size", "crop_size", "interpolation")}


def _origins(
    extractor: FeatureExtractor, layers: list[str], pool: str | None, transform: ImageTransform | None
) -> dict[str, FeatureOrigin]:
    digest = extractor.weights_sha256()  # hashed once for all layers
    preprocessing = _preprocessing(transform)
    return {
        layer: FeatureOrigin(
            extractor.backbone_name, layer, pool, extractor.weights, digest, preprocessing, extractor.precision
        )
        for layer in layers
    }


def _warn_skipped(skipped: list[tuple[str, str]], total: int) -> None:
    if not skipped:
        return
    named = "; ".join(f"{path}: {reason}" for path, reason in skipped[:_NAMED_SKIPS])
    more = f" and {len(skipped) - _NAMED_SKIPS} more" if len(skipped) > _NAMED_SKIPS else ""
    warnings.warn(
        f"{len(skipped)} of {total} inputs could not be read and are left out of the statistics ({named}{more})",
        stacklevel=3,
    )


def _accumulate(
    stats: dict[str, FeatureStatistics],
    extractor: FeatureExtractor,
    inputs: Inputs,
    batches: list[list[int]],
    pool: Pool | None,
    num_workers: int | None,
    progress: bool,
    rank: int,
) -> list[tuple[str, str]]:
    """Add the pooled features of ``batches`` (this rank's share of the rows) to ``stats``; the rows skipped."""
    skipped: list[tuple[str, str]] = []
    label = "statistics" if rank == 0 else f"statistics rank {rank}"
    with Progress(sum(map(len, batches)), progress, label=label, rank=rank) as bar:
        found = extract_batches(
            extractor, inputs, batches, pool=pool, dtype="float32", num_workers=num_workers, progress=bar
        )
        for batch in found:
            skipped.extend((inputs.names[row], reason) for row, reason in batch.skipped)
            for name, into in stats.items():
                vectors = batch.arrays[name]
                if vectors.ndim != 2:
                    raise InvalidValueError(
                        f"layer {name!r} returns features of shape {(len(batch.rows), *vectors.shape[1:])}, not "
                        "vectors; pool them (pool='avg', 'max' or 'cls')"
                    )
                into.update(vectors[batch.valid])
    return skipped


def feature_statistics_by_layer(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layers: Sequence[str] | None = None,
    pool: Pool | None = "avg",
    batch_size: int = 64,
    num_workers: int | None = None,
    resize_size: int | None | str = "weights",
    crop_size: int | None | str = "weights",
    keep: int = 0,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, FeatureStatistics]:
    """``feature_statistics`` of several layers of one extractor in one pass over the images.

    Args are those of ``feature_statistics``; ``layers`` (default: every output of the extractor)
    replaces ``layer``.

    Returns:
        ``{layer: FeatureStatistics}`` in the order of ``layers``.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics_by_layer
        >>> ext = FeatureExtractor("resnet18", ["layer3", "layer4"], weights=None)
        >>> images = torch.rand(8, 3, 64, 64)  # or a folder, a glob, a list of files, a Dataset
        >>> {name: stats.dim for name, stats in feature_statistics_by_layer(ext, images).items()}
        {'layer3': 256, 'layer4': 512}
    """
    check_options(batch_size, num_workers, pool, "float32")
    _check_count(keep, "keep")
    _check_count(seed, "seed")
    available = _output_names(extractor)
    wanted = list(available if layers is None else ([layers] if isinstance(layers, str) else layers))
    if not wanted:
        raise InvalidValueError("no layers given")
    for name in wanted:
        if name not in available:
            raise LayerNotFoundError(
                f"the extractor returns no layer {name!r} (it returns {available}); {did_you_mean(name, available)}"
            )
    inputs = resolve_inputs(extractor, source, resize_size, crop_size, pool)
    origins = _origins(extractor, wanted, pool, inputs.transform)
    stats = {name: FeatureStatistics(keep=keep, seed=seed, origin=origins[name]) for name in wanted}
    total = len(inputs.names)
    batches = [list(range(start, min(start + batch_size, total))) for start in range(0, total, batch_size)]
    ranks = Distributed.from_environment(extractor.device)
    try:
        try:
            mine = split_contiguous(batches, ranks.world_size, ranks.rank)
            skipped = _accumulate(stats, extractor, inputs, mine, pool, num_workers, progress, ranks.rank)
        except Exception as exc:
            if ranks.world_size > 1:  # the other ranks wait for this one's share: tell them why it is missing
                ranks.all_gather(f"{type(exc).__name__}: {exc}")
            raise
        shares = ranks.all_gather((stats, skipped))  # in rank order: rank r holds the r-th run of rows
    finally:
        ranks.close()
    failed = [f"rank {rank}: {share}" for rank, share in enumerate(shares) if isinstance(share, str)]
    if failed:
        raise RunFailedError(f"the statistics failed on {'; '.join(failed)}")
    stats, skipped = shares[0]
    for other, other_skipped in shares[1:]:
        for name in wanted:
            stats[name].merge(other[name])
        skipped.extend(other_skipped)
    if ranks.is_main:
        _warn_skipped(skipped, total)
    return stats


def feature_statistics(
    extractor: FeatureExtractor,
    source: SourceSpec,
    *,
    layer: str | None = None,
    pool: Pool | None = "avg",
    batch_size: int = 64,
    num_workers: int | None = None,
    resize_size: int | None | str = "weights",
    crop_size: int | None | str = "weights",
    keep: int = 0,
    seed: int = 0,
    progress: bool = False,
) -> FeatureStatistics:
    """Statistics of one layer's pooled features over an image collection; no feature file is written.

    Images are listed, decoded, resized, cropped and batched exactly as ``dump_features`` does (the
    same functions, DataLoader workers included), each batch's output is pooled to vectors with the
    extractor's ``output_layouts`` and added to a ``FeatureStatistics``, so memory does not grow with
    the number of images. Inputs that cannot be decoded are left out, with a warning naming them.

    Args:
        extractor: a ``FeatureExtractor``.
        source: a folder (searched recursively), a glob, an image path, a list of these, a
            ``Dataset`` of prepared image tensors or an ``(N, C, H, W)`` tensor (as for ``dump_features``).
        layer: the output to summarize; ``None`` for an extractor with a single output.
        pool: ``"avg"`` or ``"max"`` over positions (spatial, or patch tokens), ``"cls"`` for the
            class token, or ``None`` for outputs that already are ``(B, C)`` vectors.
        batch_size: images per forward.
        num_workers: DataLoader processes that decode while the model runs (default: up to 4).
        resize_size: shorter-side resize; ``"weights"`` for the weights' own, ``None`` for none.
        crop_size: center crop; ``"weights"`` for the weights' own, ``None`` for none.
        keep: keep a uniform random sample of at most this many vectors (for the kernel inception distance).
        seed: seed of that sample.
        progress: show a tqdm bar on stderr.

    Shape:
        the statistics are of ``(N, C)`` vectors: ``C`` the layer's channels, ``N`` the readable inputs.

    Raises:
        LayerNotFoundError: ``layer`` is not an output of the extractor.
        InvalidValueError: bad options, or ``pool=None`` for a layer that returns maps or tokens.
        InputNotFoundError: ``source`` finds no inputs.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor
        >>> from featurehooks.metrics import feature_statistics
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> images = torch.rand(8, 3, 64, 64)  # or a folder, a glob, a list of files, a Dataset
        >>> stats = feature_statistics(ext, images, keep=1000)
        >>> stats.count, tuple(stats.covariance.shape)
        (8, (512, 512))

    References:
        Heusel, Ramsauer, Unterthiner, Nessler, Hochreiter (2017). GANs Trained by a Two Time-Scale
        Update Rule Converge to a Local Nash Equilibrium. NeurIPS.
    """
    if layer is None:
        names = _output_names(extractor)
        if len(names) != 1:
            raise InvalidValueError(f"the extractor returns {len(names)} outputs {names}: pass layer=<one of them>")
        layer = names[0]
    return feature_statistics_by_layer(
        extractor,
        source,
        layers=[layer],
        pool=pool,
        batch_size=batch_size,
        num_workers=num_workers,
        resize_size=resize_size,
        crop_size=crop_size,
        keep=keep,
        seed=seed,
        progress=progress,
    )[layer]


# -- from a dump ---------------------------------------------------------------------------------------
def statistics_from_dump(
    dump: str | os.PathLike[str] | DumpResult,
    layer: str,
    *,
    keep: int = 0,
    seed: int = 0,
    chunk_rows: int = _DUMP_CHUNK_ROWS,
) -> FeatureStatistics:
    """Statistics of one layer of a finished dump of pooled features, read in memory-mapped chunks.

    Rows the dump marked invalid (inputs that could not be decoded, zero-filled) are left out.
    The origin (backbone, weights, pool, preprocessing) comes from the dump's manifest, so these
    statistics compare with ``feature_statistics`` of the same extractor, layer and pool.

    Args:
        dump: the dump's folder, or the ``DumpResult`` that ``dump_features`` returned.
        layer: the layer to summarize.
        keep: keep a uniform random sample of at most this many vectors.
        seed: seed of that sample.
        chunk_rows: rows read per chunk (bounds the memory, not the result).

    Shape:
        the layer's array must be ``(N, C)`` (dumped with ``pool=``, or a layer of vectors).

    Raises:
        InputNotFoundError: no dump in the folder.
        LayerNotFoundError: the dump has no such layer.
        InvalidValueError: the dump is unfinished, or the layer holds maps or tokens rather than vectors.

    Examples:
        >>> import tempfile, torch
        >>> from featurehooks import FeatureExtractor, dump_features
        >>> from featurehooks.metrics import statistics_from_dump
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> out = tempfile.mkdtemp()
        >>> _ = dump_features(ext, torch.rand(8, 3, 64, 64), out, pool="avg", progress=False)
        >>> stats = statistics_from_dump(out, "layer4")
        >>> stats.count, stats.dim
        (8, 512)
    """
    _check_count(chunk_rows, "chunk_rows", least=1)
    if isinstance(dump, DumpResult):
        result = dump
    else:
        manifest = read_manifest(dump)
        if manifest is None:
            raise InputNotFoundError(f"no featurehooks dump (manifest.json) in {os.fspath(dump)}")
        result = DumpResult(Path(dump), manifest)
    manifest = result.manifest
    if manifest.get("status") != "complete":
        raise InvalidValueError(
            f"the dump in {result.out_dir} is unfinished (status {manifest.get('status')!r}); finish it with "
            "dump_features(..., resume=True) first"
        )
    files = manifest["files"]
    if layer not in files:
        raise LayerNotFoundError(f"the dump in {result.out_dir} has no layer {layer!r}; {did_you_mean(layer, files)}")
    array = result.load(layer)
    if array.ndim != 2:
        raise InvalidValueError(
            f"layer {layer!r} of the dump in {result.out_dir} holds features of shape {array.shape}, not vectors; "
            "dump it with pool='avg' (or 'max', 'cls')"
        )
    invalid = np.zeros(array.shape[0], dtype=bool)
    invalid[[int(entry["row"]) for entry in manifest.get("skipped", [])]] = True
    preprocessing = {key: manifest.get("preprocessing", {}).get(key) for key in ("resize_size", "crop_size")}
    preprocessing["interpolation"] = manifest.get("preprocessing", {}).get("interpolation")
    origin = FeatureOrigin(
        backbone=manifest["backbone"],
        layer=layer,
        pool=manifest.get("pool"),
        weights=manifest.get("weights"),
        weights_sha256=manifest.get("weights_sha256"),
        preprocessing=preprocessing,
        precision=manifest.get("precision", "float32"),  # written only when not float32
    )
    stats = FeatureStatistics(array.shape[1], keep=keep, seed=seed, origin=origin)
    for start in range(0, array.shape[0], chunk_rows):
        stop = min(start + chunk_rows, array.shape[0])
        stats.update(np.asarray(array[start:stop][~invalid[start:stop]]))
    return stats
