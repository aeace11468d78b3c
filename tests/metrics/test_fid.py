"""FID as pytorch-fid computes it: the ``fid_inception`` backbone, ``fid_statistics`` and ``load_mu_sigma``.

pytorch-fid is the oracle. A seeded weights file is written where both read it (the torch hub cache, under
pytorch-fid's file name), so its ``InceptionV3`` and our backbone run the same weights offline; pytorch-fid
loading the file at all shows that our state-dict names are its own.
"""

from __future__ import annotations

import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
from featurehooks.backbones.fid_inception import (
    FID_WEIGHTS_URL,
    load_fid_inception,
)
from featurehooks.metrics import FID_LAYERS, fid_extractor, fid_statistics, frechet_distance, load_mu_sigma

pytorch_fid = pytest.importorskip("pytorch_fid")
from pytorch_fid.fid_score import calculate_activation_statistics, calculate_frechet_distance  # noqa: E402
from pytorch_fid.inception import InceptionV3  # noqa: E402

from helpers import SEED  # noqa: E402


@pytest.fixture(scope="module")
def oracle(fid_weights: Path) -> InceptionV3:
    """pytorch-fid's network with all four blocks, loading the seeded file from the hub cache."""
    return InceptionV3([0, 1, 2, 3]).eval()


@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five images of four sizes: RGB PNGs of odd sizes (two share one), a grayscale PNG, an RGB JPEG."""
    folder = tmp_path_factory.mktemp("fid_images")
    rng = np.random.default_rng(SEED)
    for name, size in (("a.png", (37, 53)), ("b.png", (37, 53)), ("c.png", (64, 29))):
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / name)
    Image.fromarray(rng.integers(0, 256, (41, 41), dtype=np.uint8), mode="L").save(folder / "d.png")
    smooth = np.kron(rng.integers(0, 256, (9, 12, 3)), np.ones((5, 5, 1))).astype(np.uint8)  # JPEG-like content
    Image.fromarray(smooth).save(folder / "e.jpg", quality=90)
    return folder


def _close(ours: torch.Tensor | np.ndarray, theirs: torch.Tensor | np.ndarray, tolerance: float = 1e-5) -> None:
    """Equal to ``tolerance`` of the oracle's scale (its largest magnitude)."""
    ours, theirs = torch.as_tensor(np.asarray(ours), dtype=torch.float64), torch.as_tensor(np.asarray(theirs))
    theirs = theirs.to(torch.float64)
    assert ours.shape == theirs.shape
    scale = float(theirs.abs().max())
    assert scale > 0
    assert float((ours - theirs).abs().max()) <= tolerance * scale


# -- the backbone ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_pytorch_fid_block_is_a_named_layer(oracle: InceptionV3) -> None:
    """pytorch-fid's four blocks are maxpool1, maxpool2, Mixed_6e and avgpool, resize and scaling included."""
    images = torch.rand(2, 3, 37, 53, generator=torch.Generator().manual_seed(SEED))
    extractor = fh.FeatureExtractor("fid_inception", list(FID_LAYERS.values()))
    with torch.no_grad():
        theirs = oracle(images)
    ours = extractor(images)
    for expected, feature in zip(theirs, ours.values()):
        _close(feature, expected)
    assert ours["avgpool"].shape == (2, 2048, 1, 1)


def test_weights_file_default_local_and_half(fid_weights: Path, tmp_path: Path) -> None:
    default = load_fid_inception()
    assert default.name == "fid_inception" and default.weights == "pt_inception-2015-12-05-6726825d"
    half = tmp_path / "half.pth"
    torch.save({key: value.half() for key, value in torch.load(fid_weights, weights_only=True).items()}, half)
    local = load_fid_inception(half)
    assert local.weights == str(half)
    assert all(p.dtype == torch.float32 for p in local.model.parameters())  # a half file keeps float32
    assert fh.load_backbone("fid_inception", weights=None).weights is None
    assert default.preprocessing == fh.Preprocessing()  # the model resizes and scales itself


