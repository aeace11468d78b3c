"""The input pipeline (featurehooks._stream) and what it asks of FeatureExtractor: shapes from the meta trace, the
device and dtype, the range check left to real images, and the one loop over batches."""

from __future__ import annotations

import os
import signal
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

import featurehooks as fh
from featurehooks._stream import Batch, FeatureBatch, Progress, feature_batches, pipeline, placement, row_shapes
from featurehooks._stream.loader import cut_to_pixels
from featurehooks.dump.store import DumpStore


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3, stride=2), relu=nn.ReLU(), pool=nn.AdaptiveAvgPool2d(1)))


class NoMeta(nn.Module):
    """Data-dependent Python control flow: cannot run on the meta device, so it is never traced."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean().item() > 1e9:
            x = x * 2
        return self.conv(x)


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    options = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, reg_tokens=2, num_classes=5)
    return timm.models.VisionTransformer(**options).eval()


def real_shapes(ext: fh.FeatureExtractor, shape: tuple[int, ...]) -> dict[str, tuple[int, ...] | None]:
    with torch.no_grad():
        return {name: tuple(value.shape) for name, value in ext(torch.rand(shape)).items()}


@pytest.mark.parametrize(
    ("build", "shape"),
    [
        (lambda: fh.FeatureExtractor("resnet18", ["layer1", "layer3", "fc"], weights=None), (3, 3, 40, 56)),
        (lambda: fh.FeatureExtractor("resnet18", ["layer2"], weights=None), (2, 3, 224, 224)),  # its own trace
        (lambda: fh.FeatureExtractor(tiny_vit(), ["blocks.1"], weights=None), (2, 3, 32, 32)),
        (
            lambda: fh.FeatureExtractor(
                tiny_vit(), ["blocks.0", "blocks.1"], output_format="nchw", return_prefix_tokens=True
            ),
            (1, 3, 32, 32),
        ),
    ],
)
def test_output_shapes_are_those_of_a_real_forward(build, shape: tuple[int, ...]) -> None:
    ext = build()
    assert ext.output_shapes(shape) == real_shapes(ext, shape)


def test_output_shapes_refuse_what_forward_refuses() -> None:
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    with pytest.raises(fh.InvalidValueError, match="expected 3 channels, got 1; repeat grayscale"):
        ext.output_shapes((1, 1, 16, 16))
    with pytest.raises(fh.InvalidValueError, match=r"\(batch, channels, height, width\)"):
        ext.output_shapes((3, 16, 16))
    with pytest.raises(RuntimeError, match="cannot run on the meta device"):
        fh.FeatureExtractor(NoMeta(), ["conv"]).output_shapes((1, 3, 16, 16))


def test_device_dtype_and_placement_follow_the_extractor() -> None:
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    assert (ext.device, ext.dtype) == (torch.device("cpu"), torch.float32) == placement(ext)
    ext = ext.double()
    assert ext.dtype == torch.float64 and placement(ext) == (torch.device("cpu"), torch.float64)
    assert placement(nn.Linear(2, 2).half()) == (torch.device("cpu"), torch.float16)
    assert placement(lambda a, b: a - b) == (torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("pool", [None, "avg"])
def test_row_shapes_come_from_the_trace_without_a_forward(pool: str | None) -> None:
    ext = fh.FeatureExtractor(tiny_net(), ["relu", "pool"])
    calls = []
    ext.backbone.register_forward_pre_hook(lambda module, args: calls.append(args[0].device))
    shapes = row_shapes(ext, (3, 17, 21), pool)
    expected = {"relu": (4, 8, 10), "pool": (4, 1, 1)} if pool is None else {"relu": (4,), "pool": (4,)}
    assert shapes == expected and set(calls) <= {torch.device("meta")}  # the hook goes with the traced copies


def test_row_shapes_of_an_untraced_model_come_from_one_forward_in_range() -> None:
    ext = fh.FeatureExtractor(NoMeta(), ["conv"], input_range=(0.0, 255.0))
    assert row_shapes(ext, (3, 17, 21), "avg") == {"conv": (4,)}
    assert not ext.range_checked  # the probe was in range by construction: real images are still checked
    with pytest.warns(UserWarning, match="images span"):
        ext(torch.full((1, 3, 8, 8), -1000.0))
    assert ext.range_checked


@pytest.mark.parametrize("backbone", [tiny_net, NoMeta])
def test_a_dump_runs_one_forward_per_batch_and_checks_the_range_of_real_images(backbone, tmp_path: Path) -> None:
    ext = fh.FeatureExtractor(backbone(), ["conv"])
    calls = []
    ext.backbone.register_forward_pre_hook(lambda module, args: calls.append(args[0]))
    wrong_scale = TensorDataset(torch.rand(5, 3, 12, 12) * 255)  # floats are taken as in input_range (0, 1)
    with pytest.warns(UserWarning, match="images span"):
        result = fh.dump_features(ext, wrong_scale, tmp_path, batch_size=2, num_workers=0, progress=False)
    assert result.load("conv").shape == (5, 4, 5, 5)
    probe = [1] if backbone is NoMeta else []  # an untraced model's shapes need one real forward
    assert [len(images) for images in calls if images.device.type != "meta"] == [*probe, 2, 2, 1]


def test_feature_batches_put_sizes_back_in_order_and_zero_unreadable_rows() -> None:
    seen = []

    def forward(images: torch.Tensor) -> dict[str, np.ndarray]:
        seen.append(tuple(images.shape))
        return {"sum": images.sum(dim=(1, 2, 3)).numpy(), "size": np.full((len(images), 2), images.shape[-1])}

    images = [torch.ones(1, 2, 2), torch.ones(1, 3, 3), None, torch.ones(1, 2, 2)]
    batch = Batch([4, 5, 6, 7], images, ["", "", "cannot read", "too small"], [None, 1, None, 3])
    with Progress(4, False) as bar:
        (found,) = feature_batches(forward, [batch], model=nn.Linear(1, 1).double(), progress=bar)
    assert isinstance(found, FeatureBatch) and found.rows == [4, 5, 6, 7] and found.labels == [None, 1, None, 3]
    assert sorted(seen) == [(1, 1, 3, 3), (2, 1, 2, 2)]  # one forward per size; the row without an image: none
    assert found.arrays["sum"].tolist() == [4.0, 9.0, 0.0, 0.0]  # an unreadable row is zeros, computed or not
    assert found.arrays["size"].tolist() == [[2, 2], [3, 3], [0, 0], [0, 0]]
    assert found.valid == [0, 1] and found.skipped == [(6, "cannot read"), (7, "too small")]


def test_batches_are_cut_to_the_pixel_budget() -> None:
    areas = {0: 100, 1: 100, 2: 300, 3: 50, 4: 50, 5: 100}
    batches = [[0, 1, 2, 3], [4, 5]]
    assert list(cut_to_pixels(batches, areas.__getitem__, 250)) == [[0, 1], [2], [3], [4, 5]]  # 300 goes alone
    assert list(cut_to_pixels(batches, areas.__getitem__, None)) == batches


def _sized_pngs(folder: Path) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i, (height, width) in enumerate([(20, 24), (20, 24), (40, 30), (12, 12), (20, 24), (16, 20)]):
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shape of the images of every forward the pipeline runs (each size of a batch: one forward)."""
    seen: list[tuple[int, ...]] = []
    whole = pipeline.features_as_arrays

    def spied(extractor: fh.FeatureExtractor, images: torch.Tensor, **options: object) -> dict[str, np.ndarray]:
        seen.append(tuple(images.shape))
        return whole(extractor, images, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "features_as_arrays", spied)
    return seen


