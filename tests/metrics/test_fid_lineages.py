"""The three FID lineages (``mode=``): each one's network input and statistics against its reference tool.

``legacy_tensorflow`` against torch-fidelity (its TensorFlow 1 bilinear resize, and its own network on the same
seeded weights, whose state-dict names are pytorch-fid's), ``clean`` against clean-fid (its Pillow resizer, then
pytorch-fid's network without a resize), ``legacy_pytorch`` against today's forward, bitwise. Photos of odd sizes
(scikit-image's), a grayscale and an RGBA one, decoded as featurehooks decodes files.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from featurehooks.backbones._fid_resize import LINEAGES, fid_input
from featurehooks.errors import InvalidValueError
from featurehooks.images import read_image
from featurehooks.metrics import FeatureOrigin, FeatureStatistics, frechet_distance
from featurehooks.metrics.fid import fid_extractor, fid_mode, fid_network, fid_statistics

skimage_data = pytest.importorskip("skimage.data")
pytest.importorskip("torch_fidelity")
pytest.importorskip("cleanfid")
pytest.importorskip("pytorch_fid")
from cleanfid.resize import make_resizer  # noqa: E402
from pytorch_fid.inception import InceptionV3  # noqa: E402
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3  # noqa: E402
from torch_fidelity.interpolate_compat_tensorflow import interpolate_bilinear_2d_like_tensorflow1x  # noqa: E402

RUN = {"num_workers": 0, "batch_size": 4}


def photo_folder(root: Path, crops: dict[str, np.ndarray]) -> Path:
    root.mkdir()
    for name, pixels in crops.items():
        Image.fromarray(pixels).save(root / f"{name}.png")
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three photos: downscaled in one side and upscaled in the other; grayscale, upscaled; RGBA, upscaled."""
    return photo_folder(
        tmp_path_factory.mktemp("lineages") / "a",
        {
            "chelsea": skimage_data.chelsea(),  # 300 x 451
            "camera": skimage_data.camera()[200:297, 150:273],  # grayscale 97 x 123
            "logo": skimage_data.logo()[100:223, 150:263],  # RGBA 123 x 113
        },
    )


@pytest.fixture(scope="module")
def decoded(photos: Path, fid_weights: Path) -> list[torch.Tensor]:
    """The photos as featurehooks reads them: (3, H, W) uint8 (gray repeated, alpha composited on white)."""
    return [read_image(path) for path in sorted(photos.glob("*.png"))]


def fidelity_weights(fid_weights: Path, folder: Path) -> Path:
    """The seeded file under torch-fidelity's name, its tensors converted to torch-fidelity's state-dict names:
    they are pytorch-fid's, so the conversion renames nothing, and torch-fidelity's strict ``load_state_dict``
    reading the file shows it."""
    state = torch.load(fid_weights, weights_only=True)
    path = folder / "weights-inception-2015-12-05-6726825d.pth"
    torch.save({FIDELITY_NAMES.get(name, name): value for name, value in state.items()}, path)
    return path


FIDELITY_NAMES: dict[str, str] = {}  # featurehooks' (pytorch-fid's) name -> torch-fidelity's, where they differ


@pytest.fixture(scope="module")
def fidelity(fid_weights: Path, tmp_path_factory: pytest.TempPathFactory) -> FeatureExtractorInceptionV3:
    """torch-fidelity's network, pool features, on the seeded weights."""
    path = fidelity_weights(fid_weights, tmp_path_factory.mktemp("fidelity"))
    return FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))


@pytest.fixture(scope="module")
def pytorch_fid_trunk(fid_weights: Path) -> InceptionV3:
    """pytorch-fid's network taking inputs already at 299 and in [-1, 1]: the network after clean-fid's resize."""
    return InceptionV3([3], resize_input=False, normalize_input=False).eval()


def clean_resize(image: torch.Tensor) -> torch.Tensor:
    """clean-fid's resize of one (3, H, W) uint8 image: (3, 299, 299) float32 levels."""
    resized = make_resizer("PIL", False, "bicubic", (299, 299))(image.permute(1, 2, 0).numpy())
    return torch.from_numpy(resized).permute(2, 0, 1)


