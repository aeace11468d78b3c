"""Dumps of a ``precision="bf16"`` extractor: computed in bf16, stored in the ``dtype`` asked for, the precision
recorded in the manifest (only when it is not float32) and compared on resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from featurehooks import dump_features, read_manifest
from featurehooks.dump.manifest import CorruptDumpError, Manifest
from featurehooks.errors import InvalidValueError

from helpers import bf16_anywhere, tiny_extractor

OPTIONS = {"batch_size": 2, "num_workers": 0, "progress": False, "resize_size": None, "crop_size": None}


@pytest.fixture(scope="module")
def folder(png_folder: Callable[..., Path]) -> Path:
    return png_folder(5)


@bf16_anywhere
@pytest.mark.parametrize(("pool", "dtype"), [("avg", "float32"), (None, "float16")])
def test_bf16_dump_stores_the_dtype_asked_for(folder: Path, tmp_path: Path, pool: str | None, dtype: str) -> None:
    low = dump_features(tiny_extractor(precision="bf16"), folder, tmp_path / "bf16", pool=pool, dtype=dtype, **OPTIONS)
    dump_features(tiny_extractor(), folder, tmp_path / "f32", pool=pool, dtype=dtype, **OPTIONS)
    assert low.manifest.settings.precision == "bf16"
    assert json.loads((tmp_path / "bf16" / "manifest.json").read_text())["precision"] == "bf16"
    assert "precision" not in json.loads((tmp_path / "f32" / "manifest.json").read_text())
    for name in ("relu1", "conv2"):
        ours, theirs = np.load(tmp_path / "bf16" / f"{name}.npy"), np.load(tmp_path / "f32" / f"{name}.npy")
        assert ours.dtype == theirs.dtype == np.dtype(dtype) and ours.shape == theirs.shape
        scale = float(np.abs(theirs.astype(np.float32)).max())
        assert float(np.abs(ours.astype(np.float32) - theirs.astype(np.float32)).max()) < 0.02 * scale


@bf16_anywhere
def test_a_resume_in_another_precision_is_refused(folder: Path, tmp_path: Path) -> None:
    dump_features(tiny_extractor(precision="bf16"), folder, tmp_path, pool="avg", **OPTIONS)
    with pytest.raises(InvalidValueError, match="precision"):
        dump_features(tiny_extractor(), folder, tmp_path, pool="avg", resume=True, **OPTIONS)
    dump_features(tiny_extractor(precision="bf16"), folder, tmp_path, pool="avg", resume=True, **OPTIONS)
    assert read_manifest(tmp_path).settings.precision == "bf16"


def test_a_manifest_with_a_bad_precision_is_refused(folder: Path, tmp_path: Path) -> None:
    dump_features(tiny_extractor(), folder, tmp_path, pool="avg", **OPTIONS)
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert Manifest.from_dict(data).settings.precision == "float32"  # absent: float32, as every earlier dump
    for bad in ("float32", "half", None):  # float32 is never written
        with pytest.raises(CorruptDumpError, match="precision"):
            Manifest.from_dict({**data, "precision": bad})
