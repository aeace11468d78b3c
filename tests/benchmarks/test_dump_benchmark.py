"""``benchmarks/dump_throughput.py`` in quick mode: its files, its structure and its output checks, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import load_script

pytest.importorskip("skimage")


@pytest.mark.slow
def test_dump_throughput_quick(tmp_path: Path, torch_home: Path, resnet18_cached: Path) -> None:
    bench = load_script("benchmarks/dump_throughput.py")
    argv = ["--quick", "--threads", "1", "--workers", "1", "--out", str(tmp_path), "--torch-home", str(torch_home)]
    argv += ["--load", "none,python"]  # quiet, then under two busy pure-Python processes
    payload = bench.main(argv)

    saved = json.loads((tmp_path / "dump_throughput.json").read_text())
    assert saved == json.loads(json.dumps(payload))
    assert saved["benchmark"] == "dump_throughput" and saved["quick"] is True and saved["partial"] is False
    assert saved["command"] == "python benchmarks/dump_throughput.py " + " ".join(argv)
    assert {"cpu", "cpu_count", "torch_threads", "versions", "date_utc"} <= set(saved["machine"])
    assert not (tmp_path / "dump_throughput.png").exists()
    config = saved["config"]
    assert config["images"] == 18 and config["batch_size"] == 8 and config["workers"] == 1
    assert config["input_max_abs_diff"] == 0.0  # both routes feed the model the same pixels
    assert config["loads"] == ["none", "python"] and config["rounds"] == {"none": 1, "python": 1}

    quiet, busy = saved["groups"]  # one group per load, each row saying which load it ran under
    for group, load in ((quiet, "none"), (busy, "python")):
        assert group["baseline"] == bench.HAND and group["rounds"] == 1
        assert group["params"] == {"images": 18, "batch": 8, "workers": 1, "threads": 1, "load": load}
        for row in group["rows"]:
            assert row["load"] == load and row["load_processes"] == (2 if load == "python" else 0)
            assert len(row["load_average"]) == 3 and row["speedup"] > 0
    rows = {row["name"]: row for row in quiet["rows"]}
    # the default dump also in bf16 where this CPU has native bfloat16 (fp16: AVX512-FP16 CPUs), beside float32
    reduced = bench.reduced_precisions(torch.device("cpu"))
    in_precision = [bench.R.with_precision(bench.DEFAULT, precision) for precision in reduced]
    assert list(rows) == [bench.HAND, bench.CONTIGUOUS, bench.DEFAULT, *in_precision]
    assert config["reduced_precisions"] == reduced
    for row in rows.values():
        assert row["median_ms"] > 0 and row["images_per_s"] > 0 and math.isfinite(row["speedup"])
        assert row["best_images_per_s"] >= row["images_per_s"]
        assert row["images_per_s"] == pytest.approx(18 / (row["median_ms"] / 1e3))
        limit = bench.MAX_RELATIVE_DIFF_REDUCED if row["name"] in in_precision else bench.MAX_RELATIVE_DIFF
        assert row["rel_diff"] <= limit
    assert rows[bench.HAND]["speedup"] == pytest.approx(1.0) and rows[bench.HAND]["ratio"] == pytest.approx(1.0)
    assert rows[bench.CONTIGUOUS]["memory_format"] == "contiguous"
    for name in (bench.CONTIGUOUS, bench.DEFAULT, *in_precision):  # compared with the hand loop, row by row
        assert rows[name]["feature_scale"] > 0 and math.isfinite(rows[name]["max_abs_diff"])
        assert isinstance(rows[name]["rows_in_folder_order"], bool)

    targets = {t["claim"]: t for t in saved["targets"] if "load=python" not in t["group"]}
    speed = targets[f"{bench.DEFAULT} / {bench.HAND} images/s"]
    assert speed["limit"] == 1.25 and speed["kind"] == ">=" and "load=none" in speed["group"]
    assert speed["measured"] == pytest.approx(rows[bench.DEFAULT]["speedup"])
    at_least = [
        t for t in saved["targets"] if t["claim"] == f"{bench.DEFAULT} / {bench.HAND} images/s (at least as fast)"
    ]
    assert [t["group"].split("load=")[1] for t in at_least] == ["none", "python"]  # quiet and under the load
    assert all(t["limit"] == 1.0 for t in at_least)
    checks = [t for claim, t in targets.items() if "diff" in claim]
    assert len(checks) == 3 + len(reduced) and all(t["met"] for t in checks)
    bf16 = targets.get(f"{bench.R.with_precision(bench.DEFAULT, 'bf16')} / {bench.DEFAULT} images/s")
    assert (bf16 is not None) == ("bf16" in reduced)
    if bf16 is not None:  # images/s in bf16 over float32's, both dumps of the default extractor
        expected = rows[in_precision[0]]["images_per_s"] / rows[bench.DEFAULT]["images_per_s"]
        assert bf16["limit"] == 1.5 and bf16["measured"] == pytest.approx(expected)

    markdown = (tmp_path / "dump_throughput.md").read_text()
    assert "Command: `python benchmarks/dump_throughput.py --quick" in markdown and "Machine: " in markdown
    assert "| contender | median ms | IQR ms | ratio | images/s (median) |" in markdown
    assert all(f"| {name} |" in markdown for name in rows)


def test_photos_are_seeded_jpegs_in_class_folders(tmp_path: Path) -> None:
    bench = load_script("benchmarks/dump_throughput.py")
    first = bench.make_photos(tmp_path / "a", 7)
    second = bench.make_photos(tmp_path / "b", 7)
    assert [p.relative_to(tmp_path / "a") for p in first] == [p.relative_to(tmp_path / "b") for p in second]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(first, second))
    assert len({p.parent.name for p in first}) == 6 and all(p.suffix == ".jpg" for p in first)
    from PIL import Image

    for path in first:
        with Image.open(path) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size in bench.SIZES


def test_rounds_rotate_and_stop_at_the_budget(tmp_path: Path) -> None:
    bench = load_script("benchmarks/dump_throughput.py")
    calls: list[tuple[str, Path]] = []
    contenders = {name: (lambda folder, name=name: calls.append((name, folder))) for name in "abc"}
    timing = bench.time_rounds(contenders, tmp_path / "all", tmp_path / "warm", rounds=3, budget=60.0)
    assert timing.rounds == 3 and all(len(s) == 3 for s in timing.samples.values())
    assert calls[:3] == [(name, tmp_path / "warm") for name in "abc"]  # one warm-up call each, untimed
    assert [name for name, _ in calls[3:]] == list("abcbcacab")
    calls.clear()
    timing = bench.time_rounds(contenders, tmp_path / "all", tmp_path / "warm", rounds=3, budget=0.0)
    assert timing.rounds == 1 and len(calls) == 6  # one round always runs


@pytest.mark.slow
def test_dump_command_quick(tmp_path: Path, torch_home: Path, resnet18_cached: Path) -> None:
    bench = load_script("benchmarks/dump_command.py")
    argv = ["--quick", "--threads", "1", "--workers", "1", "--out", str(tmp_path), "--torch-home", str(torch_home)]
    payload = bench.main(argv)

    saved = json.loads((tmp_path / "dump_command.json").read_text())
    assert saved == json.loads(json.dumps(payload)) and saved["quick"] is True
    assert saved["command"] == "python benchmarks/dump_command.py " + " ".join(argv)
    config = saved["config"]
    assert config["images"] == 18 and config["batch_size"] == 8 and config["loads"] == ["none"]
    commands = config["commands"]  # each a fresh process: the hand loop script and the featurehooks command
    assert "_hand_loop.py --batch-size 8 --workers 1 PHOTOS " in commands[bench.HAND]
    assert "-m featurehooks extract" in commands[bench.SAME_WORKERS] and "--workers 1" in commands[bench.SAME_WORKERS]
    assert "--workers" not in commands[bench.OWN_DEFAULTS]
    (group,) = saved["groups"]
    assert group["baseline"] == bench.HAND and group["params"]["load"] == "none" and group["params"]["threads"] == 1
    rows = {row["name"]: row for row in group["rows"]}
    assert list(rows) == [bench.HAND, bench.OWN_DEFAULTS, bench.SAME_WORKERS]
    for row in rows.values():
        assert row["images_per_s"] == pytest.approx(18 / (row["median_ms"] / 1e3)) and row["speedup"] > 0
        assert row["max_abs_diff"] == 0.0  # the same features, bitwise, as the hand loop's, row for row
    speed = [t for t in saved["targets"] if "images/s" in t["claim"]]  # the command as a user runs it, per load
    assert [t["claim"] for t in speed] == [f"{bench.OWN_DEFAULTS} / {bench.HAND} images/s (at least as fast)"]
    assert speed[0]["measured"] == pytest.approx(rows[bench.OWN_DEFAULTS]["speedup"]) and speed[0]["limit"] == 1.0
    assert "| hand-written loop script |" in (tmp_path / "dump_command.md").read_text()


def test_dump_command_runs_each_command_with_its_own_thread_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_script("benchmarks/dump_command.py")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.setenv(name, "7")
    env = bench.environment(None)
    assert not {"OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(env)
    assert bench.environment(3)["OMP_NUM_THREADS"] == "3" and "GOMP_SPINCOUNT" not in bench.environment(3)
