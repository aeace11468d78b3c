"""sFID against the ADM evaluator's definition, computed on torch-fidelity's port of the TensorFlow graph (its TF1
resize, the same seeded weights): ``mixed_6/conv``'s first 7 channels, flattened NHWC, their mean and covariance,
and the Fréchet distance of pytorch-fid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.errors import InvalidValueError
from featurehooks.metrics import (
    SFID_LAYER,
    fid_extractor,
    fid_statistics,
    frechet_distance,
    sfid_extractor,
    sfid_statistics,
    sfid_vectors,
)

from helpers import SEED

OPTIONS = {"num_workers": 0, "batch_size": 4}
pytestmark = pytest.mark.filterwarnings("ignore:.*feature vectors in .* dimensions:UserWarning")


def _folder(root: Path, seed: int, count: int = 6) -> Path:
    """``count`` smooth PNGs of one odd size (torch-fidelity stacks a batch: one size per folder)."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    for i in range(count):
        smooth = np.kron(rng.integers(0, 256, (5, 7, 3)), np.ones((7, 7, 1))).astype(np.uint8)  # 35 x 49
        Image.fromarray(smooth).save(root / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sfid")
    return _folder(root / "real", SEED), _folder(root / "fake", SEED + 1)


def _adm_statistics(folder: Path, weights: Path) -> tuple[np.ndarray, np.ndarray]:
    """The ADM evaluator's spatial statistics of ``folder``: ``mixed_6/conv`` is the first 192 channels of
    ``Mixed_6d``'s output; its first 7, NHWC, one row per image; ``np.mean`` and ``np.cov``."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    network = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(weights))
    maps: list[torch.Tensor] = []
    handle = network.Mixed_6d.register_forward_hook(lambda _, __, out: maps.append(out[..., :7, :, :]))
    images = [torch.from_numpy(np.array(Image.open(path))).permute(2, 0, 1) for path in sorted(folder.glob("*.png"))]
    with torch.no_grad():
        network(torch.stack(images))
    handle.remove()
    rows = maps[0].permute(0, 2, 3, 1).reshape(len(images), -1).double().numpy()  # spatial[..., :7] of NHWC
    return rows.mean(axis=0), np.cov(rows, rowvar=False)


@pytest.mark.slow  # a reference oracle with a network of its own
def test_sfid_is_the_adm_evaluators_on_torch_fidelitys_graph(sets: tuple[Path, Path], fid_weights: Path) -> None:
    pytest.importorskip("torch_fidelity")
    theirs = [_adm_statistics(folder, fid_weights) for folder in sets]
    ours = [sfid_statistics(folder, weights=fid_weights, device="cpu", **OPTIONS) for folder in sets]
    for (mu, sigma), stats in zip(theirs, ours):
        assert stats.dim == 7 * 17 * 17 and stats.origin.lineage == "legacy_tensorflow"
        np.testing.assert_allclose(stats.mean.numpy(), mu, rtol=1e-5, atol=1e-6 * np.abs(mu).max())
        np.testing.assert_allclose(stats.covariance.numpy(), sigma, rtol=0, atol=1e-5 * np.abs(sigma).max())
    expected = frechet_distance(*(tuple(map(torch.from_numpy, pair)) for pair in theirs))  # as pytorch-fid's: test_fid
    assert expected > 0 and frechet_distance(*ours) == pytest.approx(expected, rel=1e-5)


def test_vectors_are_the_first_seven_channels_in_nhwc_order() -> None:
    maps = torch.randn(2, 192, 17, 17, generator=torch.Generator().manual_seed(SEED))
    expected = maps.numpy().transpose(0, 2, 3, 1)[..., :7].reshape(2, -1)  # the evaluator's spatial[..., :7]
    np.testing.assert_array_equal(sfid_vectors(maps).numpy(), expected)
    with pytest.raises(InvalidValueError, match="C >= 7"):
        sfid_vectors(maps[:, :6])


def test_the_forward_stops_after_the_spatial_layer() -> None:
    extractor = sfid_extractor(weights=None, device="cpu")
    later: list[str] = []
    extractor.backbone.Mixed_6e.register_forward_pre_hook(lambda *_: later.append("Mixed_6e"))
    assert extractor(torch.rand(1, 3, 40, 40))[SFID_LAYER].shape == (1, 192, 17, 17)
    assert later == []


@pytest.mark.slow  # a reference oracle with networks of its own
def test_statistics_compare_only_with_sfid_statistics_of_their_lineage() -> None:
    images = torch.rand(3, 3, 30, 30, generator=torch.Generator().manual_seed(SEED))
    torch.manual_seed(SEED)
    tensorflow = sfid_statistics(images, weights=None, device="cpu", **OPTIONS)
    pytorch = sfid_statistics(images, weights=None, mode="legacy_pytorch", device="cpu", **OPTIONS)
    with pytest.raises(InvalidValueError, match="lineage"):
        frechet_distance(tensorflow, pytorch)
    fid = fid_statistics(images, weights=None, mode="legacy_tensorflow", device="cpu", **OPTIONS)
    with pytest.raises(InvalidValueError, match="different features"):
        frechet_distance(tensorflow, fid)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resize_size": 64}, "sFID takes no resize_size"),
        ({"mode": "tensorflow"}, "legacy_tensorflow"),
        ({"extractor": "fid"}, "must be an sfid_extractor"),
        ({"extractor": "sfid", "mode": "clean"}, "must be an sfid_extractor.* of mode 'clean'"),
        ({"extractor": "sfid", "weights": None}, "already fixes"),
    ],
)
def test_bad_requests_are_refused_before_any_image_is_read(kwargs: dict[str, object], message: str) -> None:
    built = {"fid": lambda: fid_extractor(weights=None, device="cpu"), "sfid": lambda: sfid_extractor(None)}
    if "extractor" in kwargs:
        kwargs["extractor"] = built[kwargs["extractor"]]()  # type: ignore[index]
    with pytest.raises(InvalidValueError, match=message):
        sfid_statistics("no/such/folder", **kwargs)  # type: ignore[arg-type]
