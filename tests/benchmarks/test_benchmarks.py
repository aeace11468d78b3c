"""The benchmark scripts in quick mode, so they never rot: outputs and structure, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from helpers import load_script

pytestmark = pytest.mark.slow  # each runs a benchmark script's timing rounds

pytest.importorskip("matplotlib")


def _common(tmp_path: Path, torch_home: Path) -> list[str]:
    return ["--quick", "--threads", "1", "--out", str(tmp_path), "--torch-home", str(torch_home)]


def _run_quick(name: str, tmp_path: Path, torch_home: Path, *extra: str) -> tuple[ModuleType, dict]:
    """Run ``benchmarks/<name>.py`` in quick mode and check the files it wrote; its module and its payload."""
    script = load_script(f"benchmarks/{name}.py")
    payload = script.main([*_common(tmp_path, torch_home), *extra])
    _check_files(tmp_path, name, payload)
    return script, payload


def _single_group_rows(payload: dict) -> dict[str, dict]:
    """The rows of a payload's one group, by name."""
    (group,) = payload["groups"]
    return {row["name"]: row for row in group["rows"]}


def _check_files(tmp_path: Path, name: str, payload: dict) -> None:
    saved = json.loads((tmp_path / f"{name}.json").read_text())
    assert saved["benchmark"] == name and saved["quick"] is True and saved["partial"] is False
    assert saved["machine"]["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert {"cpu", "cpu_isa", "cpu_count", "torch_threads", "device", "versions", "date_utc"} <= set(saved["machine"])
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


def test_extraction_quick(tmp_path: Path, torch_home: Path, vgg16_cached: Path) -> None:
    # the timm convnext case runs the vit case's code on NCHW stages: left to the full run
    options = ("--cases", "vgg16-relu3_3,timm-vit", "--shapes", "2x32")
    e, payload = _run_quick("extraction", tmp_path, torch_home, *options)
    groups = payload["groups"]
    vit = "timm ViT-S/16 (vit_small_patch16_224) blocks.5+blocks.8"
    vgg = "VGG16 relu3_3"
    cases = {vgg, vit}
    assert {g["case"] for g in groups} == cases
    assert {g["params"]["mode"] for g in groups} == {"no-grad", "grad"}
    assert len(groups) == 2 * len(cases)
    formats = [e.FLOOR, e.FLOOR_CL, e.FE, e.FE_CONTIGUOUS, e.FE_CHANNELS_LAST]
    # FeatureExtractor (auto) and contiguous in bf16 where this CPU has native bfloat16 (fp16: AVX512-FP16 CPUs)
    reduced = e.reduced_precisions(torch.device("cpu"))  # featurehooks' precisions below float32 on this CPU
    in_precision = list(e.precision_variants(reduced))
    assert len(in_precision) == 2 * len(reduced)
    for group in groups:
        rows = {row["name"]: row for row in group["rows"]}
        is_vit, is_vgg = group["case"] == vit, group["case"] == vgg
        tail = [e.NO_EE, e.FULL, e.FX] if is_vgg else [e.FE_NCHW, e.FX, e.TIMM] if is_vit else [e.FX, e.TIMM]
        assert list(rows) == [*formats, *in_precision, *tail] and group["baseline"] == e.FLOOR
        # the memory format each backbone ran in: "auto" runs NCHW in a graph, and at 32 px without one too (each
        # of VGG16's weights is used ~110 times per image there: too few for channels-last to pay)
        assert rows[e.FE]["format"] == "contiguous"
        assert rows[e.FE_CONTIGUOUS]["format"] == rows[e.FLOOR]["format"] == rows[e.FX]["format"] == "contiguous"
        assert rows[e.FE_CHANNELS_LAST]["format"] == rows[e.FLOOR_CL]["format"] == "channels_last"
        for row in rows.values():
            if row["name"] == e.FULL:  # logits: nothing to compare
                assert row["max_abs_diff"] is None and row["compared_with"] is None
                continue
            # every contender returns the tensors of the hand-written loop in its own memory format; ViT maps
            # (FE nchw, timm) the floor's tokens as maps
            maps = is_vit and row["name"] in (e.FE_NCHW, e.TIMM)
            channels_last = row["format"] == "channels_last" and row["name"] != e.FLOOR_CL
            expected = ("channels_last floor" if channels_last else "floor") + (" as maps" if maps else "")
            assert row["compared_with"] == expected, row
            if row["name"] in in_precision:  # bf16 rounding of weights and activations (and of the gradient)
                assert row["max_rel_diff"] <= (0.5 if group["params"]["mode"] == "grad" else 0.05), row
            elif row["name"] == e.FLOOR_CL and group["params"]["mode"] == "grad":
                # another summation order: a ReLU / max-pool near-tie may move a gradient entry
                assert row["max_rel_diff"] <= 0.5, row
            else:  # float32 rounding at most
                assert row["max_abs_diff"] <= 1e-4 and row["max_rel_diff"] <= 1e-4, row
    targets = payload["targets"]
    claims = [t["claim"] for t in targets]
    for claim in (f"{e.FE} / {e.FE_CONTIGUOUS}", f"{e.FE} / {e.FLOOR}"):  # "auto" at most 3% slower than NCHW
        found = [t for t in targets if t["claim"] == claim]
        assert len(found) == len(groups) and all(t["limit"] == 1.03 and t["kind"] == "<=" for t in found)
    headline = [t for t in targets if t["group"].startswith(f"{vgg}:")]
    speedups = {
        (t["claim"], t["group"].split("mode=")[1].split(",")[0]): t
        for t in headline
        if t["claim"].endswith("(speed-up)")
    }
    assert set(speedups) == {(f"{other} / {e.FE} (speed-up)", "no-grad") for other in (e.FLOOR, e.FX)}
    assert all(t["limit"] == 1.1 and t["kind"] == ">=" for t in speedups.values())
    for precision in reduced:  # auto at most 3% slower than contiguous in every group; bf16 >= 1.5x float32
        auto = e.R.with_precision(e.FE, precision)
        found = [t for t in targets if t["claim"] == f"{auto} / {e.R.with_precision(e.FE_CONTIGUOUS, precision)}"]
        assert len(found) == len(groups) and all(t["limit"] == 1.03 for t in found)
    bf16 = [t for t in targets if t["claim"] == f"{e.FE} / {e.R.with_precision(e.FE, 'bf16')} (bf16 speed-up)"]
    assert len(bf16) == ("bf16" in reduced)  # VGG16 relu3_3 without a graph at batch 2 only
    assert all(t["group"].startswith(f"{vgg}: mode=no-grad") and t["limit"] == 1.5 for t in bf16)
    assert f"{e.FE_CONTIGUOUS} / {e.FLOOR} (hook overhead)" in claims and f"{e.FE} / {e.TIMM}" in claims
    nchw_targets = [t for t in targets if t["claim"] == f"{e.FE_NCHW} / {e.TIMM}"]
    assert len(nchw_targets) == 2 and all(t["group"].startswith(vit) and t["limit"] == 1.03 for t in nchw_targets)
    # the speed-up claims are about batches on the CPU: none at batch 1, none on a GPU
    for batch, device in ((1, "cpu"), (2, "cuda")):
        found = e.targets([_group(e, groups[0], batch=batch)], device)
        assert found and not [t for t in found if "speed-up" in t.claim]


def _group(module: ModuleType, group: dict, **params: object) -> object:
    """A saved group back as a `_report` Group, with some params replaced."""
    R = module.R
    rows = [R.Row(r["name"], r["median_ms"], r["p25_ms"], r["p75_ms"], r["ratio"], {}) for r in group["rows"]]
    return R.Group(
        group["case"],
        {**group["params"], **params},
        group["baseline"],
        group["rounds"],
        group["calls_per_sample"],
        rows,
    )


def test_extraction_vit_reference_catches_a_wrong_layout(torch_home: Path) -> None:
    """The ViT maps check compares positions, not just shapes: a transposed grid is caught."""
    extraction = load_script("benchmarks/extraction.py")
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
        extraction.release_models(models)


def test_losses_quick(tmp_path: Path, torch_home: Path, vgg16_cached: Path) -> None:
    losses, payload = _run_quick("losses", tmp_path, torch_home)
    L = losses
    # featurehooks' losses (auto, contiguous) also in bf16 where this CPU has native bfloat16, after their float32 rows
    reduced = L.reduced_precisions(torch.device("cpu"))
    in_precision = {L.R.with_precision(name, p) for p in reduced for pair in L.FORMAT_PAIRS for name in pair[:2]}
    assert len(in_precision) == 6 * len(reduced)
    rows_by_case = {g["case"]: [row["name"] for row in g["rows"]] for g in payload["groups"]}
    assert rows_by_case == {case: L.contenders(case, reduced) for case in L.GROUPS}
    float32, bf16_rows = L.GROUPS[L.CONTENT], [L.R.with_precision(name, "bf16") for name in (L.PL, L.PL_CONTIGUOUS)]
    assert L.contenders(L.CONTENT, ["bf16"]) == [*float32[:5], *bf16_rows, *float32[5:]]  # after PL contiguous
    assert all(g["params"]["batch"] == 2 for g in payload["groups"])  # --quick: 2x32, batch >= 2 for the targets
    by_case = {g["case"]: {row["name"]: row for row in g["rows"]} for g in payload["groups"]}
    content = by_case[L.CONTENT]
    # the contenders compute the same loss on the same weights (each in its library's scale)
    for name in (L.FLOOR_CL, L.FLOOR_CAT, L.PL, L.PL_CONTIGUOUS):
        assert content[name]["loss"] == pytest.approx(content[L.FLOOR]["loss"], rel=1e-4), name
    floors = {L.CONTENT: L.FLOOR, L.LPIPS_CASE: L.LPIPS_FLOOR, L.STYLE: L.STYLE_FLOOR}
    for case, rows in by_case.items():  # bf16 changes the loss at bf16 rounding (the library's tests: 2%)
        for name in in_precision & set(rows):
            assert rows[name]["loss"] == pytest.approx(rows[floors[case]]["loss"], rel=2e-2), name
    assert content[L.PIQ]["loss"] == pytest.approx(256 * content[L.PL]["loss"], rel=1e-4)
    lpips_case = by_case[L.LPIPS_CASE]
    for name in (L.FH_LPIPS, L.FH_LPIPS_CONTIGUOUS):
        assert lpips_case[name]["loss"] == pytest.approx(lpips_case[L.LPIPS_BASE]["loss"], rel=1e-3), name
    style = by_case[L.STYLE]
    for name in (L.FH_STYLE, L.FH_STYLE_CONTIGUOUS, L.FH_STYLE_FIXED, L.PIQ_STYLE):
        assert style[name]["loss"] == pytest.approx(style[L.STYLE_FLOOR]["loss"], rel=1e-4), name
    # a loss step builds a graph, so "auto" runs NCHW as the floors and the other libraries do
    formats = {
        name: row["format"] for rows in by_case.values() for name, row in rows.items() if name not in in_precision
    }
    channels_last = {L.FLOOR_CL}
    assert formats == {name: "channels_last" if name in channels_last else "contiguous" for name in formats}
    for rows in by_case.values():
        assert all(row["peak_mib"] >= 0 for row in rows.values())
    claims = {t["claim"]: t for t in payload["targets"]}
    assert f"{L.FLOOR} / {L.PL} (speed-up)" not in claims  # a loss step runs NCHW: the floor itself
    assert claims[f"{L.PIQ} time / {L.PL} time"]["limit"] == 1.3  # CPU, batch >= 2
    assert claims[f"{L.FLOOR_CAT} / {L.FLOOR} (two forwards stay)"]["kind"] == ">="
    for auto, contiguous, floor in L.FORMAT_PAIRS:
        assert claims[f"{auto} / {contiguous}"]["limit"] == claims[f"{auto} / {floor}"]["limit"] == 1.03
        for p in reduced:
            assert claims[f"{L.R.with_precision(auto, p)} / {L.R.with_precision(contiguous, p)}"]["limit"] == 1.03
    bf16 = claims.get(f"{L.PL} / {L.R.with_precision(L.PL, 'bf16')} (bf16 speed-up)")
    assert (bf16 is not None) == ("bf16" in reduced) and (bf16 is None or bf16["limit"] == 1.5)


def test_compile_quick(tmp_path: Path, torch_home: Path, vgg16_cached: Path) -> None:
    compile_bench, payload = _run_quick("compile", tmp_path, torch_home)  # --quick: backend "eager", tracing only
    rows = {row["name"]: row for g in payload["groups"] for row in g["rows"]}
    assert {"FeatureExtractor (compiled)", "torchvision FX (compiled)", "PerceptualLoss (compiled)"} <= set(rows)
    for name, row in rows.items():
        assert row["max_abs_diff"] <= 1e-4, name
        if name.endswith("(compiled)"):
            assert row["graphs"] >= 1 and row["graph_breaks"] >= 0


def test_hook_overhead_quick(tmp_path: Path, torch_home: Path) -> None:
    overhead, payload = _run_quick("hook_overhead", tmp_path, torch_home)
    rows = _single_group_rows(payload)
    assert list(rows) == [overhead.FLOOR, overhead.ONE, overhead.ALL, overhead.CAPTURE]
    assert rows[overhead.FLOOR]["us_per_tap"] is None and all(
        math.isfinite(rows[name]["us_per_tap"]) for name in (overhead.ONE, overhead.ALL, overhead.CAPTURE)
    )
    claims = {t["claim"] for t in payload["targets"]}
    assert claims == {f"{overhead.ALL}: µs per tap", f"{overhead.CAPTURE}: µs per tap"}


def test_attention_quick(tmp_path: Path, torch_home: Path) -> None:
    attention, payload = _run_quick("attention", tmp_path, torch_home)
    assert [g["case"] for g in payload["groups"]] == list(attention.CASES)
    for group in payload["groups"]:
        rows = {row["name"]: row for row in group["rows"]}
        assert list(rows) == [attention.FLOOR, attention.CAPTURED] and rows[attention.CAPTURED]["maps"] >= 2


def test_live_exit_quick(tmp_path: Path, torch_home: Path) -> None:
    live, payload = _run_quick("live_exit", tmp_path, torch_home)
    rows = _single_group_rows(payload)
    assert list(rows) == [live.CUT, live.OURS, live.CAPTURE]
    assert all(row["max_abs_diff"] == 0.0 for row in rows.values())  # CUT's features, bitwise
    assert [t["claim"] for t in payload["targets"]] == [f"{live.CUT} / {live.OURS} (speed)"]


def test_max_pool_quick(tmp_path: Path, torch_home: Path) -> None:
    max_pool, payload = _run_quick("max_pool", tmp_path, torch_home)
    assert [g["case"] for g in payload["groups"]] == [*max_pool.POOLS, "ResNet-18 up to layer4"]
    for group in payload["groups"]:
        rows = {row["name"]: row for row in group["rows"]}
        assert list(rows) == [max_pool.FLOOR, max_pool.OURS]
        assert rows[max_pool.OURS]["max_abs_diff"] == 0.0  # the NCHW kernel's features, bitwise


def test_probes_quick(tmp_path: Path, torch_home: Path) -> None:
    probes, payload = _run_quick("probes", tmp_path, torch_home)
    rows = _single_group_rows(payload)
    assert list(rows) == [
        probes.BASE,
        probes.WATCH,
        probes.FUSED,
        probes.NONFINITE,
        probes.HAND_FINITE,
        probes.HAND,
        probes.ANOMALY,
    ]
    for row in rows.values():  # identical copies and batches: no probe changes the training step
        assert row["max_abs_diff"] == 0.0 and row["steps"] >= 3, row
    timed = (probes.WATCH, probes.FUSED, probes.NONFINITE, probes.HAND_FINITE)
    assert all(rows[name]["hooks_ms"] > 0 for name in timed)
    assert all("hooks_ms" not in rows[name] for name in set(rows) - set(timed))
    assert payload["config"]["watched_layers"] == 16 and payload["config"]["watch_rows"] == 32
    assert payload["config"]["fused_max_rel_diff"] < 1e-6  # the fused kernel's statistics are watch's
    claims = {t["claim"] for t in payload["targets"]}
    assert claims == {f"{name} / {probes.BASE}" for name in (probes.WATCH, probes.FUSED, probes.NONFINITE)}
    assert all(t["limit"] == 1.05 for t in payload["targets"])


def test_metrics_quick(tmp_path: Path, torch_home: Path, vgg16_cached: Path) -> None:
    metrics, payload = _run_quick("metrics", tmp_path, torch_home, "--metrics", "lpips,dists", "--nets", "squeeze")
    groups = payload["groups"]
    assert [(g["case"], g["params"]["metric"], g["params"]["net"]) for g in groups] == [
        (case, metric, net) for metric, net in (("lpips", "squeeze"), ("dists", "vgg")) for case in metrics.MODES
    ]
    bf16 = metrics.bf16_runs(torch.device("cpu"))  # opt-in rows where the CPU has native bfloat16
    for group in groups:
        rows = {row["name"]: row for row in group["rows"]}
        if group["params"]["metric"] == "dists":
            expected = [metrics.FH_DISTS, *[metrics.FH_DISTS_BF16] * bf16, metrics.REF_DISTS]
        elif group["case"] == metrics.METRIC:
            expected = [metrics.FH, metrics.FH_ONE, metrics.FH_TWO, *[metrics.FH_BF16] * bf16, metrics.REF]
        else:
            expected = [metrics.FH, metrics.FH_ONE, *[metrics.FH_BF16] * bf16, metrics.REF]
        assert list(rows) == expected and group["baseline"] == expected[-1]
        for name, row in rows.items():  # every contender computes the reference's distances or input gradients
            # bf16 (opt-in) computes another number: 2x32 random images only check that one is there
            assert math.isfinite(row["max_abs_diff"]) if "bf16" in name else row["max_abs_diff"] <= 1e-4, row
            assert row["peak_mib"] >= 0 and row["images_per_s"] > 0
        if group["params"]["metric"] == "lpips":
            assert rows[metrics.FH]["forward"] in ("one", "two")
    claims = {t["claim"].split(" (")[0] for t in payload["targets"]}
    assert {
        "metric: LPIPS peak / lpips.LPIPS peak",
        "loss: LPIPS peak / lpips.LPIPS peak",
        "metric: DISTS peak / DISTS_pytorch.DISTS peak",
        "loss: DISTS peak / DISTS_pytorch.DISTS peak",
    } <= claims


def test_metrics_quick_fid(tmp_path: Path, torch_home: Path) -> None:
    # one group, under load: the quiet group runs the same code without the background processes (which would slow
    # every other test of the suite meanwhile)
    metrics, payload = _run_quick("metrics", tmp_path, torch_home, "--metrics", "fid", "--load", "python")
    groups = payload["groups"]
    assert [g["params"]["load"] for g in groups] == ["python"] and payload["config"]["fid_loads"] == ["python"]
    for group in groups:
        rows = {row["name"]: row for row in group["rows"]}
        assert list(rows) == [metrics.FH_FID, metrics.REF_FID]
        for row in rows.values():  # both print the same FID (--dims 64), from a process of bounded size
            assert row["max_abs_diff"] <= 1e-6 and row["distance"] > 0, row
            assert 100 < row["peak_rss_mib"] < 8000 and row["images_per_s"] > 0, row
            # each row says which load it ran under, how many processes made it, and the load average then
            assert row["load"] == group["params"]["load"] and len(row["load_average"]) == 3, row
            assert row["load_processes"] == (2 if row["load"] == "python" else 0), row
            if row["load"] == "python":  # the busy processes really ran during the group
                assert row["load_cores_busy"] is None or row["load_cores_busy"] > 0.1, row
    claims = {t["claim"].split(" (")[0] for t in payload["targets"]}
    assert claims == {
        "fid: pytorch_fid time / featurehooks time",
        "fid: featurehooks peak RSS / pytorch_fid peak RSS",
    }
    assert {t["group"].split("load=")[1] for t in payload["targets"]} == {"python"}
