"""``benchmarks/memory_formats.py`` in quick mode: its files, its structure and its output checks, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from featurehooks import _formats

from helpers import load_script

pytest.importorskip("matplotlib")
pytest.importorskip("timm")


def _argv(tmp_path: Path, torch_home: Path) -> list[str]:
    return ["--quick", "--threads", "1", "--out", str(tmp_path), "--torch-home", str(torch_home), "--sizes", "32,128"]


@pytest.mark.slow
def test_memory_formats_quick(tmp_path: Path, torch_home: Path) -> None:
    bench = load_script("benchmarks/memory_formats.py")
    argv = _argv(tmp_path, torch_home)
    payload = bench.main(argv)

    saved = json.loads((tmp_path / "memory_formats.json").read_text())
    assert saved == json.loads(json.dumps(payload))
    assert saved["benchmark"] == "memory_formats" and saved["quick"] is True and saved["partial"] is False
    assert saved["command"] == "python benchmarks/memory_formats.py " + " ".join(argv)
    assert {"cpu", "cpu_count", "torch_threads", "device", "versions", "date_utc"} <= set(saved["machine"])
    markdown = (tmp_path / "memory_formats.md").read_text()
    assert "| contender | median ms | IQR ms | ratio | format | conv share |" in markdown
    assert (tmp_path / "memory_formats.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the quick cases: one convolutional model, one token model (auto -> contiguous)
    config = saved["config"]
    assert config["models"] == [case.key for case in bench.QUICK] and config["batches"] == [1, 2]
    assert config["sizes"] == [32, 128]
    cases = config["cases"]
    conv, vit = (cases[case.key] for case in bench.QUICK)
    assert conv["conv_share"] >= 0.5 and vit["conv_share"] < 0.5
    assert all(case["cpu_s"] >= 0 for case in cases.values())

    groups = saved["groups"]
    titles = [conv["title"], vit["title"]]
    assert [g["case"] for g in groups] == [conv["title"]] * 8 + [vit["title"]] * 4
    assert [(g["params"]["size"], g["params"]["mode"], g["params"]["batch"]) for g in groups[:8]] == [
        (size, mode, batch) for size in (32, 128) for batch in (1, 2) for mode in ("no-grad", "grad")
    ]
    assert [g["params"]["size"] for g in groups[8:]] == [224] * 4  # the ViT keeps its fixed size
    # the rule's decisions: a graph runs NCHW; without one, channels-last only where the rule says it pays
    decisions = [
        (g["params"]["mode"], g["params"]["batch"], g["params"]["size"], g["params"]["auto ran"]) for g in groups[:8]
    ]
    work = _formats.ConvWork(**conv["conv_work"])
    for mode, batch, size, ran in decisions:
        graph = mode == "grad"
        assert ran == ("contiguous" if graph else _formats.auto_format(work, "cpu", (batch, 3, size, size)))
    assert {g["params"]["auto ran"] for g in groups[8:]} == {"contiguous"}
    for group, case in zip(groups, [conv] * 8 + [vit] * 4):
        rows = {row["name"]: row for row in group["rows"]}
        assert list(rows) == [bench.CONTIGUOUS, bench.CHANNELS_LAST, bench.AUTO]
        assert group["baseline"] == bench.CONTIGUOUS and rows[bench.CONTIGUOUS]["ratio"] == pytest.approx(1.0)
        assert group["rounds"] >= 1
        for row in rows.values():
            assert row["median_ms"] > 0 and math.isfinite(row["ratio"])
            assert row["p25_ms"] <= row["median_ms"] <= row["p75_ms"]
        assert rows[bench.CONTIGUOUS]["format"] == "contiguous"
        assert rows[bench.CHANNELS_LAST]["format"] == "channels_last"
        assert rows[bench.AUTO]["format"] == group["params"]["auto ran"]
        assert rows[bench.AUTO]["conv_share"] == case["conv_share"]
        assert rows[bench.CONTIGUOUS]["conv_share"] is None and rows[bench.CHANNELS_LAST]["conv_share"] is None
        # same tensors as NCHW: float32 rounding (features), looser for input gradients (a ReLU/max-pool tie)
        assert rows[bench.CONTIGUOUS]["max_abs_diff"] == 0.0
        bound = 1e-4 if group["params"]["mode"] == "no-grad" else 0.5
        assert rows[bench.CHANNELS_LAST]["max_rel_diff"] <= bound, rows
        # auto runs exactly the format it names: its outputs are those of that contender, bit for bit
        twin = bench.CONTIGUOUS if group["params"]["auto ran"] == "contiguous" else bench.CHANNELS_LAST
        assert rows[bench.AUTO]["max_abs_diff"] == rows[twin]["max_abs_diff"]

    targets = saved["targets"]
    assert len(targets) == 2 * len(groups)
    best = f"{bench.AUTO} / best of {bench.CONTIGUOUS} and {bench.CHANNELS_LAST}"
    claims = {f"{bench.AUTO} / {bench.CONTIGUOUS}", best}
    assert {t["claim"] for t in targets} == claims
    for target in targets:
        assert target["limit"] == 1.03 and target["kind"] == "<=" and math.isfinite(target["measured"])
    assert sum(line.startswith(tuple(titles)) for line in saved["notes"]) == 2  # one overview line per model


def test_best_ratio_takes_the_faster_format() -> None:
    bench = load_script("benchmarks/memory_formats.py")
    R = bench.R
    rows = [
        R.Row(name, ms, ms, ms, ms / 10.0)
        for name, ms in ((bench.CONTIGUOUS, 10.0), (bench.CHANNELS_LAST, 8.0), (bench.AUTO, 8.4))
    ]
    group = R.Group("case", {"mode": "no-grad"}, bench.CONTIGUOUS, 5, 1, rows)
    assert bench.best_ratio(group) == pytest.approx(8.4 / 8.0)
    by_claim = {t.claim: t for t in bench.targets([group])}
    assert by_claim[f"{bench.AUTO} / {bench.CONTIGUOUS}"].met
    assert not by_claim[f"{bench.AUTO} / best of {bench.CONTIGUOUS} and {bench.CHANNELS_LAST}"].met


def test_unknown_model_is_refused(tmp_path: Path, torch_home: Path) -> None:
    bench = load_script("benchmarks/memory_formats.py")
    with pytest.raises(SystemExit, match="unknown models"):
        bench.main([*_argv(tmp_path, torch_home), "--models", "resnet9000"])
