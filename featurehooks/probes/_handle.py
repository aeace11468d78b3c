"""What every probe's handle shares: the session of its hooks, and whether they are still registered."""

from __future__ import annotations

from typing import Any

from .._hooks import ClosedOnExit, ObserverSession

__all__ = ["ProbeHandle"]


class ProbeHandle(ClosedOnExit):
    """A probe's hooks, held by ``_session`` (set by the subclass): a context manager and a handle."""

    _session: ObserverSession[Any]

    @property
    def active(self) -> bool:
        """Whether the hooks are still registered."""
        return self._session.active
