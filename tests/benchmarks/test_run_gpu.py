"""benchmarks/run_gpu.sh rehearsed as the GPU machine will run it: a clean copy of the checkout, an interpreter on which
featurehooks, lpips and piq are not installed (``bare_python/sitecustomize.py`` hides them), the peers only as wheels
in ``.whl/``, and an ``$OUT`` from which at most 8 files come back. The plumbing must not break silently again."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow  # runs the four benchmark scripts in subprocesses

BARE_PYTHON = Path(__file__).parent / "bare_python"
HIDDEN = "featurehooks,lpips,piq"
BENCHMARKS = ("extraction", "losses", "compile", "hook_overhead")


def clean_copy(folder: Path) -> Path:
    """The files git tracks, as the working tree has them: what a fresh clone holds (no .venv, no egg-info)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree but not yet in git is not there
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder


def wheel_of_installed(name: str, folder: Path) -> Path:
    """A wheel of the installed distribution ``name``, standing in for the one ``run_gpu.sh prepare`` downloads (the
    suite stays offline): its files as installed, its dist-info with the WHEEL file pip needs."""
    dist = importlib.metadata.distribution(name)
    wheel = folder / f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for file in dist.files or ():
            if "__pycache__" not in file.parts and not file.parts[0].startswith(".."):
                archive.write(Path(file.locate()), str(file))
    return wheel


def bare_env(**extra: str) -> dict[str, str]:
    """This interpreter's environment as the GPU machine's: the hidden packages importable only from PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT", "RESULTS", "BENCH_TORCH_HOME")}
    return {**env, "PYTHONPATH": str(BARE_PYTHON), "FH_HIDE": HIDDEN, "PYTHON": sys.executable, **extra}


def test_the_bare_interpreter_has_no_featurehooks() -> None:
    # what the rehearsal stands on: without the checkout on its path, the scripts' first import fails (issue 45)
    found = subprocess.run(
        [sys.executable, "-c", "import featurehooks"], env=bare_env(), capture_output=True, text=True, cwd=REPO
    )
    assert found.returncode != 0 and "No module named 'featurehooks'" in found.stderr


def test_rehearsal_writes_every_benchmark_and_packs_two_files(
    tmp_path: Path, torch_home: Path, vgg16_cached: Path
) -> None:
    checkout = clean_copy(tmp_path / "clone")
    (checkout / ".whl").mkdir()
    for peer in ("lpips", "piq"):
        wheel_of_installed(peer, checkout / ".whl")
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "rehearse"],
        cwd=checkout,
        # the suite's workers share the cores: limits meant for a quiet machine must not fail a test of plumbing
        env=bare_env(OUT=str(out), BENCH_TORCH_HOME=str(torch_home), LIMIT_SCALE="4"),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"from {checkout.resolve() / 'featurehooks'}" in run.stdout  # the clean copy's code, not an installed one
    assert "lpips 0.1" in run.stdout and "piq 0." in run.stdout and "MISSING" not in run.stdout
    assert "every benchmark wrote its results" in run.stdout

    assert sorted(p.name for p in out.iterdir()) == ["gpu_results.tar.gz", "run_gpu.log"]  # at most 8 come back
    with tarfile.open(out / "gpu_results.tar.gz") as archive:
        names = sorted(archive.getnames())
        assert names == sorted(f"{b}_rehearsal.{ext}" for b in BENCHMARKS for ext in ("json", "md"))
        saved = {b: json.load(archive.extractfile(f"{b}_rehearsal.json")) for b in BENCHMARKS}  # type: ignore[arg-type]
    for name, data in saved.items():
        assert data["benchmark"] == name and data["partial"] is False and data["groups"], name
        assert data["machine"]["versions"]["torch"] and data["machine"]["versions"]["torchvision"]
    losses = {row["name"] for group in saved["losses"]["groups"] for row in group["rows"]}
    assert {"piq ContentLoss", "lpips.LPIPS (lin)"} <= losses  # the peers ran, from the carried wheels
    log = (out / "run_gpu.log").read_text()
    assert all(f"==== {name}" in log for name in BENCHMARKS)

    # here, afterwards: one command puts the results beside the others and draws their charts
    results = tmp_path / "results"
    unpack = subprocess.run(
        ["bash", "benchmarks/run_gpu.sh", "unpack", str(out / "gpu_results.tar.gz")],
        cwd=checkout,
        env=bare_env(RESULTS=str(results)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unpack.returncode == 0, unpack.stderr[-3000:]
    for name in BENCHMARKS:
        assert (results / f"{name}_rehearsal.md").read_text().startswith("## ")
        assert (results / f"{name}_rehearsal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