def tensorflow_resize(image: torch.Tensor) -> torch.Tensor:
    """torch-fidelity's resize of one (3, H, W) uint8 image: (3, 299, 299) float32 levels."""
    return interpolate_bilinear_2d_like_tensorflow1x(image[None].float(), size=(299, 299), align_corners=False)[0]


def network_inputs(mode: str, images: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the first convolution of ``fid_extractor(mode=mode)`` receives for each uint8 image."""
    extractor = fid_extractor(mode=mode, device="cpu")  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    handle = fid_network(extractor).Conv2d_1a_3x3.register_forward_pre_hook(lambda _, args: seen.append(args[0][0]))
    try:
        for image in images:
            extractor(image[None].float() / 255)
    finally:
        handle.remove()
    return seen


def reference_statistics(features: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    matrix = torch.cat(features).double().numpy()
    return matrix.mean(axis=0), np.cov(matrix, rowvar=False)


def assert_close(ours: torch.Tensor | np.ndarray, theirs: torch.Tensor | np.ndarray, tolerance: float) -> float:
    """Equal to ``tolerance`` of the reference's largest magnitude; the relative difference found."""
    ours, theirs = np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape
    found = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    assert found <= tolerance, found
    return found


# -- (1) the network's input is the reference resize ---------------------------------------------------
def test_legacy_tensorflow_input_is_torch_fidelitys_resize(decoded: list[torch.Tensor]) -> None:
    for image, ours in zip(decoded, network_inputs("legacy_tensorflow", decoded)):
        assert_close(ours, (tensorflow_resize(image) - 128) / 128, 1e-7)


def test_clean_input_is_clean_fids_resize(decoded: list[torch.Tensor]) -> None:
    for image, ours in zip(decoded, network_inputs("clean", decoded)):
        assert_close(ours, (clean_resize(image) - 128) / 128, 1e-7)


def test_legacy_pytorch_input_is_pytorch_fids_resize(decoded: list[torch.Tensor]) -> None:
    for image, ours in zip(decoded, network_inputs("legacy_pytorch", decoded)):
        floats = image[None].float() / 255
        expected = 2 * F.interpolate(floats, size=(299, 299), mode="bilinear", align_corners=False) - 1
        assert torch.equal(ours, expected[0])


def test_floats_are_rounded_to_levels_for_legacy_tensorflow_only() -> None:
    floats = torch.rand(1, 3, 17, 23, generator=torch.Generator().manual_seed(0))
    levels = (floats * 255).round() / 255
    assert torch.equal(fid_input(floats, "legacy_tensorflow"), fid_input(levels, "legacy_tensorflow"))
    assert not torch.equal(fid_input(floats, "clean"), fid_input(levels, "clean"))


# -- (2) statistics equal a hand-written reference pipeline ---------------------------------------------
@pytest.fixture(scope="module")
def lineage_statistics(photos: Path, fid_weights: Path) -> dict[str, FeatureStatistics]:
    return {mode: fid_statistics(photos, mode=mode, device="cpu", **RUN) for mode in LINEAGES}  # type: ignore[arg-type]


@pytest.mark.slow  # a reference network of its own
def test_legacy_tensorflow_statistics_are_torch_fidelitys(
    lineage_statistics: dict[str, FeatureStatistics], decoded: list[torch.Tensor], fidelity: FeatureExtractorInceptionV3
) -> None:
    with torch.no_grad():
        mu, sigma = reference_statistics([fidelity(image[None])[0] for image in decoded])
    stats = lineage_statistics["legacy_tensorflow"]
    assert_close(stats.mean, mu, 1e-6)
    assert_close(stats.covariance, sigma, 1e-6)


@pytest.mark.slow  # a reference network of its own
def test_clean_statistics_are_clean_fids(
    lineage_statistics: dict[str, FeatureStatistics], decoded: list[torch.Tensor], pytorch_fid_trunk: InceptionV3
) -> None:
    with torch.no_grad():
        features = [pytorch_fid_trunk((clean_resize(image)[None] - 128) / 128)[0].flatten(1) for image in decoded]
    mu, sigma = reference_statistics(features)
    stats = lineage_statistics["clean"]
    assert_close(stats.mean, mu, 1e-6)
    assert_close(stats.covariance, sigma, 1e-6)


def test_lineages_record_themselves_and_differ(lineage_statistics: dict[str, FeatureStatistics]) -> None:
    for mode, stats in lineage_statistics.items():
        assert stats.origin is not None and stats.origin.lineage == mode
    means = [stats.mean for stats in lineage_statistics.values()]
    assert not torch.equal(means[0], means[1]) and not torch.equal(means[1], means[2])


# -- (3) legacy_pytorch is today's, bitwise ---------------------------------------------------------------
def test_legacy_pytorch_is_todays_forward_bitwise(decoded: list[torch.Tensor], fid_weights: Path) -> None:
    extractor = fid_extractor(device="cpu")
    assert fid_mode(extractor) == "legacy_pytorch"
    network = fid_network(extractor)
    captured: list[torch.Tensor] = []
    handle = network.avgpool.register_forward_hook(lambda _m, _a, out: captured.append(out))
    image = decoded[0][None].float() / 255
    try:
        with torch.no_grad():  # today's forward: resize and scale written out, then the blocks
            network._forward(2 * F.interpolate(image, size=(299, 299), mode="bilinear", align_corners=False) - 1)
    finally:
        handle.remove()
    assert torch.equal(extractor(image)["avgpool"], captured[0])


def test_legacy_pytorch_files_are_written_as_before(
    lineage_statistics: dict[str, FeatureStatistics], tmp_path: Path
) -> None:
    """No lineage in a legacy_pytorch file's meta (earlier versions read it); the others name theirs."""
    for mode, stats in lineage_statistics.items():
        path = stats.save(tmp_path / f"{mode}.npz")
        with zipfile.ZipFile(path) as archive, archive.open("meta.npy") as handle:
            meta = json.loads(str(np.lib.format.read_array(handle)[()]))
        assert meta["origin"].get("lineage") == (None if mode == "legacy_pytorch" else mode)
        assert FeatureStatistics.load(path).origin.lineage == mode  # type: ignore[union-attr]


# -- (4) lineages are never compared ----------------------------------------------------------------------
def test_statistics_of_two_lineages_refuse_to_be_compared(
    lineage_statistics: dict[str, FeatureStatistics], tmp_path: Path
) -> None:
    tensorflow, clean = lineage_statistics["legacy_tensorflow"], lineage_statistics["clean"]
    with pytest.raises(InvalidValueError, match="lineage 'legacy_tensorflow' vs 'clean'"):
        frechet_distance(tensorflow, clean)  # checked before any arithmetic
    with pytest.raises(InvalidValueError, match="lineage"):
        FeatureStatistics.load(tensorflow.save(tmp_path / "tf.npz")).merge(clean)
    clean.check_matches(FeatureStatistics.load(clean.save(tmp_path / "clean.npz")))  # one lineage: comparable


def test_a_file_from_before_lineages_reads_as_legacy_pytorch(
    lineage_statistics: dict[str, FeatureStatistics], tmp_path: Path
) -> None:
    old = FeatureOrigin("fid_inception", "avgpool", "avg", "pt_inception-2015-12-05-6726825d")  # as files held it
    stats = FeatureStatistics(origin=old).update(torch.randn(5, 2048, generator=torch.Generator().manual_seed(0)))
    loaded = FeatureStatistics.load(stats.save(tmp_path / "old.npz"))
    assert loaded.origin is not None and loaded.origin.lineage == "legacy_pytorch"
    loaded.check_matches(lineage_statistics["legacy_pytorch"])  # comparable
    with pytest.raises(InvalidValueError, match="lineage 'legacy_pytorch' vs 'clean'"):
        frechet_distance(loaded, lineage_statistics["clean"])
    assert FeatureOrigin("resnet18", "layer4", "avg", "DEFAULT").lineage is None  # other backbones have none


def test_bad_mode_names_say_the_closest(fid_weights: Path) -> None:
    with pytest.raises(InvalidValueError, match="did you mean 'clean'"):
        fid_extractor(mode="clena", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="did you mean .*'legacy_tensorflow'"):
        fid_statistics(torch.rand(2, 3, 8, 8), mode="legacy_tf")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="unknown FID mode"):
        FeatureOrigin("fid_inception", "avgpool", "avg", None, lineage="tensorflow")
    extractor = fid_extractor(weights=None, mode="clean", device="cpu")
    with pytest.raises(InvalidValueError, match="computes FID features of mode 'clean'"):
        fid_statistics(torch.rand(2, 3, 8, 8), mode="legacy_pytorch", extractor=extractor)