def test_statistics_under_a_pixel_budget_equal_the_unbudgeted_ones(
    tmp_path: Path, forwards: list[tuple[int, ...]]
) -> None:
    folder = _sized_pngs(tmp_path / "images")
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    options = {"pool": "avg", "batch_size": 6, "num_workers": 0, "resize_size": None, "crop_size": None}
    whole = fh.feature_statistics(ext, folder, **options)
    assert sum(shape[0] for shape in forwards) == 6 and forwards[0][0] == 3  # the three 20x24 images at once
    forwards.clear()
    budget = fh.feature_statistics(ext, folder, batch_pixels=1000, **options)
    assert all(shape[0] * shape[2] * shape[3] <= 1000 or shape[0] == 1 for shape in forwards)
    assert sum(shape[0] for shape in forwards) == 6 and any(shape[2:] == (40, 30) for shape in forwards)
    assert budget.count == whole.count == 6
    torch.testing.assert_close(budget.mean, whole.mean, rtol=1e-6, atol=0)  # float32 rounding of other batch sizes
    torch.testing.assert_close(budget.covariance, whole.covariance, rtol=1e-5, atol=1e-9)


def test_a_dump_under_a_pixel_budget_commits_whole_batches_with_the_unbudgeted_rows(
    tmp_path: Path, forwards: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    commits: list[tuple[int, int, int]] = []
    commit = DumpStore.commit

    def recorded(store: DumpStore, chunk: int, start: int, stop: int, skipped: list[tuple[int, str]]) -> None:
        commits.append((chunk, start, stop))
        commit(store, chunk, start, stop, skipped)

    monkeypatch.setattr(DumpStore, "commit", recorded)
    images = torch.rand(7, 3, 10, 10)
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    options = {"batch_size": 4, "num_workers": 0, "progress": False}
    whole = fh.dump_features(ext, images, tmp_path / "whole", **options)
    forwards.clear()
    commits.clear()
    budget = fh.dump_features(ext, images, tmp_path / "budget", batch_pixels=250, **options)
    assert [shape[0] for shape in forwards] == [2, 2, 2, 1]  # 100 pixels an image
    assert budget.manifest.chunk_size == 4 and budget.manifest.status == "complete"
    np.testing.assert_allclose(budget.load("relu"), whole.load("relu"), rtol=1e-6, atol=1e-7)
    assert commits == [(0, 0, 4), (1, 4, 7)]  # the unit of commit and resume is still the batch


class KillsItsWorker(torch.utils.data.Dataset):
    """Images whose reading kills the DataLoader worker that reads them (as the OOM killer would)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(3, 8, 8)


def test_a_dead_decoding_worker_is_one_error_line(tmp_path: Path) -> None:
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    runs = [
        lambda: fh.dump_features(ext, KillsItsWorker(), tmp_path / "out", batch_size=2, num_workers=1),
        lambda: fh.feature_statistics(ext, KillsItsWorker(), pool="avg", batch_size=2, num_workers=1),
    ]
    for run in runs:
        with pytest.raises(fh.RunFailedError) as caught:
            run()
        message = str(caught.value)
        assert "\n" not in message and message.startswith("a decoding worker died (DataLoader worker (pid")
        assert "num_workers=0, --workers 0" in message


def test_the_progress_bar_names_the_set_of_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ext = fh.FeatureExtractor(tiny_net(), ["relu"])
    for name in ("real", "fake"):
        folder = _sized_pngs(tmp_path / name)
        fh.feature_statistics(ext, folder, pool="avg", num_workers=0, resize_size=None, crop_size=None, progress=True)
    fh.feature_statistics(ext, torch.rand(2, 3, 8, 8), pool="avg", progress=True)
    err = capsys.readouterr().err
    assert "statistics of real:" in err and "statistics of fake:" in err and "statistics:" in err
