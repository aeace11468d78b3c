"""FD∞ and the bootstrap interval, against the procedures written out with pytorch-fid's distance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytorch_fid.fid_score import calculate_frechet_distance

from featurehooks.errors import InvalidValueError
from featurehooks.metrics import FeatureOrigin, FeatureStatistics, fd_bootstrap, fd_infinity


def _sets() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    real = torch.randn(3000, 12, generator=generator, dtype=torch.float64)
    mix = torch.randn(12, 12, generator=generator, dtype=torch.float64) * 0.2
    fake = torch.randn(1500, 12, generator=generator, dtype=torch.float64) @ (torch.eye(12) + mix) + 0.3
    return real, fake


def _pytorch_fid(real: np.ndarray, subset: np.ndarray) -> float:
    return float(
        calculate_frechet_distance(
            real.mean(0), np.cov(real, rowvar=False), subset.mean(0), np.cov(subset, rowvar=False)
        )
    )


def test_fd_infinity_is_chong_and_forsyths_line_through_pytorch_fid_distances() -> None:
    """Sizes as np.linspace(...).astype(int), one fresh permutation per size, a least-squares line in 1/N."""
    real, fake = _sets()
    fit = fd_infinity(real, fake, points=6, smallest=300, seed=3)
    sizes = np.linspace(300, 1500, 6).astype("int32")
    generator = torch.Generator().manual_seed(3)
    distances = [_pytorch_fid(real.numpy(), fake[torch.randperm(1500, generator=generator)[:n]].numpy()) for n in sizes]
    design = np.stack([np.ones(len(sizes)), 1 / sizes], axis=1)
    (value, slope), *_ = np.linalg.lstsq(design, np.asarray(distances), rcond=None)
    assert fit.sizes == tuple(int(n) for n in sizes)
    np.testing.assert_allclose(fit.distances, distances, rtol=1e-9)
    assert fit.value == pytest.approx(value, rel=1e-8) and fit.slope == pytest.approx(slope, rel=1e-8)
    assert fit.value < min(fit.distances) and fit.slope > 0  # the bias of a finite N is upward


def test_fd_bootstrap_is_the_percentile_interval_of_resampled_distances() -> None:
    real, fake = _sets()
    low, high = fd_bootstrap(real, fake, rounds=20, level=0.9, seed=1)
    generator = torch.Generator().manual_seed(1)
    distances = [
        _pytorch_fid(real.numpy(), fake[torch.randint(1500, (1500,), generator=generator)].numpy()) for _ in range(20)
    ]
    expected = np.quantile(distances, [0.05, 0.95])
    np.testing.assert_allclose([low, high], expected, rtol=1e-9)
    assert low < _pytorch_fid(real.numpy(), fake.numpy()) < high


def test_statistics_take_part_with_every_vector_kept() -> None:
    real, fake = _sets()
    origin = FeatureOrigin("resnet18", "layer4", "avg", "DEFAULT")
    kept_all = FeatureStatistics(keep=1500, origin=origin).update(fake)
    a = fd_infinity(FeatureStatistics(origin=origin).update(real), kept_all, points=3, smallest=500)
    b = fd_infinity(real, fake.float(), points=3, smallest=500)  # statistics keep float32 vectors
    assert a == b
    with pytest.raises(InvalidValueError, match="kept 1000 of their 1500 vectors; .* keep >= 1500"):
        fd_bootstrap(real, FeatureStatistics(keep=1000).update(fake))
    with pytest.raises(InvalidValueError, match="different features"):
        fd_infinity(
            FeatureStatistics(origin=FeatureOrigin("resnet18", "layer3", "avg", "DEFAULT")).update(real), kept_all
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"smallest": 1500}, "smallest must be an int from 2 to below the 1500 vectors"),
        ({"smallest": 1}, "smallest must be"),
        ({"points": 1}, "points must be an int >= 2"),
        ({"points": True}, "points must be"),
    ],
)
def test_fd_infinity_refuses_bad_options(options: dict[str, int], message: str) -> None:
    real, fake = _sets()
    with pytest.raises(InvalidValueError, match=message):
        fd_infinity(real, fake, **options)


@pytest.mark.parametrize(("options", "message"), [({"rounds": 1}, "rounds must"), ({"level": 1.0}, "level must")])
def test_fd_bootstrap_refuses_bad_options(options: dict[str, float], message: str) -> None:
    real, fake = _sets()
    with pytest.raises(InvalidValueError, match=message):
        fd_bootstrap(real, fake, **options)  # type: ignore[arg-type]
