"""Every code block of README.md and docs/*.md (not docs/api/) runs as written on a fresh clone.

Each ```python block runs in a fresh Python process and each ```bash block under ``bash -euo pipefail``, with the
virtual environment's ``bin`` first on PATH (``featurehooks`` is the console script, ``python`` the environment's),
in a fresh copy of the checkout's files (tracked and not ignored) so that no block writes into the repository;
offline, with the session's seeded weights in ``TORCH_HOME`` for the torchvision models the blocks read (a block
that reads any other pretrained weights fails: that is the point). ```text blocks are output and never run; a block
that is illustrative only has ``<!-- not run: <reason> -->`` on the line before its fence, and there are at most
``MAX_NOT_RUN`` of them. A block that needs an optional extra which is no dev dependency (``OPTIONAL``: Ray) has
``<!-- needs: <module> -->`` on the line before its fence, and is skipped where that module is not installed.

Python blocks are forked from a warm interpreter (``ZYGOTE``: started once per test process with ``sys.executable``
and the same environment, it has imported torch, torchvision and featurehooks and nothing else, and forks a child per
block that changes into the block's folder and runs the block as ``__main__`` in fresh globals): importing torchvision
costs about 5 s of CPU per process, which for some twenty blocks would be most of this test's cost. A block still
sees only what it imports itself. ``FH_DOC_BLOCKS_COLD=1`` runs each one as ``python block.py`` instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow  # one process per block, pretrained backbones on seeded weights

PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUN = ("python", "bash")  # the one fence for Python and the one for shell commands
NOT_RUN_FENCES = ("text",)  # what a command prints
MAX_NOT_RUN = 3
# modules of optional extras that the dev install leaves out: a block marked as needing one is skipped without it
OPTIONAL = ("ray",)
# torchvision weights the blocks read (DEFAULT members), written seeded into the session's TORCH_HOME;
# alexnet, squeezenet1_1: LPIPS trunks (vgg16 too)
SEEDED = ("vgg16", "resnet18", "alexnet", "squeezenet1_1")
TIMEOUT_S = 240

FENCE = re.compile(r"^```(\S*)\s*$")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
NOT_RUN = re.compile(r"^<!-- not run:(.*?)-->\s*$")
NEEDS = re.compile(r"^<!-- needs:(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # README.md, docs/losses.md
    line: int  # of the opening fence, 1-based
    heading: str  # the nearest heading above it
    language: str
    code: str
    not_run: str | None  # the reason, for a block marked illustrative
    needs: str | None = None  # the optional module a block marked so imports

    @property
    def id(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.heading).strip("-").lower()[:40] or "top"
        return f"{self.page}:{self.line}:{slug}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown page, in order."""
    page = path.relative_to(REPO).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    heading, index = "", 0
    while index < len(lines):
        line = lines[index]
        fence = FENCE.match(line)
        if fence is None:
            if match := HEADING.match(line):
                heading = match.group(1)
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise AssertionError(f"{page}:{index + 1}: a fence that never closes")
        above = lines[index - 1] if index > 0 else ""
        marker, needs = NOT_RUN.match(above), NEEDS.match(above)
        code = "\n".join(lines[index + 1 : end]) + "\n"
        not_run = marker.group(1).strip() if marker else None
        needed = needs.group(1).strip() if needs else None
        found.append(Block(page, index + 1, heading, fence.group(1), code, not_run, needed))
        index = end + 1
    return found


ALL = [block for page in PAGES for block in blocks(page)]
RUNNABLE = [block for block in ALL if block.language in RUN and block.not_run is None]


def test_every_block_has_a_known_fence() -> None:
    """One fence convention everywhere: python, bash (commands, no prompts) and text (output)."""
    odd = [f"{block.id} ```{block.language}" for block in ALL if block.language not in (*RUN, *NOT_RUN_FENCES)]
    assert not odd, odd
    prompts = [block.id for block in ALL if block.language == "bash" and re.search(r"^\$ ", block.code, re.M)]
    assert not prompts, f"bash blocks are commands, without '$ ' prompts: {prompts}"


