"""CMMD: the formula against cmmd-pytorch's float32 one and a plain float64 one, and ``cmmd()`` on folders of photos
against cmmd-pytorch's pipeline (its reading, resize, processor, transformers' model, its MMD) on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks as fh
from featurehooks.metrics import clip_mmd as cmmd_module
from featurehooks.metrics.clip_mmd import cmmd, cmmd_embeddings, cmmd_extractor, cmmd_of_embeddings

transformers = pytest.importorskip("transformers")
from clip_reference import cached_clip, reference_pixels  # noqa: E402  # the tiny tower's cache and pixels


def mmd_float32(x: torch.Tensor, y: torch.Tensor) -> float:
    """cmmd-pytorch's distance.mmd, re-derived: squared norms from the Gram diagonals, float32 throughout."""
    x, y = x.float(), y.float()
    gamma = 1 / (2 * 10**2)
    x_sq, y_sq = torch.diag(x @ x.T), torch.diag(y @ y.T)
    k_xx = torch.mean(torch.exp(-gamma * (-2 * x @ x.T + x_sq[:, None] + x_sq[None, :])))
    k_xy = torch.mean(torch.exp(-gamma * (-2 * x @ y.T + x_sq[:, None] + y_sq[None, :])))
    k_yy = torch.mean(torch.exp(-gamma * (-2 * y @ y.T + y_sq[:, None] + y_sq[None, :])))
    return float(1000 * (k_xx + k_yy - 2 * k_xy))


def mmd_float64(x: torch.Tensor, y: torch.Tensor) -> float:
    """The definition, plainly: every squared distance at once (``cdist``), float64."""
    x, y = x.double(), y.double()

    def mean_kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(torch.cdist(a, b) ** 2) / 200).mean()

    return float(1000 * (mean_kernel(x, x) + mean_kernel(y, y) - 2 * mean_kernel(x, y)))


def clip_like(count: int, shift: float, seed: int) -> torch.Tensor:
    """Float64 unit vectors of 768 dimensions around a shared direction, as CLIP embeddings of photos are (CMMD of
    0.1 to 2)."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(768, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vectors = 0.7 * common / common.norm() + 0.03 * torch.randn(count, 768, generator=generator, dtype=torch.float64)
    return torch.nn.functional.normalize(vectors + shift * torch.randn(768, generator=generator, dtype=torch.float64))


# -- the formula ---------------------------------------------------------------------------------------------
def test_formula_equals_cmmd_pytorch_and_float64_is_closer() -> None:
    x, y = clip_like(700, 0.0, 1), clip_like(500, 0.01, 2)
    ours, theirs, exact = cmmd_of_embeddings(x, y), mmd_float32(x, y), mmd_float64(x, y)
    assert abs(theirs - ours) <= 1e-4  # float32 loses about 5e-5 here (8e-5 of the value)
    assert abs(ours - exact) <= 1e-12 * abs(exact) < abs(theirs - exact)


def test_blocks_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cmmd_module, "_BLOCK", 7)  # 30 and 23 rows: diagonal, mirrored and ragged blocks
    x, y = clip_like(30, 0.0, 3), clip_like(23, 0.05, 4)
    assert cmmd_of_embeddings(x, y) == pytest.approx(mmd_float64(x, y), rel=1e-12)
    assert abs(cmmd_of_embeddings(x, x.clone())) < 1e-12


def test_rows_are_scaled_to_unit_length() -> None:
    x, y = clip_like(40, 0.0, 5), clip_like(30, 0.05, 6)
    scales = torch.rand(40, 1, dtype=torch.float64) + 0.5
    assert cmmd_of_embeddings(x * scales, y.numpy()) == pytest.approx(cmmd_of_embeddings(x, y), rel=1e-12)


def test_identical_sets_give_zero() -> None:
    x = clip_like(50, 0.0, 7)
    assert cmmd_of_embeddings(x, x) == 0.0


@pytest.mark.parametrize(
    ("x", "y", "error", "match"),
    [
        (torch.zeros(0, 768), torch.ones(3, 768), fh.InvalidValueError, "N, D >= 1"),
        (torch.ones(3, 768), torch.ones(3, 512), fh.InvalidValueError, "768 dimensions .* y 512"),
        (
            torch.ones(3, 8).index_fill(0, torch.tensor([1]), torch.nan),
            torch.ones(2, 8),
            fh.InvalidValueError,
            "1 of 3",
        ),
        (torch.ones(3, 8), torch.zeros(2, 8), fh.InvalidValueError, "2 all-zero"),
        (torch.ones(8), torch.ones(2, 8), fh.InvalidValueError, "shape \\(8,\\)"),
        (torch.ones(2, 8, dtype=torch.int64), torch.ones(2, 8), fh.InvalidTypeError, "floating-point"),
        ([[1.0, 0.0]], torch.ones(2, 2), fh.InvalidTypeError, "not list"),
    ],
)
def test_bad_embeddings_are_refused(x: object, y: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        cmmd_of_embeddings(x, y)  # type: ignore[arg-type]


# -- over images -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with cached_clip(tmp_path_factory.mktemp("hf_hub")) as snapshot:
        yield snapshot


@pytest.fixture(scope="module")
def photo_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two folders of photos, square and not (color and grayscale, PNG and JPEG, down- and upscaled to 336)."""
    data = pytest.importorskip("skimage.data")
    real = {"astronaut.png": data.astronaut(), "camera.png": data.camera(), "coffee.jpg": data.coffee()[:400, :400]}
    fake = {
        "chelsea.png": data.chelsea(),
        "moon.png": data.moon(),
        "rocket.png": data.rocket(),
        "cells.jpg": data.immunohistochemistry()[:200, :200],
    }
    sets = {"real": real, "fake": fake}
    root = tmp_path_factory.mktemp("photos")
    for name, files in sets.items():
        (root / name).mkdir()
        for file, pixels in files.items():
            Image.fromarray(pixels).save(root / name / file, quality=95)
    return root / "real", root / "fake"


