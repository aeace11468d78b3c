"""README sections whose Python blocks must run as written on a fresh clone: each block is executed in a fresh
namespace (offline: the blocks use ``weights=None``)."""

from __future__ import annotations

import re

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow  # VGG backbones built as the README builds them

README = REPO / "README.md"
SECTIONS = ("Porting a perceptual loss",)


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section titled ``section`` (up to the next ``## `` heading)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```", body, flags=re.S | re.M)


@pytest.mark.parametrize(
    "section, index", [(section, i) for section in SECTIONS for i in range(len(python_blocks(section)))]
)
def test_readme_block_runs_as_written(section: str, index: int) -> None:
    code = python_blocks(section)[index]
    exec(compile(code, f"README.md ({section}, block {index + 1})", "exec"), {"__name__": "readme"})
