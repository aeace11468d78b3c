"""The Inception Score (Salimans et al., 2016) on the FID Inception, as torch-fidelity computes it.

IS = exp(E_x KL(p(y|x) || p(y))) over each of ``splits`` parts of the images, reported as the mean and the
(population) standard deviation over the parts. ``p(y|x)`` is the softmax of the network's 1008 logits taken
without the bias of ``fc`` (torch-fidelity's ``logits_unbiased``): ``pool3 @ fc.weight.T``, so one forward to
the pool layer serves FID and IS. The images are shuffled first by ``numpy.random.RandomState(seed)``, 2020 as
torch-fidelity does, and part ``i`` holds rows ``i * N // splits`` to ``(i + 1) * N // splits``.

``inception_score`` streams images; ``inception_score_of_features`` takes the pool features of a pass made
for FID (``fid_statistics(..., keep=N)``), and ``inception_score_of_logits`` the logits themselves.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Union

import numpy as np
import torch
from torch import Tensor
from typing_extensions import Unpack

from ..errors import InvalidTypeError, InvalidValueError
from ._reuse import given_or_built
from .fid import FID_LAYERS, FIDMode, WeightsArg, fid_extractor, fid_network, fid_statistics
from .statistics import KEEP_ALL, as_matrix, check_count

if TYPE_CHECKING:
    from .._stream import SourceSpec, StreamOptions
    from ..extractor import FeatureExtractor, Precision

__all__ = ["inception_score", "inception_score_of_features", "inception_score_of_logits"]

IS_SEED = 2020  # torch-fidelity's rng_seed
ArrayLike = Union[Tensor, np.ndarray]


def inception_score_of_logits(
    logits: ArrayLike, splits: int = 10, *, seed: int | None = IS_SEED
) -> tuple[float, float]:
    """Mean and standard deviation over ``splits`` parts of the Inception Score of ``logits`` (torch-fidelity's
    ``isc_features_to_metric``).

    The rows are permuted by ``numpy.random.RandomState(seed).permutation(N)`` (``None``: kept in order), then
    each part's softmax is taken in float64, one part at a time: memory beyond ``logits`` is one part in float64.

    Args:
        logits: ``(N, K)`` class logits, ``N >= splits``.
        splits: how many parts the score is averaged over.
        seed: seed of the shuffle; ``None`` for none.

    Raises:
        InvalidValueError: not ``(N, K)`` finite reals, fewer rows than ``splits``, or a bad ``splits``/``seed``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.isc import inception_score_of_logits
        >>> inception_score_of_logits(torch.zeros(20, 5), splits=2)  # every image the same uniform guess
        (1.0, 0.0)
        >>> round(inception_score_of_logits(torch.eye(20) * 100, splits=2)[0], 3)  # 10 sure, distinct classes
        10.0
    """
    count = check_count(splits, "splits", least=1)
    if seed is not None:
        check_count(seed, "seed")
    matrix = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits
    if not isinstance(matrix, Tensor):
        raise InvalidTypeError(f"logits must be an (N, K) torch.Tensor or numpy array, not {type(logits).__name__}")
    if matrix.dim() != 2:
        raise InvalidValueError(f"logits must be (N, K), got shape {tuple(matrix.shape)}")
    rows = matrix.shape[0]
    if rows < count:
        raise InvalidValueError(f"the Inception Score of {count} splits needs at least {count} images, got {rows}")
    if seed is not None:
        matrix = matrix[torch.from_numpy(np.random.RandomState(seed).permutation(rows))]
    scores = []
    for part in range(count):
        chunk = as_matrix(matrix[part * rows // count : (part + 1) * rows // count], "logits")  # float64, checked
        p, log_p = chunk.softmax(dim=1), chunk.log_softmax(dim=1)
        q = p.mean(dim=0, keepdim=True)
        scores.append((p * (log_p - q.log())).sum(dim=1).mean().exp().item())
    return float(np.mean(scores)), float(np.std(scores))


def inception_score_of_features(
    features: ArrayLike, fc_weight: Tensor, splits: int = 10, *, seed: int | None = IS_SEED
) -> tuple[float, float]:
    """The Inception Score of the FID Inception's pool features: logits ``features @ fc_weight.T`` in float32
    (no bias, torch-fidelity's ``logits_unbiased``), then ``inception_score_of_logits``.

    ``fc_weight`` is the network's ``fc.weight`` (``fid_network(extractor).fc.weight``); ``features`` the
    ``(N, 2048)`` pool features, e.g. ``fid_statistics(..., keep=N).features`` of the same pass as a FID.

    Shape:
        features: ``(N, 2048)``; fc_weight: ``(1008, 2048)``.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.isc import inception_score_of_features
        >>> inception_score_of_features(torch.ones(4, 8), torch.zeros(3, 8), splits=2)
        (1.0, 0.0)
    """
    matrix = as_matrix(features, "features").to(torch.float32)
    weight = fc_weight.detach().to(device="cpu", dtype=torch.float32)
    if weight.dim() != 2 or weight.shape[1] != matrix.shape[1]:
        raise InvalidValueError(
            f"fc_weight of shape {tuple(weight.shape)} does not map features of {matrix.shape[1]} dimensions"
        )
    return inception_score_of_logits(matrix @ weight.T, splits, seed=seed)


def inception_score(
    source: SourceSpec,
    *,
    weights: WeightsArg = "DEFAULT",
    mode: FIDMode | None = None,
    splits: int = 10,
    seed: int | None = IS_SEED,
    device: str | torch.device | None = None,
    precision: Precision = "float32",
    extractor: FeatureExtractor | None = None,
    **options: Unpack[StreamOptions],
) -> tuple[float, float]:
    """The Inception Score of an image collection, ``(mean, std)`` over ``splits`` parts: torch-fidelity's ``isc``.

    The images stream through the FID Inception (``fid_extractor``) to its pool layer, each at its own size;
    their pool features are kept in input order (``N x 2048`` float32) and scored by
    ``inception_score_of_features``. The default lineage is ``"legacy_tensorflow"``, torch-fidelity's resize,
    so the score equals ``torch_fidelity.calculate_metrics(input1=..., isc=True)`` on the same images and
    weights; under torchrun the ranks' features are gathered in another order, so the parts differ.

    Args:
        source: images, as ``fid_statistics`` takes them (at least ``splits``).
        weights: see ``fid_extractor``.
        mode: the FID lineage; ``None``: that of ``extractor``, else ``"legacy_tensorflow"``.
        splits: how many parts the score is averaged over (torch-fidelity's ``isc_splits``).
        seed: seed of the shuffle before the split (torch-fidelity's ``rng_seed``); ``None``: no shuffle.
        device: see ``fid_extractor``.
        precision: see ``fid_extractor``.
        extractor: a ``fid_extractor(dims=2048)`` to reuse; it fixes weights, mode, device and precision.
        **options: the ``StreamOptions``.

    Raises:
        InvalidValueError: fewer images than ``splits``, bad arguments, or ``extractor`` no FID extractor of the
            pool layer (or of another ``mode``).
        WeightsUnavailableError: the weights file is neither cached nor downloadable, or unusable.

    Examples:
        >>> import torch
        >>> from featurehooks.metrics.fid import fid_extractor
        >>> from featurehooks.metrics.isc import inception_score
        >>> _ = torch.manual_seed(0)
        >>> ext = fid_extractor(weights=None, mode="legacy_tensorflow", device="cpu")  # random init: not the network
        >>> mean, std = inception_score(torch.rand(4, 3, 32, 32), extractor=ext, splits=2)

    References:
        Salimans, Goodfellow, Zaremba, Cheung, Radford, Chen (2016). Improved Techniques for Training GANs.
        NeurIPS.
        Barratt, Sharma (2018). A Note on the Inception Score. arXiv:1801.01973.
        Obukhov, Seitzer, Wu, Zhydenko, Kyl, Lin (2020). torch-fidelity. https://github.com/toshas/torch-fidelity
    """
    check_count(splits, "splits", least=1)
    if options.get("shard") is not None:
        raise InvalidValueError("the Inception Score is of a whole set: shard= is for statistics and dumps")
    build = functools.partial(
        fid_extractor, weights, mode=mode or "legacy_tensorflow", device=device, precision=precision
    )
    extractor = given_or_built(extractor, build, weights, device, precision, mode=False)
    network = fid_network(extractor)
    if [tap.path for tap in extractor.taps] != [FID_LAYERS[2048]]:
        raise InvalidValueError(
            f"the Inception Score needs the pool features of the FID Inception (fid_extractor(dims=2048)); "
            f"extractor= returns {extractor.layers}"
        )
    stats = fid_statistics(source, mode=mode, extractor=extractor, keep=KEEP_ALL, **options)
    return inception_score_of_features(stats.features, network.fc.weight, splits, seed=seed)
