"""``benchmarks/generative.py`` in quick mode: its files, its groups and the agreement of its numbers, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import load_script

pytest.importorskip("skimage")
pytest.importorskip("torch_fidelity")
pytest.importorskip("transformers")
pytest.importorskip("scipy")


@pytest.mark.slow  # four groups of whole jobs through the FID Inception, DINOv2 ViT-S/14 and a tiny CLIP: ~30 s
def test_generative_quick(tmp_path: Path, torch_home: Path) -> None:
    bench = load_script("benchmarks/generative.py")
    argv = ["--quick", "--out", str(tmp_path), "--torch-home", str(torch_home), "--no-plot"]
    payload = bench.main(argv)

    saved = json.loads((tmp_path / "generative.json").read_text())
    assert saved == json.loads(json.dumps(payload))
    assert saved["benchmark"] == "generative" and saved["quick"] is True and saved["partial"] is False
    assert saved["command"].startswith("python ")
    assert {"cpu", "cpu_isa", "cpu_count", "torch_threads", "versions", "date_utc"} <= set(saved["machine"])
    assert not (tmp_path / "generative.png").exists()
    markdown = (tmp_path / "generative.md").read_text()
    assert "| contender | median ms | IQR ms | ratio |" in markdown and "Machine: " in markdown
    config = saved["config"]
    assert config["images"] == 4 and config["workers"] == 0 and config["batch_size"] == 2
    assert config["dinov2_model"] == "vits14" and config["clip_model"] == "tiny" and config["is_splits"] == 2
    assert len(config["load_average_at_start"]) == 3

    groups = {group["case"]: group for group in saved["groups"]}
    assert list(groups) == [bench.CASES[name] for name in bench.GROUPS]
    expected = {
        "evaluate": ([bench.SEPARATE, bench.SHARED, bench.EVALUATE], "4+4"),
        "is": ([bench.TF_IS, bench.FH_IS], "4"),
        "cmmd": ([bench.REF_CMMD, bench.FH_CMMD], "4+4"),
        "fd_dinov2": ([bench.REF_FD, bench.FH_FD], "4+4"),
    }
    for name, (contenders, images) in expected.items():
        group = groups[bench.CASES[name]]
        rows = {row["name"]: row for row in group["rows"]}
        assert list(rows) == contenders and group["baseline"] == contenders[0] and group["rounds"] == 1
        assert group["params"] == {"images": images} and rows[contenders[0]]["ratio"] == pytest.approx(1.0)
        for row in rows.values():
            assert row["median_ms"] > 0 and row["images_per_s"] > 0 and row["peak_mib"] > 0
            assert len(row["load_average"]) == 3
            assert all(math.isfinite(value) for value in row["numbers"].values())

    # evaluate: the same eight numbers as the separate calls, bitwise (the same arithmetic on the same rows)
    rows = {row["name"]: row for row in groups[bench.CASES["evaluate"]]["rows"]}
    ours = rows[bench.EVALUATE]["numbers"]
    assert set(ours) == {"fid", "fd_dinov2", "kid_mean", "kid_std", "precision", "recall", "density", "coverage"}
    for name in (bench.SEPARATE, bench.SHARED):
        assert rows[name]["numbers"] == ours and rows[name]["max_rel_diff"] == 0.0

    # IS: torch-fidelity's number on the same weights file, a score that says something (the scaled fc)
    rows = {row["name"]: row for row in groups[bench.CASES["is"]]["rows"]}
    assert rows[bench.FH_IS]["is_mean"] > 1.01  # 1.04 at two images a split
    assert rows[bench.TF_IS]["max_rel_diff"] <= bench.AGREE_IS

    # CMMD: cmmd-pytorch's float32 MMD is all of the difference; the same embeddings in float64 give ours
    rows = {row["name"]: row for row in groups[bench.CASES["cmmd"]]["rows"]}
    reference, cmmd = rows[bench.REF_CMMD]["numbers"], rows[bench.FH_CMMD]["cmmd"]
    assert reference["cmmd_float64_mmd"] == pytest.approx(cmmd, rel=1e-6)
    assert reference["cmmd"] == pytest.approx(cmmd, rel=1e-2) and cmmd > 0

    # FD_DINOv2: dgm-eval's recipe (scipy's sqrtm of a singular product at 4 images) to float rounding
    rows = {row["name"]: row for row in groups[bench.CASES["fd_dinov2"]]["rows"]}
    assert rows[bench.REF_FD]["max_rel_diff"] <= 1e-5

    targets = {target["claim"]: target for target in saved["targets"]}
    assert len(targets) == 3 + 3 + 2 + 2
    for target in targets.values():
        assert math.isfinite(target["measured"]) and isinstance(target["met"], bool)
    assert targets["evaluate's numbers: max rel diff from the separate calls'"]["met"]
    assert targets["inception_score: max rel diff from torch-fidelity"]["met"]
    assert any("largest relative difference of each number" in note for note in saved["notes"])
