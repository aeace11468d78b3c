"""``evaluate``: one decode of each image for every backbone, and each number equal to its single-metric function on
the same images and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from featurehooks import GeneratedImages
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import (
    Evaluation,
    cmmd,
    evaluate,
    fd_dinov2,
    fid_statistics,
    frechet_distance,
    kernel_inception_distance,
    precision_recall,
    sfid_statistics,
)
from featurehooks.metrics.isc import inception_score

from dinov2_reference import write_photos

pytestmark = pytest.mark.filterwarnings("ignore:.*feature vectors in .* dimensions:UserWarning")
OPTIONS = {"num_workers": 0, "batch_size": 2}


@pytest.fixture(scope="module")
def sets(
    tmp_path_factory: pytest.TempPathFactory, fid_weights: Path, dinov2_vits14_cached: object
) -> tuple[Path, Path]:
    """Two folders of photos of several sizes (the second mirrored), seeded FID Inception and DINOv2 ViT-S/14
    weights where their functions find them."""
    root = tmp_path_factory.mktemp("evaluation")
    for folder, flip in ((root / "real", False), (root / "fake", True)):
        for path in write_photos(folder, flip=flip):  # 512x512, 300x451, 400x600: down to a quarter (or less)
            with Image.open(path) as image:
                small = image.reduce(4)
            small.save(path)
    return root / "real", root / "fake"


@pytest.fixture(scope="module")
def found(sets: tuple[Path, Path]) -> Evaluation:
    """Every metric but CMMD of the two sets, in one pass a set."""
    real, fake = sets
    metrics = ["fid", "kid", "prdc", "is", "fd_dinov2", "sfid"]
    options = {"kid_subset_size": 3, "prdc_k": 1, "is_splits": 1, "device": "cpu"}
    return evaluate(real, fake, metrics, dinov2_model="vits14", **options, **OPTIONS)  # type: ignore[arg-type]


@pytest.mark.slow  # a reference oracle with networks of its own
def test_each_number_equals_its_single_metric_function(sets: tuple[Path, Path], found: Evaluation) -> None:
    real, fake = sets
    a, b = (fid_statistics(s, device="cpu", keep=3, **OPTIONS) for s in (real, fake))
    assert found.numbers["fid"] == pytest.approx(frechet_distance(a, b), rel=1e-9)
    assert found.numbers["kid"] == pytest.approx(kernel_inception_distance(a, b, subset_size=3), rel=1e-9)
    assert found.numbers["prdc"] == precision_recall(a, b, k=1)
    expected_is = inception_score(fake, mode="legacy_pytorch", splits=1, device="cpu", **OPTIONS)
    assert found.numbers["is"] == pytest.approx(expected_is, rel=1e-6)
    expected_fd = fd_dinov2(real, fake, model="vits14", device="cpu", **OPTIONS)
    assert found.numbers["fd_dinov2"] == pytest.approx(expected_fd, rel=1e-9)
    for side, stats in ((found.real, a), (found.fake, b)):
        torch.testing.assert_close(side["inception"].mean, stats.mean, rtol=0, atol=0)  # the same pixels, bitwise
        assert side["inception"].origin == stats.origin
    for side, folder in ((found.real, real), (found.fake, fake)):  # sFID from the same forward, in its lineage
        spatial = sfid_statistics(folder, mode="legacy_pytorch", device="cpu", **OPTIONS)
        torch.testing.assert_close(side["inception_spatial"].covariance, spatial.covariance, rtol=0, atol=0)
        assert side["inception_spatial"].origin == spatial.origin and side["inception_spatial"].keep == 0
    assert found.numbers["sfid"] == frechet_distance(found.real["inception_spatial"], found.fake["inception_spatial"])


@pytest.mark.slow  # a reference oracle with networks of its own
def test_statistics_of_a_set_serve_as_its_reference(sets: tuple[Path, Path], found: Evaluation) -> None:
    _, fake = sets
    again = evaluate(found.real, fake, ["fid", "kid"], kid_subset_size=3, device="cpu", **OPTIONS)
    assert again.numbers == {name: found.numbers[name] for name in ("fid", "kid")}
    with pytest.raises(InvalidValueError, match="real holds no statistics of clip"):
        evaluate(found.real, fake, ["cmmd"], device="cpu", **OPTIONS)


@pytest.mark.slow  # a reference oracle with networks of its own
def test_cmmd_equals_its_single_metric_function(sets: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from clip_reference import cached_clip

    real, fake = sets
    with cached_clip(tmp_path / "hub"):  # a tiny seeded tower where CLIP ViT-L/14@336's weights are cached
        found = evaluate(real, fake, ["cmmd", "fid"], device="cpu", **OPTIONS)
        expected = cmmd(real, fake, device="cpu", **OPTIONS)
    # the photos differ in size, so evaluate embeds each alone (one forward per size: the FID Inception takes each
    # at its own), while cmmd batches them at 336x336: the transformer's matmuls round by batch (2e-7 apart)
    assert found.numbers["cmmd"] == pytest.approx(expected, rel=1e-6) and expected > 0
    assert found.real["clip"].count == 3 and found.real["clip"].features.shape == (3, 16)  # every vector kept


def test_a_uint8_tensor_is_prepared_as_files_of_its_pixels_are(sets: tuple[Path, Path], tmp_path: Path) -> None:
    """The pipeline's u / 255 goes back to the same uint8 pixels, which each backbone resizes with Pillow."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (4, 3, 50, 60), dtype=torch.uint8, generator=generator) for _ in range(2)]
    folders = [tmp_path / "real", tmp_path / "fake"]
    for folder, images in zip(folders, tensors):
        folder.mkdir()
        for i, image in enumerate(images):
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(folder / f"{i}.png")  # lossless: the same pixels
    with pytest.warns(UserWarning, match="real holds 4 feature vectors in 384 dimensions"):  # the sets by name
        found = evaluate(*tensors, ["fd_dinov2"], dinov2_model="vits14", device="cpu", **OPTIONS)
    expected = fd_dinov2(*folders, model="vits14", device="cpu", **OPTIONS)
    assert found.numbers["fd_dinov2"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_generated_float_images_evaluate_as_the_tensor_of_their_batches() -> None:
    """A generator's float images reach each backbone as floats (not rounded to pixels), as the same tensor's."""
    generator = torch.Generator().manual_seed(0)
    real, fake = (torch.rand(6, 3, 40, 44, generator=generator) for _ in range(2))
    options = {"weights": {"inception": None}, "device": "cpu", "batch_size": 4, "num_workers": 0}
    torch.manual_seed(0)
    expected = evaluate(real, fake, ["fid"], **options)
    torch.manual_seed(0)
    found = evaluate(real, GeneratedImages(lambda: fake.split(4), 6), ["fid"], **options)
    assert found.numbers["fid"] == expected.numbers["fid"]


@pytest.mark.parametrize(
    ("metrics", "options", "message"),
    [
        (["fidd"], {}, "unknown metric 'fidd'.*'fid'"),
        ([], {}, "no metrics asked for"),
        (["fid"], {"resize_size": 64}, "evaluate takes no resize_size"),
    ],
)
def test_bad_requests_are_refused_before_any_image_is_read(
    metrics: list[str], options: dict[str, int], message: str
) -> None:
    with pytest.raises(InvalidValueError, match=message):
        evaluate("no/such/folder", "no/such/folder", metrics, **options)  # type: ignore[arg-type]