def test_illustrative_blocks_are_few_and_say_why() -> None:
    marked = [block for block in ALL if block.not_run is not None]
    assert all(block.not_run for block in marked), [block.id for block in marked if not block.not_run]
    assert all(block.language in RUN for block in marked), [block.id for block in marked]
    assert len(marked) <= MAX_NOT_RUN, [f"{block.id}: {block.not_run}" for block in marked]


def test_optional_blocks_need_an_optional_extra() -> None:
    """Only the modules of optional extras excuse a block: a dev dependency that is missing fails it."""
    marked = [block for block in ALL if block.needs is not None]
    odd = [f"{b.id}: {b.needs!r}" for b in marked if b.needs not in OPTIONAL or b.language != "python"]
    assert not odd, f"<!-- needs: --> names one of {OPTIONAL}, before a python block: {odd}"
    unused = [block.id for block in marked if not re.search(rf"^(import|from) {block.needs}\b", block.code, re.M)]
    assert not unused, f"blocks marked as needing a module they never import: {unused}"


def test_readme_python_blocks_import_featurehooks() -> None:
    missing = [
        b.id for b in ALL if b.page == "README.md" and b.language == "python" and "import featurehooks" not in b.code
    ]
    assert not missing, missing


def checkout_files() -> list[str]:
    """The files a fresh clone has: tracked ones and new ones that git does not ignore."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: what the blocks read
        return [p.relative_to(REPO).as_posix() for p in (REPO / "examples").rglob("*") if p.is_file()]
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def doc_weights(seeded_weights: Callable[..., Path]) -> None:
    for name in SEEDED:
        seeded_weights(name)


ZYGOTE = """
import json, os, runpy, signal, sys, traceback
import numpy, PIL.Image, torch, torchvision  # what most blocks import, paid once
import featurehooks, featurehooks.metrics

print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(request["timeout"])
            os.chdir(request["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            sys.argv = [request["script"]]
            sys.path[0] = os.path.dirname(request["script"])
            try:
                runpy.run_path(request["script"], run_name="__main__")
                code = 0
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


def block_env() -> dict[str, str]:
    """This session's environment (its TORCH_HOME of seeded weights), offline, the venv's bin first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def zygote(doc_weights: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str] | None]:
    if os.environ.get("FH_DOC_BLOCKS_COLD") == "1" or not hasattr(os, "fork"):
        yield None
        return
    cwd = tmp_path_factory.mktemp("zygote")
    process = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE],
        cwd=cwd,
        env=block_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    yield process
    assert process.stdin is not None
    process.stdin.close()
    process.wait(timeout=30)


def run_forked(zygote: subprocess.Popen[str], script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert zygote.stdin is not None and zygote.stdout is not None
    out, err = script.with_suffix(".stdout"), script.with_suffix(".stderr")
    request = {"script": str(script), "cwd": str(cwd), "stdout": str(out), "stderr": str(err), "timeout": TIMEOUT_S}
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    code = json.loads(zygote.stdout.readline())
    return subprocess.CompletedProcess([str(script)], code, read_text(out), read_text(err))


def read_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    root = tmp_path / "clone"
    for name in checkout_files():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    return root


def as_param(block: Block) -> object:
    """``block`` as a test case, skipped before any fixture where the optional module it needs is missing."""
    missing = block.needs is not None and importlib.util.find_spec(block.needs) is None
    reason = f"needs {block.needs}, an optional extra that is not installed"
    return pytest.param(block, id=block.id, marks=pytest.mark.skipif(missing, reason=reason))


@pytest.mark.parametrize("block", [as_param(block) for block in RUNNABLE])
def test_block_runs(
    block: Block, clone: Path, tmp_path: Path, doc_weights: None, zygote: subprocess.Popen[str] | None
) -> None:
    script = tmp_path / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(block.code, encoding="utf-8")
    if block.language == "python" and zygote is not None:
        done = run_forked(zygote, script, clone)
    else:
        command = (
            [sys.executable, str(script)] if block.language == "python" else ["bash", "-euo", "pipefail", str(script)]
        )
        done = subprocess.run(
            command,
            cwd=clone,
            env=block_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    assert done.returncode == 0, (
        f"{block.page} line {block.line} ({block.heading}) exited {done.returncode}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-5000:]}"
    )
