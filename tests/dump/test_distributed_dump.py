"""torchrun sharding: a 2-rank CPU (gloo) dump writes the same bytes as a single process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featurehooks._stream.sharding import Distributed, chunk_rows, split_contiguous
from featurehooks.cli import main

from dump_helpers import mark_unfinished, scribble
from helpers import free_port, torchrun, two_ranks


@pytest.mark.parametrize(("items", "parts"), [(7, 2), (8, 2), (3, 4), (0, 2), (10, 3)])
def test_split_is_contiguous_complete_and_unpadded(items: int, parts: int) -> None:
    pieces = [split_contiguous(list(range(items)), parts, part) for part in range(parts)]
    assert [x for piece in pieces for x in piece] == list(range(items))  # no duplicates, no gaps, in order
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_chunks_cover_the_rows() -> None:
    assert [chunk_rows(c, 4, 10) for c in range(3)] == [(0, 4), (4, 8), (8, 10)]


def test_single_process_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    alone = Distributed.from_environment(torch.device("cpu"))
    assert (alone.rank, alone.world_size, alone.owns_group) == (0, 1, False)
    assert alone.broadcast("x") == "x" and alone.all_gather("y") == ["y"]


def make_inputs(folder: Path) -> None:
    """13 images (7 chunks of 2: uneven shards) including one corrupt file, so skipped rows cross ranks."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (40, 36 + i, 3), dtype=np.uint8)).save(folder / f"img_{i:02d}.png")
    (folder / "img_05b.png").write_bytes(b"\x89PNG broken")


ARGS = [
    "--backbone", "resnet18", "--weights", "DEFAULT", "--layers", "layer1", "layer2",
    "--batch-size", "2", "--workers", "1", "--resize", "36", "--crop", "32", "--device", "cpu", "-q",
]  # fmt: skip


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == ["index.csv", "inputs.npy", "layer1.npy", "layer2.npy", "manifest.json"]
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
def test_two_rank_torchrun_equals_one_process(tmp_path: Path, resnet18_cached: Path) -> None:
    make_inputs(tmp_path / "imgs")
    run = torchrun(["extract", str(tmp_path / "imgs"), "--out", str(tmp_path / "two"), *ARGS])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("wrote 13 rows") == 1  # only rank 0 reports
    assert main(["extract", str(tmp_path / "imgs"), "--out", str(tmp_path / "one"), *ARGS]) == 0
    same_files(tmp_path / "one", tmp_path / "two")
    rows = [line.split(",", 2) for line in (tmp_path / "two" / "index.csv").read_text().splitlines()[1:]]
    assert [(row, valid) for row, valid, path in rows if valid == "0"] == [("6", "0")]  # img_05b.png, row 6
    assert rows[6][2].endswith("img_05b.png")


@pytest.mark.slow
def test_two_ranks_resume_what_one_process_left_unfinished(tmp_path: Path, resnet18_cached: Path) -> None:
    make_inputs(tmp_path / "imgs")
    assert main(["extract", str(tmp_path / "imgs"), "--out", str(tmp_path / "one"), *ARGS]) == 0
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "one", out)
    # what a killed single-process run leaves: status running, chunks 0 and 4 committed, other rows garbage
    store = mark_unfinished(out, [(chunk, *chunk_rows(chunk, 2, 13)) for chunk in (0, 4)])
    scribble(store, 2, 8, 9.0)
    scribble(store, 10, 13, -1.0)
    store.close_arrays()
    run = two_ranks(["extract", str(tmp_path / "imgs"), "--out", str(out), *ARGS, "--resume"])
    assert run.returncode == 0, run.stderr[-3000:]
    same_files(tmp_path / "one", out)


FAILING_RANK = """
import os, sys, torch, featurehooks as fh
from torch import nn

class Picky(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        if torch.isnan(x).any():
            raise RuntimeError("bad batch on this rank")
        return self.conv(x)

torch.manual_seed(0)
data = torch.rand(8, 3, 16, 16)
data[6] = float("nan")  # a row of rank 1
try:
    fh.dump_features(fh.FeatureExtractor(Picky(), ["conv"]), data, sys.argv[1], batch_size=2, progress=False,
                     num_workers=0)
except RuntimeError as exc:
    print(f"rank {os.environ['RANK']}: {exc}", flush=True)
"""


@pytest.mark.slow
def test_a_failing_rank_is_reported_by_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        str(script), str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun timed out: {stderr[-3000:]}")
    assert "rank 1: bad batch on this rank" in stdout, stderr[-3000:]
    assert "rank 0: another rank failed" in stdout and "resume" in stdout, stderr[-3000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "running"
