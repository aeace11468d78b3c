"""Centered kernel alignment (CKA): how alike the representations of two layers are, over the same images.

- ``cka``: the number of two feature matrices held in memory, with a linear or an RBF kernel and the biased HSIC of
  Kornblith et al. (2019) (``unbiased=True``: the unbiased HSIC of Song et al. 2012);
- ``MinibatchCKA``: the streaming estimator of Nguyen, Raghu and Kornblith (2021): the unbiased HSIC of each minibatch
  of rows, averaged over minibatches, for every layer of one model against every layer of another; its memory holds a
  minibatch, never the number of images;
- ``cka_matrix`` and ``cka_matrix_from_dumps`` (in ``cka_sources``): that layer × layer matrix for two extractors
  over one stream of images, and for two finished dumps, their rows matched by the ids of their ``index.csv``.

All arithmetic is in float64; each row's features are flattened (maps and tokens alike), as Kornblith et al. do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Union

import numpy as np
import torch
from torch import Tensor

from ..errors import (
    InvalidTypeError,
    InvalidValueError,
    LayerNotFoundError,
    did_you_mean,
)

if TYPE_CHECKING:
    pass

__all__ = ["KERNELS", "MINIBATCH_SIZE", "CKAMatrix", "MinibatchCKA", "cka"]

Features = Union[Tensor, np.ndarray]
"""Features of ``N`` rows: an ``(N, ...)`` tensor or array, each row flattened."""

Kernel = Literal["linear", "rbf"]
KERNELS = ("linear", "rbf")
MINIBATCH_SIZE = 256
_LEAST_ROWS = 4  # the unbiased HSIC divides by n (n - 3)
_NAMED = 3  # ids named in a message; the rest are counted


def _rows(features: Features, what: str) -> np.ndarray:
    """``features`` as a float64 ``(N, D)`` array of its own (each row flattened: never a view of the caller's
    buffer, which may be refilled while the rows wait for their minibatch); non-finite values refused."""
    if isinstance(features, Tensor):
        array = features.detach().to("cpu", torch.float64, copy=True).numpy()
    elif isinstance(features, np.ndarray):
        array = features.astype(np.float64, copy=True)
    else:
        raise InvalidTypeError(f"{what} must be a tensor or a numpy array, not {type(features).__name__}")
    if array.ndim < 2:
        raise InvalidValueError(f"{what} must hold one row per image, (N, ...), got shape {array.shape}")
    array = array.reshape(array.shape[0], -1)
    if not np.isfinite(array).all():
        raise InvalidValueError(f"{what} holds NaN or infinite values; CKA of such features is undefined")
    return array


def _gram(x: np.ndarray, kernel: str, sigma: float) -> np.ndarray:
    """The ``(N, N)`` kernel matrix of the rows of ``x``: dot products, or the RBF kernel of bandwidth ``sigma`` times
    the median distance (Kornblith et al.'s ``gram_rbf``: the median of the squared distances of all N² pairs)."""
    dots = x @ x.T
    if kernel == "linear":
        return dots
    norms = np.diag(dots)
    squared = np.maximum(norms[:, None] + norms[None, :] - 2 * dots, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # equal rows: a zero median, and no CKA (NaN)
        return np.exp(-squared / (2 * sigma**2 * np.median(squared)))


def _ratio(cross: np.ndarray, self_a: np.ndarray, self_b: np.ndarray) -> np.ndarray:
    """``cross / sqrt(self_a self_b)``, NaN where a representation has no variance (a zero or negative HSIC)."""
    scale = np.outer(self_a, self_b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, cross / np.sqrt(np.where(scale > 0, scale, 1.0)), np.nan)


class _Unbiased(NamedTuple):
    """What the unbiased HSIC needs of the kernel matrices of one minibatch, one row per layer: each matrix with its
    diagonal zeroed (flattened), its row sums and its sum."""

    flat: np.ndarray  # (L, n * n)
    row_sums: np.ndarray  # (L, n)
    totals: np.ndarray  # (L,)

    @classmethod
    def of(cls, grams: Sequence[np.ndarray]) -> _Unbiased:
        zeroed = np.stack(grams)
        n = zeroed.shape[1]
        zeroed[:, np.arange(n), np.arange(n)] = 0.0
        row_sums = zeroed.sum(axis=2)
        return cls(zeroed.reshape(len(grams), -1), row_sums, row_sums.sum(axis=1))

    @property
    def n(self) -> int:
        return self.row_sums.shape[1]

    def hsic(self, other: _Unbiased) -> np.ndarray:
        """``(L, L')`` unbiased HSIC of each layer here with each of ``other`` (Song et al. 2012)."""
        n = self.n
        value = self.flat @ other.flat.T + np.outer(self.totals, other.totals) / ((n - 1) * (n - 2))
        value -= 2 / (n - 2) * (self.row_sums @ other.row_sums.T)
        return value / (n * (n - 3))

    def self_hsic(self) -> np.ndarray:
        """``(L,)`` unbiased HSIC of each layer with itself (the diagonal of ``hsic(self)``)."""
        n = self.n
        value = np.einsum("ij,ij->i", self.flat, self.flat) + self.totals**2 / ((n - 1) * (n - 2))
        value -= 2 / (n - 2) * np.einsum("ij,ij->i", self.row_sums, self.row_sums)
        return value / (n * (n - 3))


def _biased_cka(x: np.ndarray, y: np.ndarray, kernel: str, sigma: float) -> float:
    """CKA with the biased HSIC, tr(K H L H) / (n - 1)² (Kornblith et al. 2019; the scale cancels)."""
    if kernel == "linear" and max(x.shape[1], y.shape[1]) < x.shape[0]:  # fewer features than rows: D × D, not N × N
        xc, yc = x - x.mean(axis=0), y - y.mean(axis=0)
        cross = np.linalg.norm(xc.T @ yc) ** 2
        self_x, self_y = np.linalg.norm(xc.T @ xc) ** 2, np.linalg.norm(yc.T @ yc) ** 2
    else:
        centered_x, centered_y = (_centered(_gram(z, kernel, sigma)) for z in (x, y))
        cross = np.einsum("ij,ij->", centered_x, centered_y)
        self_x, self_y = np.einsum("ij,ij->", centered_x, centered_x), np.einsum("ij,ij->", centered_y, centered_y)
    return float(_ratio(np.array([[cross]]), np.array([self_x]), np.array([self_y]))[0, 0])


def _centered(gram: np.ndarray) -> np.ndarray:
    """H K H, H = I - 11ᵀ / n: ``gram`` with its row and column means taken out."""
    means = gram.mean(axis=0)
    return gram - means[:, None] - means[None, :] + means.mean()


def _check_kernel(kernel: str, sigma: float) -> None:
    if kernel not in KERNELS:
        raise InvalidValueError(
            f"kernel must be 'linear' or 'rbf', got {kernel!r}; {did_you_mean(str(kernel), KERNELS)}"
        )
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (math.isfinite(sigma) and sigma > 0):
        raise InvalidValueError(f"sigma must be a positive number (a multiple of the median distance), got {sigma!r}")


def cka(a: Features, b: Features, *, kernel: Kernel = "linear", sigma: float = 1.0, unbiased: bool = False) -> float:
    """Centered kernel alignment of two representations of the same ``N`` images (row ``i`` of each is image ``i``).

    CKA(K, L) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) of the kernel matrices ``K``, ``L`` of the rows of ``a`` and
    ``b``: 1 for representations equal up to a rotation and a scale, near 0 for unrelated ones. Invariant to orthogonal
    transforms and isotropic scaling of either (not to other invertible linear maps). Holds ``N × N`` kernel matrices
    (the linear kernel with fewer features than rows: ``D × D`` covariances instead); for more images, stream them
    through ``MinibatchCKA``.

    Args:
        a: the features of one layer, ``(N, ...)`` (maps and tokens are flattened per row).
        b: the features of another layer (of the same or another model) for the same images, ``(N, ...)``.
        kernel: ``"linear"`` (dot products) or ``"rbf"``: exp(-|x - y|² / (2 σ²)).
        sigma: for ``"rbf"``: σ as a multiple of the median distance between the rows of each matrix, Kornblith et
            al.'s ``threshold``: σ² = sigma² · the median of the squared distances over all N² pairs (the zero
            distance of each row to itself included), as in their ``gram_rbf``. Their code's default is 1.0; their
            paper reports 0.2 to 0.8.
        unbiased: ``False``: the biased HSIC, tr(K H L H) / (N - 1)², of Kornblith et al. (2019); ``True``: the
            unbiased HSIC of Song et al. (2012) (their ``debiased=True``), which ``MinibatchCKA`` averages.

    Returns:
        CKA in [0, 1] (the unbiased estimate may stray slightly outside); NaN where a representation is constant over
        the images.

    Shape:
        a: ``(N, D1, ...)``, b: ``(N, D2, ...)``, float64 inside.

    Raises:
        InvalidValueError: other row counts, fewer than 2 rows (4 with ``unbiased``), non-finite values, an unknown
            kernel or a bandwidth that is not positive.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import cka
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(100, 32)
        >>> rotation, _ = torch.linalg.qr(torch.randn(32, 32))
        >>> round(cka(x, 3 * x @ rotation), 6), round(cka(x, torch.randn(100, 16)), 1)
        (1.0, 0.2)
        >>> round(cka(x, 3 * x @ rotation, kernel="rbf", sigma=0.5), 6)
        1.0

    References:
        Kornblith, Norouzi, Lee, Hinton (2019). Similarity of Neural Network Representations Revisited. ICML.
        Song, Smola, Gretton, Bedo, Borgwardt (2012). Feature Selection via Dependence Maximization. JMLR.
    """
    _check_kernel(kernel, sigma)
    x, y = _rows(a, "a"), _rows(b, "b")
    if x.shape[0] != y.shape[0]:
        raise InvalidValueError(
            f"a and b must hold the same images, row for row: a has {x.shape[0]} rows, b {y.shape[0]}"
        )
    least = _LEAST_ROWS if unbiased else 2
    if x.shape[0] < least:
        raise InvalidValueError(
            f"CKA needs at least {least} rows (images){' with unbiased=True' if unbiased else ''}, got {x.shape[0]}"
        )
    if not unbiased:
        return _biased_cka(x, y, kernel, sigma)
    of_x, of_y = _Unbiased.of([_gram(x, kernel, sigma)]), _Unbiased.of([_gram(y, kernel, sigma)])
    return float(_ratio(of_x.hsic(of_y), of_x.self_hsic(), of_y.self_hsic())[0, 0])


@dataclass(frozen=True, eq=False)
class CKAMatrix:
    """CKA of every layer of model A (rows) with every layer of model B (columns), over ``count`` images.

    Examples:
        >>> import numpy as np
        >>> from featurehooks.metrics import CKAMatrix
        >>> matrix = CKAMatrix(np.array([[1.0, 0.25]]), ("layer1",), ("conv1", "conv2"), count=512, minibatch_size=256)
        >>> matrix.value("layer1", "conv2")
        0.25
    """

    values: np.ndarray  # (len(layers_a), len(layers_b)) float64
    layers_a: tuple[str, ...]
    layers_b: tuple[str, ...]
    count: int  # the images compared
    minibatch_size: int

    def value(self, layer_a: str, layer_b: str) -> float:
        """CKA of ``layer_a`` of A with ``layer_b`` of B."""
        return float(self.values[_position(layer_a, self.layers_a, "A"), _position(layer_b, self.layers_b, "B")])


def _position(layer: str, layers: Sequence[str], side: str) -> int:
    if layer not in layers:
        raise LayerNotFoundError(
            f"{side} has no layer {layer!r} (its layers are {list(layers)}); {did_you_mean(layer, layers)}"
        )
    return list(layers).index(layer)


def _layer_list(layers: Sequence[str], side: str) -> tuple[str, ...]:
    chosen = (layers,) if isinstance(layers, str) else tuple(layers)
    if not chosen:
        raise InvalidValueError(f"no layers of {side} given")
    repeated = sorted({layer for layer in chosen if chosen.count(layer) > 1})
    if repeated:
        raise InvalidValueError(f"layers of {side} named twice: {repeated}")
    return chosen


def _check_minibatch_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < _LEAST_ROWS:
        raise InvalidValueError(
            f"minibatch_size must be an int >= {_LEAST_ROWS} (the unbiased HSIC's least), got {size!r}"
        )


class MinibatchCKA:
    """Streaming CKA of every layer of model A with every layer of model B: the minibatch estimator of Nguyen et al.

    Feed ``update`` the features of the same images from both models, in batches of any size; the rows are cut into
    minibatches of ``minibatch_size`` consecutive rows in the order given (so the result does not depend on how
    the batches were cut), and CKA is the unbiased HSIC (Song et al. 2012) with the linear kernel summed over the
    minibatches, normalized: sum_i HSIC_1(K_i, L_i) / sqrt(sum_i HSIC_1(K_i, K_i) sum_i HSIC_1(L_i, L_i)) (Nguyen,
    Raghu, Kornblith 2021). The last minibatch takes the rows left over (``minibatch_size`` + up to 3 where
    fewer than 4 would be left, the unbiased HSIC's least). Memory holds about two minibatches of features and the
    batch being added, whatever the number of images. The linear kernel only: an RBF bandwidth from each
    minibatch's median would differ from minibatch to minibatch.

    Args:
        layers_a: names of A's layers (the keys ``update`` is given for A), the matrix's rows.
        layers_b: names of B's layers, its columns.
        minibatch_size: rows per minibatch (at least 4; Nguyen et al.: 256).

    Examples:
        >>> import torch
        >>> from featurehooks.metrics import MinibatchCKA
        >>> _ = torch.manual_seed(0)
        >>> accumulator = MinibatchCKA(["x"], ["x", "noise"], minibatch_size=64)
        >>> for _ in range(4):  # batches of features of the same images from models A and B
        ...     x = torch.randn(50, 16)
        ...     accumulator.update({"x": x}, {"x": 2 * x, "noise": torch.randn(50, 8)})
        >>> matrix = accumulator.compute()
        >>> matrix.count, round(matrix.value("x", "x"), 6), abs(matrix.value("x", "noise")) < 0.05
        (200, 1.0, True)

    References:
        Nguyen, Raghu, Kornblith (2021). Do Wide and Deep Networks Learn the Same Things? Uncovering How Neural
        Network Representations Vary with Width and Depth. ICLR.
    """

    def __init__(
        self, layers_a: Sequence[str], layers_b: Sequence[str], *, minibatch_size: int = MINIBATCH_SIZE
    ) -> None:
        _check_minibatch_size(minibatch_size)
        self.layers_a, self.layers_b = _layer_list(layers_a, "A"), _layer_list(layers_b, "B")
        self.minibatch_size = minibatch_size
        self._pending: dict[str, list[list[np.ndarray]]] = {
            "A": [[] for _ in self.layers_a],
            "B": [[] for _ in self.layers_b],
        }
        self._pending_rows = 0
        self._widths: dict[tuple[str, int], int] = {}
        self._cross = np.zeros((len(self.layers_a), len(self.layers_b)))
        self._self_a, self._self_b = np.zeros(len(self.layers_a)), np.zeros(len(self.layers_b))
        self.count = 0  # rows given

    def update(
        self,
        a: Mapping[str, Features],
        b: Mapping[str, Features],
        *,
        ids_a: Sequence[str] | None = None,
        ids_b: Sequence[str] | None = None,
    ) -> None:
        """Add a batch: ``{layer: (n, ...) features}`` of A and of B for the same ``n`` images, in the same order.

        ``ids_a`` and ``ids_b``, when given, name each row's image on each side; a batch whose ids differ is refused,
        naming them, before anything is added.
        """
        sides = {"A": self._batch(a, self.layers_a, "A"), "B": self._batch(b, self.layers_b, "B")}
        counts = {side: {len(rows) for rows in arrays} for side, arrays in sides.items()}
        if len(counts["A"] | counts["B"]) != 1:
            raise InvalidValueError(f"a batch must hold the same images in every layer of A and B: row counts {counts}")
        n = counts["A"].pop()
        if (ids_a is None) != (ids_b is None):
            raise InvalidValueError("give the ids of both sides (ids_a and ids_b), or of neither")
        if ids_a is not None and ids_b is not None:
            _check_same_ids(list(ids_a), list(ids_b), n)
        for side, arrays in sides.items():
            for pending, rows in zip(self._pending[side], arrays):
                pending.append(rows)
        self._pending_rows += n
        self.count += n
        while self._pending_rows >= self.minibatch_size + _LEAST_ROWS:
            self._add(self._take(self.minibatch_size))

    def _batch(self, features: Mapping[str, Features], layers: tuple[str, ...], side: str) -> list[np.ndarray]:
        """The rows of each of ``layers`` in ``features``; a missing layer, or a width other than before, refused."""
        if not isinstance(features, Mapping):
            raise InvalidTypeError(
                f"the features of {side} must be a dict {{layer: features}}, not {type(features).__name__}"
            )
        arrays = []
        for index, layer in enumerate(layers):
            if layer not in features:
                raise LayerNotFoundError(
                    f"the features of {side} have no layer {layer!r}; {did_you_mean(layer, features)}"
                )
            rows = _rows(features[layer], f"layer {layer!r} of {side}")
            width = self._widths.setdefault((side, index), rows.shape[1])
            if rows.shape[1] != width:
                raise InvalidValueError(f"layer {layer!r} of {side} has {rows.shape[1]} features a row, {width} before")
            arrays.append(rows)
        return arrays

    def _take(self, count: int) -> dict[str, list[np.ndarray]]:
        """The first ``count`` pending rows of each layer, removed from the pending rows."""
        taken: dict[str, list[np.ndarray]] = {}
        for side, layers in self._pending.items():
            taken[side] = []
            for pending in layers:
                rows = np.concatenate(pending) if len(pending) > 1 else pending[0]
                taken[side].append(rows[:count])
                pending[:] = [rows[count:]] if len(rows) > count else []
        self._pending_rows -= count
        return taken

    def _terms(self, minibatch: Mapping[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The unbiased HSIC of one minibatch: A × B, and of each layer of A and of B with itself."""
        a = _Unbiased.of([x @ x.T for x in minibatch["A"]])
        b = _Unbiased.of([y @ y.T for y in minibatch["B"]])
        return a.hsic(b), a.self_hsic(), b.self_hsic()

    def _add(self, minibatch: Mapping[str, list[np.ndarray]]) -> None:
        cross, self_a, self_b = self._terms(minibatch)
        self._cross += cross
        self._self_a += self_a
        self._self_b += self_b

    def compute(self) -> CKAMatrix:
        """The ``CKAMatrix`` of the rows given so far (the rows still pending count as the last minibatch; more rows
        may follow, and a later ``compute`` counts them).

        Raises:
            InvalidValueError: fewer than 4 rows were given.
        """
        if self.count < _LEAST_ROWS:
            raise InvalidValueError(f"CKA needs at least {_LEAST_ROWS} images, got {self.count}")
        cross, self_a, self_b = self._cross, self._self_a, self._self_b
        if self._pending_rows:
            pending = {side: [np.concatenate(rows) for rows in layers] for side, layers in self._pending.items()}
            tail = self._terms(pending)
            cross, self_a, self_b = cross + tail[0], self_a + tail[1], self_b + tail[2]
        return CKAMatrix(_ratio(cross, self_a, self_b), self.layers_a, self.layers_b, self.count, self.minibatch_size)


def _named(ids: Sequence[str]) -> str:
    """The first ids, quoted, and how many more."""
    shown = ", ".join(repr(name) for name in ids[:_NAMED])
    return shown + (f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")


def _check_same_ids(ids_a: list[str], ids_b: list[str], n: int) -> None:
    if len(ids_a) != n or len(ids_b) != n:
        raise InvalidValueError(f"ids must name each of the {n} rows: got {len(ids_a)} ids for A, {len(ids_b)} for B")
    differ = [row for row in range(n) if ids_a[row] != ids_b[row]]
    if differ:
        pairs = ", ".join(f"row {row}: {ids_a[row]!r} in A, {ids_b[row]!r} in B" for row in differ[:_NAMED])
        more = f" and {len(differ) - _NAMED} more" if len(differ) > _NAMED else ""
        raise InvalidValueError(
            f"the batches of A and B hold other images ({pairs}{more}); match their rows by id first"
        )