def test_missing_weights_name_the_file_folder_and_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def offline(url: str, dst: str, *args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(fh.WeightsUnavailableError) as info:
        fid_statistics(torch.rand(2, 3, 16, 16), device="cpu")
    message = str(info.value)
    assert "pt_inception-2015-12-05-6726825d.pth" in message
    assert str(tmp_path / "empty" / "hub" / "checkpoints") in message
    assert FID_WEIGHTS_URL in message and "weights=None" in message


def test_other_weights_and_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(fh.WeightsUnavailableError, match="one set of weights, 'DEFAULT'"):
        fh.load_backbone("fid_inception", weights="IMAGENET1K_V1")
    wrong = tmp_path / "inception_v3.pth"
    torch.save({"fc.weight": torch.zeros(1000, 2048)}, wrong)
    with pytest.raises(fh.WeightsUnavailableError, match="do not fit"):
        fh.load_backbone("fid_inception", weights=wrong)


def test_layers_are_listed_without_weights() -> None:
    rows = {row.name: row for row in fh.list_layers("fid_inception")}  # meta device: no file needed
    assert rows["avgpool"].channels == 2048 and rows["Mixed_6e"].channels == 768 and rows["fc"].channels == 1008
    assert rows["Mixed_7c"].type == "_FIDInceptionE"
    with pytest.raises(fh.LayerNotFoundError, match="avgpool"):
        fh.FeatureExtractor("fid_inception", ["avgpol"], weights=None)


# -- images as pytorch-fid reads them --------------------------------------------------------------------
def test_files_are_read_as_pytorch_fid_reads_them(mixed_folder: Path) -> None:
    for path in sorted(mixed_folder.iterdir()):
        with Image.open(path) as image:
            theirs = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float().div(255)
        assert torch.equal(fh.images.decode_image(path), theirs), path.name


# -- statistics ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder_statistics(mixed_folder: Path, oracle: InceptionV3) -> tuple[fh.metrics.FeatureStatistics, tuple]:
    """Ours (a batch of several sizes) and pytorch-fid's (one image per batch: it stacks each batch)."""
    ours = fid_statistics(mixed_folder, device="cpu", batch_size=4, num_workers=0)
    files = sorted(mixed_folder.iterdir())
    theirs = calculate_activation_statistics(files, InceptionV3([3]).eval(), batch_size=1, num_workers=0)
    return ours, theirs


@pytest.mark.slow
def test_statistics_equal_pytorch_fids(folder_statistics: tuple) -> None:
    ours, (mu, sigma) = folder_statistics
    assert ours.count == 5 and ours.dim == 2048
    _close(ours.mean, mu)
    _close(ours.covariance, sigma)
    origin = ours.origin
    assert (origin.backbone, origin.layer, origin.pool) == ("fid_inception", "avgpool", "avg")
    assert origin.preprocessing == {"resize_size": None, "crop_size": None, "interpolation": "bilinear"}


def test_tensors_and_lower_dims_equal_pytorch_fids(fid_weights: Path) -> None:
    images = torch.rand(3, 3, 40, 40, generator=torch.Generator().manual_seed(SEED))
    stats = fid_statistics(images, dims=64, device="cpu", num_workers=0)
    with torch.no_grad():
        block = InceptionV3([0]).eval()(images)[0].mean(dim=(2, 3)).double()  # pytorch-fid's --dims 64
    _close(stats.mean, block.mean(0))
    _close(stats.covariance, torch.cov(block.T))
    assert stats.origin.layer == "maxpool1"


def test_frechet_distance_of_pytorch_fids_own_moments_is_theirs() -> None:
    """Above D vectors the two formulas agree to rounding (below, pytorch-fid's sqrtm is unstable)."""
    rng = np.random.default_rng(SEED)
    a, b = rng.standard_normal((300, 64)), rng.standard_normal((300, 64)) * 1.5 + 0.2
    moments = [(x.mean(0), np.cov(x, rowvar=False)) for x in (a, b)]
    assert frechet_distance(*moments) == pytest.approx(calculate_frechet_distance(*moments[0], *moments[1]), rel=1e-9)


def test_extractor_is_reused_and_checked(fid_weights: Path) -> None:
    images = torch.rand(2, 3, 20, 20, generator=torch.Generator().manual_seed(SEED))
    extractor = fid_extractor(device="cpu", dims=192)
    assert extractor.memory_format == "contiguous"  # NCHW, as pytorch-fid computes
    assert fid_statistics(images, extractor=extractor, num_workers=0).origin.layer == "maxpool2"
    with pytest.raises(fh.InvalidValueError, match="either extractor= or weights="):
        fid_statistics(images, extractor=extractor, dims=2048, weights=None)
    with pytest.raises(fh.InvalidValueError, match="one FID layer"):
        fid_statistics(images, extractor=fh.FeatureExtractor("resnet18", ["layer4"], weights=None))
    with pytest.raises(fh.InvalidValueError, match="dims must be one of"):
        fid_statistics(images, dims=1000)


# -- statistics files ----------------------------------------------------------------------------------------
def test_load_mu_sigma_reads_pytorch_fid_and_featurehooks_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(SEED)
    mu, sigma = rng.standard_normal(8), np.cov(rng.standard_normal((20, 8)), rowvar=False)
    theirs = tmp_path / "theirs.npz"
    np.savez_compressed(theirs, mu=mu.astype(np.float32), sigma=sigma)  # pytorch-fid's --save-stats
    loaded_mu, loaded_sigma = load_mu_sigma(theirs)
    assert loaded_mu.dtype == torch.float64 and torch.equal(loaded_mu, torch.from_numpy(mu.astype(np.float32)).double())
    assert torch.equal(loaded_sigma, torch.from_numpy(sigma))
    ours = fh.metrics.FeatureStatistics().update(torch.from_numpy(rng.standard_normal((20, 8))))
    ours.save(tmp_path / "ours.npz")
    assert torch.equal(load_mu_sigma(tmp_path / "ours.npz")[1], ours.covariance)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"mu": np.zeros(3)}, "no sigma array"),
        ({"mu": np.zeros(3), "sigma": np.eye(4)}, "expected \\(D,\\) and \\(D, D\\)"),
        ({"mu": np.full(2, np.nan), "sigma": np.eye(2)}, "NaN"),
        ({"mu": np.array(["a", "b"]), "sigma": np.eye(2)}, "not real numbers"),
    ],
)
def test_load_mu_sigma_refuses_what_is_no_fid_file(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(fh.InvalidValueError, match=message):
        load_mu_sigma(path)


def test_load_mu_sigma_never_unpickles(tmp_path: Path) -> None:
    path = tmp_path / "pickle.npz"
    path.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(fh.InvalidValueError, match="not an .npz archive"):
        load_mu_sigma(path)
    with pytest.raises(fh.InputNotFoundError):
        load_mu_sigma(tmp_path / "missing.npz")
