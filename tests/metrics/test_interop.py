"""``PooledFeatures``: an extractor's layer as torchmetrics' ``feature=`` module.

Oracle: featurehooks' own ``frechet_distance`` and ``kernel_inception_distance`` on the same features, pooled
by hand from the extractor's output; torchmetrics' ``FrechetInceptionDistance`` and ``KernelInceptionDistance``
with the module must give the same numbers, from uint8 images and from floating ones (``normalize=True``).
The README's recipe runs as written.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from torch import nn

from featurehooks import FeatureExtractor, InvalidTypeError, InvalidValueError, LayerNotFoundError
from featurehooks.metrics import PooledFeatures, feature_statistics, frechet_distance, kernel_inception_distance

from helpers import REPO, tiny_extractor

# torchmetrics' KID warns that it keeps every feature vector; its FID that the custom module's own dtype is used
pytestmark = pytest.mark.filterwarnings("ignore:Metric `Kernel.*` will save all extracted features:UserWarning")

COUNT = 40  # images a set: more than the 16 features of conv2, so both covariances have full rank


def uint8_images(seed: int, brighter: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256 - brighter, (COUNT, 3, 20, 20), generator=generator, dtype=torch.uint8)
    return images + brighter


def by_hand(extractor: FeatureExtractor, images: torch.Tensor) -> torch.Tensor:
    """What featurehooks' own pipeline computes: images in [0, 1], the layer's maps averaged over positions."""
    with torch.no_grad():
        return extractor(images.float() / 255)["conv2"].mean(dim=(2, 3))


@pytest.fixture
def extractor() -> FeatureExtractor:
    return tiny_extractor(("relu1", "conv2"), stride=1)


@pytest.fixture
def images() -> tuple[torch.Tensor, torch.Tensor]:
    return uint8_images(1), uint8_images(2, brighter=60)


def test_the_module_gives_pooled_vectors(extractor: FeatureExtractor, images: tuple[torch.Tensor, ...]) -> None:
    real, _ = images
    feature = PooledFeatures(extractor, "conv2")
    assert feature.num_features == 16
    assert torch.equal(feature(real), by_hand(extractor, real))
    assert torch.equal(feature(real.float() / 255), by_hand(extractor, real))  # floats in input_range as they are
    peak = PooledFeatures(extractor, "conv2", pool="max")(real)
    with torch.no_grad():
        assert torch.equal(peak, extractor(real.float() / 255)["conv2"].amax(dim=(2, 3)))


def test_uint8_images_are_mapped_to_the_input_range(images: tuple[torch.Tensor, ...]) -> None:
    real, _ = images
    signed = tiny_extractor(("conv2",), stride=1, input_range=(-1, 1))
    with torch.no_grad():
        expected = signed(real.float() / 255 * 2 - 1)["conv2"].mean(dim=(2, 3))
    torch.testing.assert_close(PooledFeatures(signed)(real), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_torchmetrics_fid_equals_frechet_distance(
    extractor: FeatureExtractor, images: tuple[torch.Tensor, ...], normalize: bool
) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance  # 1.7 s: imported by the tests that use it

    real, fake = images
    feature = PooledFeatures(extractor, "conv2")
    calls: list[int] = []
    feature.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    fid = FrechetInceptionDistance(feature=feature, normalize=normalize)
    assert calls == []  # num_features answered: no probe forward of a 299x299 dummy image
    for batch, is_real in ((real, True), (fake, False)):
        for part in batch.split(16):  # several updates: torchmetrics sums them
            fid.update(part.float() / 255 if normalize else part, real=is_real)
    expected = frechet_distance(by_hand(extractor, real), by_hand(extractor, fake))
    assert expected > 0.01
    assert float(fid.compute()) == pytest.approx(expected, rel=1e-5)
    if not normalize:  # and featurehooks' streaming statistics of the same images, not resized
        stats = [
            feature_statistics(
                extractor, x.float() / 255, layer="conv2", resize_size=None, crop_size=None, num_workers=0
            )
            for x in images
        ]
        assert float(fid.compute()) == pytest.approx(frechet_distance(*stats), rel=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
def test_torchmetrics_kid_equals_kernel_inception_distance(
    extractor: FeatureExtractor, images: tuple[torch.Tensor, ...], normalize: bool
) -> None:
    from torchmetrics.image.kid import KernelInceptionDistance

    real, fake = images
    kid = KernelInceptionDistance(
        feature=PooledFeatures(extractor, "conv2"), subsets=2, subset_size=COUNT, normalize=normalize
    )
    kid.update(real.float() / 255 if normalize else real, real=True)
    kid.update(fake.float() / 255 if normalize else fake, real=False)
    mean, _ = kid.compute()
    # subsets of every vector: each of torchmetrics' rounds is the one round kernel_inception_distance computes
    expected, _ = kernel_inception_distance(by_hand(extractor, real), by_hand(extractor, fake), subset_size=COUNT)
    assert expected > 1e-3
    assert float(mean) == pytest.approx(expected, rel=1e-4)


def test_an_untraced_model_is_probed_once(images: tuple[torch.Tensor, ...]) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance

    class Untraceable(nn.Module):
        """A convolution whose forward reads a value (fails on the meta device: no layouts before a forward)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.conv = nn.Conv2d(3, 6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x) * (1.0 if float(x.mean()) > -10 else 0.0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extractor = FeatureExtractor(Untraceable(), ["conv"], mean=(0.5,) * 3, std=(0.25,) * 3)
    feature = PooledFeatures(extractor)
    assert not hasattr(feature, "num_features")  # so torchmetrics probes with a dummy image
    fid = FrechetInceptionDistance(feature=feature)
    assert feature.num_features == 6
    real, fake = images
    fid.update(real, real=True)
    fid.update(fake, real=False)
    with torch.no_grad():
        a, b = (extractor(x.float() / 255)["conv"].mean(dim=(2, 3)) for x in images)
    assert float(fid.compute()) == pytest.approx(frechet_distance(a, b), rel=1e-5)


def test_refusals(extractor: FeatureExtractor) -> None:
    with pytest.raises(LayerNotFoundError, match="no layer 'conv3'.*conv2"):
        PooledFeatures(extractor, "conv3")
    with pytest.raises(InvalidValueError, match=r"returns 2 outputs \['relu1', 'conv2'\]: pass layer="):
        PooledFeatures(extractor)
    with pytest.raises(InvalidValueError, match="pool=None: layer 'conv2' returns NCHW features"):
        PooledFeatures(extractor, "conv2", pool=None)
    with pytest.raises(InvalidValueError, match="pool must be None, 'avg', 'max' or 'cls'"):
        PooledFeatures(extractor, "conv2", pool="mean")  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="pool='cls'"):
        PooledFeatures(extractor, "conv2", pool="cls")(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))
    with pytest.raises(InvalidTypeError, match="must be a FeatureExtractor, not Conv2d"):
        PooledFeatures(nn.Conv2d(3, 3, 1), "conv2")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="expected uint8 images in .0, 255. or floating images.*int16"):
        PooledFeatures(extractor, "conv2")(torch.zeros(1, 3, 8, 8, dtype=torch.int16))