def reference_embeddings(model: torch.nn.Module, folder: Path) -> torch.Tensor:
    """cmmd-pytorch's ``compute_embeddings_for_dir``: sorted files, its pixels, ``image_embeds`` over their norm."""
    files = sorted(path for path in folder.iterdir() if path.suffix in (".png", ".jpg", ".jpeg"))
    pixels = reference_pixels([np.asarray(Image.open(path)) for path in files], 336)
    with torch.no_grad():
        embeddings = model(pixels).image_embeds
    return embeddings / torch.linalg.norm(embeddings, dim=-1, keepdim=True)


def test_cmmd_of_folders_equals_cmmd_pytorch(snapshot: Path, photo_folders: tuple[Path, Path]) -> None:
    real, fake = photo_folders
    model = transformers.CLIPVisionModelWithProjection.from_pretrained(str(snapshot)).eval()
    x, y = reference_embeddings(model, real), reference_embeddings(model, fake)
    ours = cmmd(real, fake, device="cpu", batch_size=2, num_workers=0)
    assert ours == pytest.approx(mmd_float32(x, y), abs=1e-4)  # 4e-5 apart: cmmd-pytorch's float32 MMD
    assert ours == pytest.approx(cmmd_of_embeddings(x, y), rel=1e-6)  # the rest is the float32 MMD
    assert abs(cmmd(real, real, device="cpu", num_workers=0)) < 1e-12


def test_embeddings_are_the_towers_image_embeds(snapshot: Path, photo_folders: tuple[Path, Path]) -> None:
    extractor = cmmd_extractor(device="cpu")
    embeddings = cmmd_embeddings(photo_folders[0], extractor, num_workers=0)
    model = transformers.CLIPVisionModelWithProjection.from_pretrained(str(snapshot)).eval()
    expected = reference_embeddings(model, photo_folders[0])
    assert embeddings.dtype == torch.float32 and embeddings.shape == (3, 16)
    torch.testing.assert_close(embeddings / embeddings.norm(dim=1, keepdim=True), expected, rtol=1e-5, atol=1e-6)


def test_bad_sources_and_options_are_refused(snapshot: Path, photo_folders: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(fh.InvalidValueError, match="batch_size"):
        cmmd(*photo_folders, weights=tmp_path / "never_read.safetensors", batch_size=0)  # before the model is read
    with pytest.raises(fh.InputNotFoundError):
        cmmd(photo_folders[0], tmp_path, device="cpu", num_workers=0)


def test_an_extractor_is_reused_and_fixes_weights_and_device(snapshot: Path, photo_folders: tuple[Path, Path]) -> None:
    extractor = cmmd_extractor(device="cpu")
    once = cmmd(*photo_folders, extractor=extractor, num_workers=0)
    assert once == cmmd(*photo_folders, device="cpu", num_workers=0)
    with pytest.raises(fh.InvalidValueError, match="extractor= already fixes"):
        cmmd(*photo_folders, extractor=extractor, device="cpu")
