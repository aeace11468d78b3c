"""Perceptual metrics: calibrated LPIPS, and Fréchet distance and KID from streaming statistics of any backbone.

Examples:
    >>> import torch
    >>> from featurehooks import metrics
    >>> _ = torch.manual_seed(0)
    >>> real, fake = metrics.FeatureStatistics(keep=200), metrics.FeatureStatistics(keep=200)
    >>> _ = real.update(torch.randn(200, 16))  # the pooled features of a batch of images, say
    >>> _ = fake.update(torch.randn(200, 16) + 0.5)
    >>> metrics.frechet_distance(real, fake) > 1
    True
    >>> mean, std = metrics.kernel_inception_distance(real, fake, subsets=10, subset_size=100)
"""

from .cka import CKAMatrix, MinibatchCKA, cka
from .cka_sources import cka_matrix, cka_matrix_from_dumps
from .clip_mmd import CMMD_BACKBONE, cmmd, cmmd_embeddings, cmmd_extractor, cmmd_of_embeddings
from .collect import feature_statistics, feature_statistics_by_layer, statistics_from_dump
from .dinov2_fd import FD_DINOV2_MODELS, fd_dinov2, fd_dinov2_extractor, fd_dinov2_statistics
from .dists import DISTS
from .evaluation import METRICS, Evaluation, evaluate
from .fid import FID_LAYERS, FID_MODES, FIDMode, fid_extractor, fid_mode, fid_network, fid_statistics, load_mu_sigma
from .frechet import frechet_distance, kernel_inception_distance
from .interop import PooledFeatures
from .isc import inception_score, inception_score_of_features, inception_score_of_logits
from .lpips import LPIPS, find_heads, load_heads
from .merge import merge_statistics, merge_statistics_sets
from .pair_scores import BATCH_PIXELS, RunningSummary, ScoreSummary, iter_pair_scores, score_pairs
from .pairs import ImagePair, PairsWithin, pair_files, pairs_within
from .prdc import PRDC, Manifold, precision_recall
from .sample_size import FDInfinity, fd_bootstrap, fd_infinity
from .sfid import SFID_CHANNELS, SFID_LAYER, sfid, sfid_extractor, sfid_statistics, sfid_vectors
from .statistics import FeatureOrigin, FeatureStatistics, load_statistics, save_statistics

__all__ = [
    "BATCH_PIXELS",
    "CKAMatrix",
    "CMMD_BACKBONE",
    "DISTS",
    "Evaluation",
    "FD_DINOV2_MODELS",
    "FDInfinity",
    "FID_LAYERS",
    "FID_MODES",
    "FIDMode",
    "LPIPS",
    "METRICS",
    "PRDC",
    "SFID_CHANNELS",
    "SFID_LAYER",
    "FeatureOrigin",
    "FeatureStatistics",
    "ImagePair",
    "MinibatchCKA",
    "PairsWithin",
    "RunningSummary",
    "ScoreSummary",
    "Manifold",
    "PooledFeatures",
    "cka",
    "cka_matrix",
    "cka_matrix_from_dumps",
    "cmmd",
    "cmmd_embeddings",
    "cmmd_extractor",
    "cmmd_of_embeddings",
    "evaluate",
    "fd_bootstrap",
    "fd_dinov2",
    "fd_dinov2_extractor",
    "fd_dinov2_statistics",
    "fd_infinity",
    "feature_statistics",
    "feature_statistics_by_layer",
    "fid_extractor",
    "fid_mode",
    "fid_network",
    "fid_statistics",
    "find_heads",
    "frechet_distance",
    "inception_score",
    "inception_score_of_features",
    "inception_score_of_logits",
    "iter_pair_scores",
    "kernel_inception_distance",
    "load_heads",
    "load_mu_sigma",
    "load_statistics",
    "merge_statistics",
    "merge_statistics_sets",
    "pair_files",
    "pairs_within",
    "precision_recall",
    "save_statistics",
    "score_pairs",
    "sfid",
    "sfid_extractor",
    "sfid_statistics",
    "sfid_vectors",
    "statistics_from_dump",
]
