"""Short OpenMP spin waits for featurehooks' own commands: set before torch loads, since GNU OpenMP reads its
settings once. Idle threads then sleep after a short spin instead of spinning on cores other jobs need; the work
is split the same way, so every number is bitwise the same (docs/performance.md, "On a busy machine")."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

SPIN_COUNT = "3000"  # GNU OpenMP's GOMP_SPINCOUNT for featurehooks' commands; its own default is 300000
WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # either one set by the user is kept as set
COMMAND = "featurehooks"


def is_featurehooks_command(argv: Sequence[str]) -> bool:
    """Whether the interpreter's command line (``sys.orig_argv``) runs the ``featurehooks`` command, as the
    installed script or as ``python -m featurehooks``, options to Python before it included."""
    arguments = iter(argv[1:])
    for argument in arguments:
        if argument == "-m":
            return next(arguments, None) == COMMAND
        if argument.startswith("-m"):
            return argument[2:] == COMMAND
        if argument in ("-X", "-W"):
            next(arguments, None)
        elif argument.startswith("-c") or argument == "-":
            return False
        elif not argument.startswith("-"):
            return Path(argument).stem in (COMMAND, f"{COMMAND}-script")
    return False


def shorten_spin_waits() -> None:
    """Set ``GOMP_SPINCOUNT`` for a ``featurehooks`` command that loads torch, unless the user set the waits."""
    if "torch" in sys.modules or any(name in os.environ for name in WAIT_VARIABLES):
        return
    if is_featurehooks_command(getattr(sys, "orig_argv", [])):
        os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT


shorten_spin_waits()
