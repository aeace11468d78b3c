"""The typed dump manifest: the bytes of manifest.json, every field checked when read, resume comparisons."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from featurehooks import FeatureExtractor, dump_features, read_manifest
from featurehooks.dump import manifest as manifest_module
from featurehooks.dump.manifest import (
    UNRECORDED,
    CorruptDumpError,
    InputsRecord,
    Manifest,
    Settings,
    SkippedRow,
)
from featurehooks.errors import FeatureHooksError

DIGEST = "ab" * 32


def files_manifest() -> dict[str, Any]:
    """A complete dump of image files with one unreadable, keys in the order featurehooks has always written."""
    return {
        "format": "featurehooks.dump/1",
        "status": "complete",
        "backbone": "resnet18",
        "weights": "ResNet18_Weights.IMAGENET1K_V1",
        "weights_sha256": DIGEST,
        "layers": ["layer3", "layer4.1"],
        "shapes": {"layer3": [3, 256, 14, 14], "layer4.1": [3, 512, 7, 7]},
        "dtype": "float16",
        "pool": None,
        "preprocessing": {
            "mean": [0.485, 0.456, 0.406],
            "std": [0.229, 0.224, 0.225],
            "resize_size": 256,
            "crop_size": 224,
            "interpolation": "bilinear",
            "input_range": [0.0, 1.0],
            "image_shape": [3, 224, 224],
        },
        "inputs": {"kind": "files", "count": 3, "sha256": "cd" * 32, "identity_sha256": "ef" * 32},
        "chunk_size": 2,
        "files": {"layer3": "layer3.npy", "layer4.1": "layer4.1.npy"},
        "index": "index.csv",
        "versions": {"featurehooks": "0.1.0", "torch": "2.14.1", "python": "3.11.7"},
        "num_rows": 3,
        "num_valid": 2,
        "skipped": [{"row": 1, "path": "imgs/caf\udce9.png", "reason": "OSError: truncated"}],
    }


def dataset_manifest() -> dict[str, Any]:
    """A running dump of an (image, label) dataset begun before weights_sha256 was recorded."""
    return {
        "format": "featurehooks.dump/1",
        "status": "running",
        "backbone": "Sequential",
        "weights": None,
        "layers": ["a/b"],
        "shapes": {"a/b": [5, 4]},
        "dtype": "float32",
        "pool": "avg",
        "preprocessing": {"mean": None, "std": None, "input_range": [0, 1], "image_shape": [3, 16, 16]},
        "inputs": {"kind": "dataset", "count": 5, "sha256": "01" * 32, "labels": True},
        "chunk_size": 4,
        "files": {"a/b": "a_b.npy"},
        "labels": "labels.npy",
        "index": "index.csv",
        "versions": {"featurehooks": "0.1.0"},
    }


@pytest.mark.parametrize("written", [files_manifest, dataset_manifest])
def test_a_manifest_gives_back_the_dict_and_bytes_it_was_read_from(written: Any) -> None:
    data = written()
    manifest = Manifest.from_dict(copy.deepcopy(data))
    assert manifest.to_dict() == data and list(manifest.to_dict()) == list(data)
    assert list(manifest.to_dict()["inputs"]) == list(data["inputs"])
    assert manifest.to_json() == json.dumps(data, indent=2) + "\n"  # what store.write_manifest always wrote
    assert pickle.loads(pickle.dumps(manifest)) == manifest  # rank 0 broadcasts it


def test_fields_are_typed_attributes() -> None:
    manifest = Manifest.from_dict(files_manifest())
    settings = manifest.settings
    assert settings.layers == ("layer3", "layer4.1") and settings.shapes["layer4.1"] == (3, 512, 7, 7)
    assert settings.inputs == InputsRecord("files", 3, "cd" * 32, identity_sha256="ef" * 32)
    assert manifest.status == "complete" and manifest.num_rows == 3 and manifest.chunk_size == 2
    assert manifest.skipped == (SkippedRow(1, "imgs/caf\udce9.png", "OSError: truncated"),)
    assert manifest.files == {"layer3": "layer3.npy", "layer4.1": "layer4.1.npy"}
    older = Manifest.from_dict(dataset_manifest())
    assert older.settings.weights_sha256 is UNRECORDED and older.skipped is None and older.settings.inputs.labelled


def test_completing_a_manifest_accounts_for_every_row() -> None:
    running = Manifest.from_dict({**files_manifest(), "status": "running"})
    running = dataclasses.replace(running, skipped=None)
    assert "num_rows" not in running.to_dict() and "skipped" not in running.to_dict()
    complete = running.completed([SkippedRow(1, "imgs/caf\udce9.png", "OSError: truncated")])
    assert complete.to_dict() == files_manifest()


def test_the_dict_handed_out_is_a_copy() -> None:
    manifest = Manifest.from_dict(files_manifest())
    manifest.to_dict()["preprocessing"]["input_range"].append(9.0)
    manifest.to_dict()["versions"]["torch"] = "1.0"
    assert manifest.to_dict() == files_manifest()


def settings(**changes: Any) -> Settings:
    return dataclasses.replace(Manifest.from_dict(files_manifest()).settings, **changes)


def test_a_resume_compares_every_setting_by_its_manifest_name() -> None:
    base = settings()
    assert base.differences(settings()) == []
    assert settings(dtype="float32", pool="avg").differences(base) == ["dtype", "pool"]
    assert settings(weights_sha256=None).differences(base) == ["weights_sha256"]
    reordered = settings(shapes={"layer4.1": (3, 512, 7, 7), "layer3": (3, 256, 14, 14)})
    assert reordered.differences(base) == ["layers"]  # equal shapes, another order: other files
    other_inputs = settings(inputs=dataclasses.replace(base.inputs, sha256="00" * 32))
    assert other_inputs.differences(base) == ["inputs"]


def test_fields_an_earlier_dump_did_not_record_are_left_out() -> None:
    base = settings()
    earlier = settings(weights_sha256=UNRECORDED, inputs=dataclasses.replace(base.inputs, identity_sha256=None))
    assert base.differences(earlier) == []
    assert settings(weights="DEFAULT").differences(earlier) == ["weights"]
    assert earlier.differences(base) == ["weights_sha256", "inputs"]  # recorded then, so compared


def corrupt(**fields: Any) -> dict[str, Any]:
    """The files manifest with ``fields`` replaced (``...`` removes one)."""
    data = {**files_manifest(), **fields}
    return {key: value for key, value in data.items() if value is not ...}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (corrupt(status="done"), "status 'done' is neither 'running' nor 'complete'"),
        (corrupt(status=...), "status is missing"),
        (corrupt(chunk_size=True), "chunk_size True is not a positive integer"),
        (corrupt(inputs={"kind": "files", "count": 0, "sha256": DIGEST}), "inputs.count 0 is not a positive"),
        (corrupt(layers=["layer3", "layer3"]), "layers .* repeats a name"),
        (corrupt(layers=[]), r"layers \[\] is not a list of names"),
        (corrupt(shapes={"layer4.1": [3, 512, 7, 7], "layer3": [3, 256, 14, 14]}), "shapes does not list the layers"),
        (corrupt(shapes={"layer3": [3, 256], "layer4.1": [3, 512, -7]}), r"shapes\['layer4.1'\]"),
        (corrupt(files={"layer3": "layer3.npy", "layer4.1": "../x.npy"}), "files does not map each layer"),
        (corrupt(dtype="float64"), "dtype 'float64' is not one of float16, float32"),
        (corrupt(num_rows=4), "num_rows 4 is not inputs.count"),
        (corrupt(num_valid=True), "num_valid True is not num_rows minus"),
        (corrupt(skipped=[{"row": 1, "path": "x", "reason": "y", "valid": 0}]), "skipped is not a list"),
        (corrupt(skipped=[{"row": 1, "path": "x", "reason": "y"}] * 2, num_valid=1), "skipped lists a row twice"),
        (corrupt(backbone=7), "backbone 7 is not a string"),
        (corrupt(weights=...), "weights is missing"),
        (corrupt(weights_sha256=1), "weights_sha256 1 is not a string or null"),
        (corrupt(pool=0), "pool 0 is not a string or null"),
        (corrupt(preprocessing=[1]), "preprocessing is a list, not an object"),
        (corrupt(inputs={"kind": "folder", "count": 3, "sha256": DIGEST}), "inputs.kind 'folder' is neither"),
        (corrupt(inputs={"kind": "files", "count": 3}), "inputs.sha256 is missing"),
        (corrupt(inputs={"kind": "files", "count": 3, "sha256": DIGEST, "labels": False}), "inputs.labels False"),
        (corrupt(inputs={"kind": "files", "count": 3, "sha256": DIGEST, "n": 1}), "unknown field.*'inputs.n'"),
        (corrupt(labels="labels.npy"), "labels 'labels.npy' is set, though inputs.labels is not"),
        (corrupt(index="rows.csv"), "index 'rows.csv' is not 'index.csv'"),
        (corrupt(versions={"torch": 2}), "versions is not an object of version strings"),
        (corrupt(comment="mine"), "unknown field.*'comment'"),
    ],
)
def test_every_field_is_checked(data: dict[str, Any], message: str) -> None:
    with pytest.raises(CorruptDumpError, match=message) as caught:
        Manifest.from_dict(data, "out/manifest.json")
    text = str(caught.value)
    assert text.startswith("out/manifest.json: ") and text.endswith("pass overwrite=True (--overwrite) to start over")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FeatureHooksError)


def test_labels_must_name_labels_npy_when_the_items_carry_labels() -> None:
    with pytest.raises(CorruptDumpError, match="labels None is not 'labels.npy'"):
        Manifest.from_dict({key: value for key, value in dataset_manifest().items() if key != "labels"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "is not a featurehooks dump manifest"),
        ({"format": "other/1"}, "is not a featurehooks dump manifest"),
        ({**files_manifest(), "format": "featurehooks.dump/2"}, "schema 'featurehooks.dump/2'.* reads"),
    ],
)
def test_a_file_of_another_schema_is_named_so(data: Any, message: str) -> None:
    with pytest.raises(CorruptDumpError, match=message):
        Manifest.from_dict(data)


def test_a_complete_dump_marked_running_again_keeps_its_row_accounting() -> None:
    data = {**files_manifest(), "status": "running"}  # what tests and people do to "unfinish" a dump
    manifest = Manifest.from_dict(data)
    assert manifest.status == "running" and manifest.to_dict() == data


def test_a_dump_writes_what_its_manifest_reads_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3, stride=2), relu=nn.ReLU()))
    images = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    result = dump_features(FeatureExtractor(net, ["relu"]), images, tmp_path, batch_size=2, progress=False)
    text = (tmp_path / "manifest.json").read_text()
    manifest = Manifest.read(tmp_path / "manifest.json")
    assert manifest is not None and manifest.to_json() == text
    assert result.manifest == read_manifest(tmp_path) == manifest  # users get the typed manifest
    assert manifest.to_dict() == json.loads(text) and manifest.num_valid == 3 and manifest.skipped == ()
    assert manifest.settings.inputs == InputsRecord("dataset", 3, manifest.settings.inputs.sha256)
    assert Manifest.read(tmp_path / "missing.json") is None


def test_a_hostile_manifest_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deeply nested manifest.json raised a bare RecursionError; a huge one was read whole."""
    path = tmp_path / "manifest.json"
    cases = {
        "[" * 100_000 + "]" * 100_000: "nests more than 16 levels deep",  # beyond json's own recursion limit
        json.dumps({**files_manifest(), "preprocessing": {"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}): "more than 16",
        json.dumps(files_manifest()) + " " * (1 << 20): "bytes, more than a manifest holds",
    }
    for text, message in cases.items():
        if "holds" in message:
            monkeypatch.setattr(manifest_module, "_MAX_BYTES", 1 << 20)
        path.write_text(text)
        with pytest.raises(CorruptDumpError, match=message) as caught:
            Manifest.read(path)
        assert "\n" not in str(caught.value) and str(path) in str(caught.value)
    path.write_text(json.dumps(files_manifest()))
    assert Manifest.read(path) == Manifest.from_dict(files_manifest())  # 4 levels deep, within the size


def test_the_dict_access_of_earlier_releases_warns_and_still_answers() -> None:
    manifest, data = Manifest.from_dict(files_manifest()), files_manifest()
    with pytest.warns(FutureWarning, match=r"manifest\['layers'\]: .* use manifest\.settings\.layers \(typed\), or "):
        assert manifest["layers"] == data["layers"]
    with pytest.warns(FutureWarning, match=r"'skipped' in manifest: .* manifest\.skipped .* in manifest\.to_dict"):
        assert "skipped" in manifest
    with pytest.warns(FutureWarning, match=r"manifest\.get\('labels'\): .* manifest\.settings\.inputs\.labelled"):
        assert manifest.get("labels", "none") == "none"
    with pytest.warns(FutureWarning, match=r"use manifest\.to_dict\(\)\['format'\]"):  # no attribute: a constant
        assert manifest["format"] == "featurehooks.dump/1"
    with pytest.warns(FutureWarning, match=r"manifest\.to_dict\(\)\.items\(\)"):
        assert dict(manifest.items()) == data
    with pytest.warns(FutureWarning) as caught:
        assert list(manifest) == list(manifest.keys()) == list(data)
        assert list(manifest.values()) == list(data.values())
        assert "nothing" not in manifest and manifest.get("num_valid") == 2
    assert [warning.filename for warning in caught] == [__file__] * 5  # the warning names the caller's line


def test_a_manifest_without_dict_access_does_not_warn(tmp_path: Path) -> None:
    manifest = Manifest.from_dict(files_manifest())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert manifest and manifest.num_valid == 2 and manifest.files["layer3"] == "layer3.npy"
        assert manifest == Manifest.from_dict(files_manifest()) and pickle.loads(pickle.dumps(manifest)) == manifest
        assert read_manifest(tmp_path) is None
