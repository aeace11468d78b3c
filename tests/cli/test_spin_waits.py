"""featurehooks' commands start torch with short OpenMP spin waits (``_openmp``): only for the command, only
where the user set no wait, and with every number bitwise that of torch's default waits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from featurehooks._openmp import SPIN_COUNT, is_featurehooks_command, shorten_spin_waits


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "-m", "featurehooks", "fid", "a", "b"], True),
        (["python", "-u", "-X", "dev", "-m", "featurehooks"], True),
        (["python", "-mfeaturehooks"], True),
        (["/venv/bin/python", "/venv/bin/featurehooks", "extract"], True),
        (["python", "C:/venv/Scripts/featurehooks-script.py"], True),
        (["python", "-m", "pytest", "-m", "featurehooks"], False),
        (["python", "-c", "import featurehooks", "featurehooks"], False),
        (["python", "train.py", "featurehooks"], False),
        (["python", "-W", "featurehooks", "-"], False),
        (["python"], False),
    ],
)
def test_the_command_is_told_from_python_running_anything_else(argv: list[str], expected: bool) -> None:
    assert is_featurehooks_command(argv) is expected


@pytest.mark.parametrize(
    ("environ", "torch_loaded", "expected"),
    [
        ({}, False, SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "7"}, False, "7"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False, None),
        ({}, True, None),  # too late: GNU OpenMP has read its settings
    ],
)
def test_the_spin_count_is_set_only_before_torch_and_never_over_the_users(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], torch_loaded: bool, expected: str | None
) -> None:
    monkeypatch.setattr(os, "environ", dict(environ))
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "featurehooks", "fid"])
    if not torch_loaded:
        monkeypatch.delitem(sys.modules, "torch")
    shorten_spin_waits()
    assert os.environ.get("GOMP_SPINCOUNT") == expected


SPIN_AT_EXIT = "import atexit, os\natexit.register(lambda: print('spin', os.environ.get('GOMP_SPINCOUNT')))\n"
FEATURES = """
import sys, torch, torchvision
import featurehooks as fh
torch.manual_seed(0)
torch.set_num_threads(2)
model = torchvision.models.resnet18()
images = torch.rand(5, 3, 64, 64)
features = fh.FeatureExtractor(model, ["layer2", "layer4"], mode="detach")(images)
sys.stdout.buffer.write(b"".join(f.numpy().tobytes() for f in features.values()))
"""


@pytest.mark.slow
def test_the_installed_command_runs_with_short_spins(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(SPIN_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    for variable in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        env.pop(variable, None)
    run = [sys.executable, "-m", "featurehooks", "--help"]
    assert subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout.endswith(
        f"spin {SPIN_COUNT}\n"
    )
    other = [sys.executable, "-c", "import featurehooks"]
    assert subprocess.run(other, env=env, capture_output=True, text=True, check=True).stdout == "spin None\n"


@pytest.mark.slow
def test_short_spins_give_the_same_bits() -> None:
    env = {name: value for name, value in os.environ.items() if name not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    default = subprocess.run([sys.executable, "-c", FEATURES], env=env, capture_output=True, check=True).stdout
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    short = subprocess.run([sys.executable, "-c", FEATURES], env=env, capture_output=True, check=True).stdout
    assert len(default) == 5 * (128 * 8 * 8 + 512 * 2 * 2) * 4 and short == default