def test_the_metric_stays_small_and_copies(extractor: FeatureExtractor, images: tuple[torch.Tensor, ...]) -> None:
    from torchmetrics.image.fid import FrechetInceptionDistance

    fid = FrechetInceptionDistance(feature=PooledFeatures(extractor, "conv2"))
    assert not any(name.startswith("inception") for name in fid.state_dict())  # the backbone is not a state
    assert not any(parameter.requires_grad for parameter in fid.parameters())
    copy = fid.clone()  # a deep copy, extractor included (MetricCollection and trainers copy metrics)
    for metric in (fid, copy):
        metric.update(images[0], real=True)
        metric.update(images[1], real=False)
    assert float(copy.compute()) == float(fid.compute())


# The README's recipe, exactly as it reads there (tests/docs runs the README's blocks too).
RECIPE = """
from glob import glob

import torch
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance

import featurehooks as fh

ext = fh.FeatureExtractor("resnet18", ["layer4"])              # any backbone and layer (DINO, CLIP, ...)
feature = fh.metrics.PooledFeatures(ext, "layer4", pool="avg")  # uint8 images in, (N, 512) vectors out
fid = FrechetInceptionDistance(feature=feature)
kid = KernelInceptionDistance(feature=feature, subset_size=4)

files = sorted(glob("examples/images/*.png"))
shapes = torch.stack([fh.read_image(p) for p in files if "shapes" in p])      # uint8 images, as torchmetrics takes
others = torch.stack([fh.read_image(p) for p in files if "shapes" not in p])  # stripes and textures
for metric in (fid, kid):
    metric.update(shapes, real=True)
    metric.update(others, real=False)
print(f"FID {fid.compute():.3f}  KID {kid.compute()[0]:.5f}")    # 4 images a set: far too few, as a demo
"""


@pytest.mark.slow
def test_readme_recipe(resnet18_cached: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(RECIPE, "README recipe", "exec"), {})  # noqa: S102 - the recipe under test
    assert out.getvalue().startswith("FID ")
