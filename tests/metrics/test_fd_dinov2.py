"""FD_DINOv2: statistics and distances equal those of DINOv2's own features (an oracle written from its
definitions in ``tests/backbones/test_dinov2.py``) of images prepared as dgm-eval prepares them."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

import featurehooks as fh
from featurehooks.metrics import FeatureOrigin, FeatureStatistics, frechet_distance
from featurehooks.metrics.dinov2_fd import fd_dinov2, fd_dinov2_extractor, fd_dinov2_statistics

from dinov2_reference import dgm_eval_transform, dinov2_oracle, write_photos

pytestmark = pytest.mark.filterwarnings("ignore:.*feature vectors in 384 dimensions:UserWarning")


@pytest.fixture(scope="module")
def vits14(dinov2_vits14_cached: dict[str, Tensor]) -> dict[str, Tensor]:
    return dinov2_vits14_cached


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two small sets: three photos, and the same three mirrored."""
    root = tmp_path_factory.mktemp("sets")
    write_photos(root / "real")
    write_photos(root / "fake", flip=True)
    return root / "real", root / "fake"


@pytest.fixture(scope="module")
def extractor(vits14: dict[str, Tensor]) -> fh.FeatureExtractor:
    """FD_DINOv2's extractor on the seeded ViT-S/14 release."""
    return fd_dinov2_extractor("vits14", device="cpu")


def oracle_moments(state: dict[str, Tensor], folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """dgm-eval's ``compute_statistics`` of DINOv2's features of the folder's images (its sorted files)."""
    batch = torch.stack([dgm_eval_transform(path) for path in sorted(folder.glob("*.png"))])
    with torch.no_grad():
        reps = dinov2_oracle(state, batch, heads=6).double().numpy()
    return reps.mean(axis=0), np.cov(reps, rowvar=False)


@pytest.fixture(scope="module")
def oracle(vits14: dict[str, Tensor], folders: tuple[Path, Path]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [oracle_moments(vits14, folder) for folder in folders]


@pytest.fixture(scope="module")
def statistics(folders: tuple[Path, Path], extractor: fh.FeatureExtractor) -> list[FeatureStatistics]:
    return [fd_dinov2_statistics(folder, extractor=extractor, num_workers=0) for folder in folders]


def test_statistics_equal_dinov2s(
    statistics: list[FeatureStatistics], oracle: list[tuple[np.ndarray, np.ndarray]]
) -> None:
    for stats, (mu, sigma) in zip(statistics, oracle):
        assert (stats.count, stats.dim) == (3, 384)
        assert np.abs(stats.mean.numpy() - mu).max() < 1e-5 * np.abs(mu).max()
        assert np.abs(stats.covariance.numpy() - sigma).max() < 1e-5 * np.abs(sigma).max()
    origin = statistics[0].origin
    assert origin is not None
    assert (origin.backbone, origin.layer, origin.pool, origin.weights) == (
        "dinov2_vits14",
        "norm",
        "cls",
        "dinov2_vits14_pretrain",
    )


def test_fd_dinov2_of_two_folders_equals_the_oracle(
    folders: tuple[Path, Path], oracle: list[tuple[np.ndarray, np.ndarray]], statistics: list[FeatureStatistics]
) -> None:
    found = fd_dinov2(*folders, model="vits14", device="cpu", num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # 3 vectors in 384 dimensions
        expected = frechet_distance(*oracle)
    assert expected > 1
    assert found == pytest.approx(expected, rel=1e-5)
    assert fd_dinov2(*statistics) == pytest.approx(found, rel=1e-12)  # precomputed statistics: no pass at all


def test_fid_statistics_are_refused(statistics: list[FeatureStatistics]) -> None:
    """Statistics as ``fid_statistics`` records them (of as many features, so only the origin differs)."""
    origin = FeatureOrigin("fid_inception", "avgpool", "avg", "pt_inception-2015-12-05-6726825d")
    fid = FeatureStatistics(origin=origin).update(torch.randn(8, 384))
    for compare in (frechet_distance, fd_dinov2):
        with pytest.raises(fh.errors.InvalidValueError, match="different features.*backbone 'dinov2_vits14'"):
            compare(statistics[0], fid)


def test_bad_arguments(extractor: fh.FeatureExtractor) -> None:
    with pytest.raises(fh.errors.InvalidValueError, match="vitl14"):
        fd_dinov2_extractor("vitl16")
    with pytest.raises(fh.errors.InvalidValueError, match="extractor="):
        fd_dinov2_statistics(torch.rand(2, 3, 28, 28), extractor=extractor, model="vits14")
    other = fh.FeatureExtractor("dinov2_vits14", ["blocks.11"], weights=None)
    with pytest.raises(fh.errors.InvalidValueError, match="'norm'"):
        fd_dinov2_statistics(torch.rand(2, 3, 28, 28), extractor=other)
