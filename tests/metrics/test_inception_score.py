"""The Inception Score against torch-fidelity's ``isc`` on the same seeded weights and images.

torch-fidelity reads the seeded FID weights under its own file name (its state-dict names are pytorch-fid's);
``fc`` is scaled up so that the seeded network's classes are confident enough for a score well above 1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.errors import InvalidValueError
from featurehooks.metrics.fid import fid_extractor
from featurehooks.metrics.isc import (
    inception_score,
    inception_score_of_features,
    inception_score_of_logits,
)

torch_fidelity = pytest.importorskip("torch_fidelity")
from torch_fidelity.metric_isc import isc_features_to_metric  # noqa: E402

from helpers import SEED  # noqa: E402

SPLITS = 3
FC_GAIN = 60.0  # the seeded fc gives IS ~1.0002 (logits of small spread); scaled, a score well above 1


@pytest.fixture(scope="module")
def weights(fid_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded FID weights with a sharper ``fc``, under torch-fidelity's file name and (identical) key names."""
    state = torch.load(fid_weights, weights_only=True)
    state["fc.weight"] = state["fc.weight"] * FC_GAIN
    path = tmp_path_factory.mktemp("isc") / "weights-inception-2015-12-05-6726825d.pth"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten PNGs of one odd size (torch-fidelity stacks a batch: one size per folder)."""
    root = tmp_path_factory.mktemp("isc_images")
    rng = np.random.default_rng(SEED)
    for i in range(10):
        smooth = np.kron(rng.integers(0, 256, (5, 7, 3)), np.ones((7, 7, 1))).astype(np.uint8)  # 35 x 49
        Image.fromarray(smooth).save(root / f"{i}.png")
    return root


@pytest.mark.slow  # a reference oracle with networks of its own
def test_inception_score_is_torch_fidelitys(weights: Path, folder: Path) -> None:
    theirs = torch_fidelity.calculate_metrics(
        input1=str(folder),
        isc=True,
        isc_splits=SPLITS,
        feature_extractor_weights_path=str(weights),
        cuda=False,
        verbose=False,
        cache=False,
        batch_size=4,
        save_cpu_ram=True,
    )
    mean, std = inception_score(folder, weights=weights, splits=SPLITS, device="cpu", num_workers=0, batch_size=4)
    expected_mean, expected_std = theirs["inception_score_mean"], theirs["inception_score_std"]
    assert expected_mean > 1.05, expected_mean  # a score that says something (1.08)
    # the std of a few split scores is their difference: its error is the scores' own, so it is measured against the
    # mean (seen on an AVX-512 EPYC: 2.9e-7 apart, 1.5e-5 of the std, 2.7e-7 of the mean)
    assert mean == pytest.approx(expected_mean, rel=1e-5) and std == pytest.approx(expected_std, abs=1e-5 * mean)


def test_logits_score_is_torch_fidelitys_arithmetic() -> None:
    logits = torch.randn(23, 1008, generator=torch.Generator().manual_seed(SEED)) * 4
    expected = isc_features_to_metric(logits, splits=5, rng_seed=7)
    assert inception_score_of_logits(logits, 5, seed=7) == (
        expected["inception_score_mean"],
        expected["inception_score_std"],
    )
    unshuffled = isc_features_to_metric(logits, splits=5, shuffle=False)
    assert inception_score_of_logits(logits.numpy(), 5, seed=None)[0] == unshuffled["inception_score_mean"]


def test_features_score_is_the_logits_score() -> None:
    generator = torch.Generator().manual_seed(SEED)
    features, weight = torch.rand(12, 16, generator=generator), torch.randn(10, 16, generator=generator)
    assert inception_score_of_features(features, weight, 4) == inception_score_of_logits(features @ weight.T, 4)


def test_bad_input_is_refused(fid_weights: Path) -> None:
    with pytest.raises(InvalidValueError, match="needs at least 10 images, got 3"):
        inception_score_of_logits(torch.zeros(3, 5))
    with pytest.raises(InvalidValueError, match=r"must be \(N, K\)"):
        inception_score_of_logits(torch.zeros(3))
    with pytest.raises(InvalidValueError, match="NaN"):
        inception_score_of_logits(torch.full((3, 2), float("nan")), 1)
    with pytest.raises(InvalidValueError, match="pool features"):
        inception_score(torch.rand(2, 3, 8, 8), extractor=fid_extractor(weights=None, dims=64, device="cpu"))
    with pytest.raises(InvalidValueError, match="did you mean"):
        inception_score(torch.rand(2, 3, 8, 8), mode="clen")  # type: ignore[arg-type]
