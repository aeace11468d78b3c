"""A progress bar on stderr for long runs over inputs (dumps, statistics, pair scores)."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """A tqdm bar on stderr that is best-effort: a closed or failing stderr turns it off, never the run.

    A context manager: the bar is closed when the block ends, also on error.
    """

    def __init__(self, total: int, enabled: bool, *, label: str = "extract", unit: str = "img", rank: int = 0) -> None:
        """A bar named ``label`` counting to ``total`` (in ``unit``), drawn when ``enabled``, on line ``rank``."""
        from tqdm.auto import tqdm

        self._bar: Any = None
        if enabled and sys.stderr is not None:
            try:
                self._bar = tqdm(total=total, unit=unit, desc=label, position=rank, file=sys.stderr, dynamic_ncols=True)
            except Exception:  # noqa: BLE001 - ValueError (closed file), OSError (EPIPE, EBADF), ...
                self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def update(self, count: int) -> None:
        self._call("update", count)

    def close(self) -> None:
        self._call("close")

    def _call(self, method: str, *args: int) -> None:
        if self._bar is None:
            return
        try:
            getattr(self._bar, method)(*args)
        except Exception:  # noqa: BLE001 - progress never stops a run
            bar, self._bar = self._bar, None
            bar.disable = True  # its finalizer must not write either
