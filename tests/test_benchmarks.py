"""The benchmark scripts in quick mode, so they never rot: outputs and structure, never timings."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytest.importorskip("matplotlib")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_fh_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """The scripts seed torch and may set threads; leave the rest of the session as it was."""
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    path = list(sys.path)
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(rng)
    sys.path[:] = path


def _common(tmp_path: Path, torch_home: Path) -> list[str]:
    return ["--quick", "--threads", "1", "--out", str(tmp_path), "--torch-home", str(torch_home)]


def _check_files(tmp_path: Path, name: str, payload: dict) -> None:
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert saved["benchmark"] == name and saved["quick"] is True and saved["partial"] is False
    assert saved["machine"]["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert {"cpu", "cpu_count", "torch_threads", "device", "versions", "date_utc"} <= set(saved["machine"])
    assert saved["groups"] == json.loads(json.dumps(payload["groups"]))
    markdown = (tmp_path / f"{name}.md").read_text()
    assert "| contender | median ms | IQR ms | ratio |" in markdown and "Command: `python" in markdown
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for group in saved["groups"]:
        assert group["rounds"] >= 1
        baseline = [row for row in group["rows"] if row["name"] == group["baseline"]]
        assert len(baseline) == 1 and baseline[0]["ratio"] == pytest.approx(1.0)
        for row in group["rows"]:
            assert row["median_ms"] > 0 and math.isfinite(row["ratio"])
            assert row["p25_ms"] <= row["median_ms"] <= row["p75_ms"]
    for target in saved["targets"]:
        assert {"claim", "measured", "limit", "met"} <= set(target) and math.isfinite(target["measured"])


def test_extraction_quick(tmp_path: Path, torch_home: Path) -> None:
    extraction = _load("extraction")
    payload = extraction.main(
        [*_common(tmp_path, torch_home), "--cases", "vgg16-relu3_3,timm-convnext,timm-vit", "--shapes", "1x32"]
    )
    _check_files(tmp_path, "extraction", payload)
    groups = payload["groups"]
    vit = "timm ViT-S/16 (vit_small_patch16_224) blocks.5+blocks.8"
    cases = {"VGG16 relu3_3", "timm convnext_tiny stages.1+stages.2", vit}
    assert {g["case"] for g in groups} == cases
    assert {g["params"]["mode"] for g in groups} == {"no-grad", "grad"}
    assert len(groups) == 2 * len(cases)
    for group in groups:
        names = [row["name"] for row in group["rows"]]
        is_vit = group["case"] == vit
        nchw = [extraction.FE_NCHW] if is_vit else []
        assert names[:4 + len(nchw)] == [extraction.FULL, extraction.FLOOR, extraction.FE, *nchw, extraction.NO_EE]
        assert (extraction.FE_NCHW in names) == is_vit
        assert extraction.FX in names  # the ViT traces with timm's tracer settings
        assert (extraction.TIMM in names) == group["case"].startswith("timm")
        for row in group["rows"]:
            if row["name"] == extraction.FULL:  # logits: nothing to compare
                assert row["max_abs_diff"] is None and row["compared_with"] is None
                continue
            # every contender returns the floor's tensors: ViT maps (FE nchw, timm) the floor's tokens as maps
            maps = is_vit and row["name"] in (extraction.FE_NCHW, extraction.TIMM)
            assert row["compared_with"] == ("floor as maps" if maps else "floor"), row
            assert row["max_abs_diff"] <= 1e-4, row
    claims = {t["claim"] for t in payload["targets"]}
    assert "FeatureExtractor / bare truncated" in claims and "FeatureExtractor / timm forward_intermediates" in claims
    nchw_targets = [t for t in payload["targets"] if t["claim"] == "FeatureExtractor nchw / timm forward_intermediates"]
    assert len(nchw_targets) == 2 and all(t["group"].startswith(vit) and t["limit"] == 1.03 for t in nchw_targets)


def test_extraction_vit_reference_catches_a_wrong_layout(torch_home: Path) -> None:
    """The ViT maps check compares positions, not just shapes: a transposed grid is caught."""
    extraction = _load("extraction")
    models = extraction.build_vit(extraction.VIT_LAYERS)
    try:
        x = torch.rand(2, 3, 48, 32)  # a 3 x 2 patch grid: rows and columns differ
        cpu = torch.device("cpu")
        refs = extraction.references(models, x, "no-grad", "fp32", cpu)
        fns = extraction.contenders(models, x, "no-grad", "fp32", cpu)
        maps = fns[extraction.FE_NCHW]()
        assert [tuple(m.shape) for m in maps] == [(2, 384, 3, 2)] * 2
        assert extraction.H.max_abs_diff(maps, refs["floor as maps"]) <= 1e-5
        assert extraction.H.max_abs_diff(fns[extraction.TIMM](), refs["floor as maps"]) <= 1e-5
        assert extraction.H.max_abs_diff(fns[extraction.FE](), refs["floor"]) <= 1e-5
        wrong = [m.flatten(2).unflatten(2, (2, 3)).transpose(2, 3) for m in maps]  # same shape, shuffled positions
        assert extraction.H.max_abs_diff(wrong, refs["floor as maps"]) > 1e-3
    finally:
        extraction._release(models)


def test_losses_quick(tmp_path: Path, torch_home: Path) -> None:
    losses = _load("losses")
    payload = losses.main(_common(tmp_path, torch_home))
    _check_files(tmp_path, "losses", payload)
    by_case = {g["case"]: {row["name"]: row for row in g["rows"]} for g in payload["groups"]}
    content = by_case[losses.CONTENT]
    # the contenders compute the same loss on the same weights (each in its library's scale)
    assert content[losses.PL]["loss"] == pytest.approx(content[losses.FLOOR]["loss"], rel=1e-4)
    assert content[losses.PIQ]["loss"] == pytest.approx(256 * content[losses.PL]["loss"], rel=1e-4)
    lpips_case = by_case[losses.LPIPS_CASE]
    assert lpips_case[losses.FH_LPIPS]["loss"] == pytest.approx(lpips_case[losses.LPIPS_BASE]["loss"], rel=1e-3)
    style = by_case[losses.STYLE]
    for name in (losses.FH_STYLE, losses.FH_STYLE_FIXED, losses.PIQ_STYLE):
        assert style[name]["loss"] == pytest.approx(style[losses.STYLE_FLOOR]["loss"], rel=1e-4)
    for rows in by_case.values():
        assert all(row["peak_mib"] >= 0 for row in rows.values())
    assert any(t["claim"].startswith("piq ContentLoss time") for t in payload["targets"])


def test_compile_quick(tmp_path: Path, torch_home: Path) -> None:
    compile_bench = _load("compile")
    payload = compile_bench.main(_common(tmp_path, torch_home))  # --quick: backend "eager", dynamo tracing only
    _check_files(tmp_path, "compile", payload)
    rows = {row["name"]: row for g in payload["groups"] for row in g["rows"]}
    assert {"FeatureExtractor (compiled)", "torchvision FX (compiled)", "PerceptualLoss (compiled)"} <= set(rows)
    for name, row in rows.items():
        assert row["max_abs_diff"] <= 1e-4, name
        if name.endswith("(compiled)"):
            assert row["graphs"] >= 1 and row["graph_breaks"] >= 0


def test_hook_overhead_quick(tmp_path: Path, torch_home: Path) -> None:
    overhead = _load("hook_overhead")
    payload = overhead.main(_common(tmp_path, torch_home))
    _check_files(tmp_path, "hook_overhead", payload)
    (group,) = payload["groups"]
    rows = {row["name"]: row for row in group["rows"]}
    assert list(rows) == [overhead.FLOOR, overhead.ONE, overhead.ALL, overhead.CAPTURE]
    assert rows[overhead.FLOOR]["us_per_tap"] is None and all(
        math.isfinite(rows[name]["us_per_tap"]) for name in (overhead.ONE, overhead.ALL, overhead.CAPTURE)
    )
    claims = {t["claim"] for t in payload["targets"]}
    assert claims == {f"{overhead.ALL}: µs per tap", f"{overhead.CAPTURE}: µs per tap"}


def test_probes_quick(tmp_path: Path, torch_home: Path) -> None:
    probes = _load("probes")
    payload = probes.main(_common(tmp_path, torch_home))
    _check_files(tmp_path, "probes", payload)
    (group,) = payload["groups"]
    rows = {row["name"]: row for row in group["rows"]}
    assert list(rows) == [probes.BASE, probes.WATCH, probes.NONFINITE, probes.HAND, probes.ANOMALY]
    for row in rows.values():  # identical copies and batches: no probe changes the training step
        assert row["max_abs_diff"] == 0.0 and row["steps"] >= 3, row
    assert payload["config"]["watched_layers"] == 16 and payload["config"]["watch_rows"] == 32
    claims = {t["claim"] for t in payload["targets"]}
    assert claims == {f"{probes.WATCH} / {probes.BASE}", f"{probes.NONFINITE} / {probes.BASE}"}


def test_metrics_quick(tmp_path: Path, torch_home: Path) -> None:
    metrics = _load("metrics")
    payload = metrics.main([*_common(tmp_path, torch_home), "--nets", "alex,squeeze"])
    _check_files(tmp_path, "metrics", payload)
    groups = payload["groups"]
    assert {(g["case"], g["params"]["net"]) for g in groups} == {
        (case, net) for case in (metrics.METRIC, metrics.LOSS) for net in ("alex", "squeeze")
    }
    for group in groups:
        rows = {row["name"]: row for row in group["rows"]}
        expected = [metrics.FH, metrics.FH_ONE, metrics.FH_TWO, metrics.REF] if group["case"] == metrics.METRIC \
            else [metrics.FH, metrics.FH_ONE, metrics.REF]
        assert list(rows) == expected and group["baseline"] == metrics.REF
        for row in rows.values():  # every contender computes lpips' distances (metric) or input gradients (loss)
            assert row["max_abs_diff"] <= 1e-4, row
            assert row["peak_mib"] >= 0
        assert rows[metrics.FH]["forward"] in ("one", "two")
    claims = {t["claim"].split(" (")[0] for t in payload["targets"]}
    assert {"metric: LPIPS peak / lpips peak", "loss: LPIPS peak / lpips peak"} <= claims
