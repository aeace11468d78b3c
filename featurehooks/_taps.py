"""What a user asked to hook: taps (output names in request order, each the k-th call of one module) for
extractors and ``capture``, and a selection of module calls for probes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

__all__ = ["Selection", "Site", "Tap", "Taps", "call_name"]

Site = tuple[str, int]  # (module path, call index): one output of one module call in a forward


def call_name(path: str, call: int) -> str:
    """The name of the ``call``-th run of ``path`` (from 0), as torchvision FX names repeated calls."""
    return path if call == 0 else f"{path}_{call}"


@dataclass(frozen=True)
class Tap:
    """Output ``name`` is the output of call number ``call`` (0 = first) of the module at ``path``."""

    name: str
    path: str
    call: int

    @property
    def site(self) -> Site:
        return (self.path, self.call)


@dataclass(frozen=True)
class Taps:
    """The requested taps in request order; built once, when the request is validated."""

    items: tuple[Tap, ...]

    def __iter__(self) -> Iterator[Tap]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def names(self) -> list[str]:
        """Output names in request order."""
        return [tap.name for tap in self.items]

    @property
    def sites(self) -> list[Site]:
        """Distinct (path, call) sites in request order."""
        return list(dict.fromkeys(tap.site for tap in self.items))

    @property
    def paths(self) -> list[str]:
        """Distinct module paths in request order."""
        return list(dict.fromkeys(tap.path for tap in self.items))

    def names_by_site(self) -> dict[Site, tuple[str, ...]]:
        """Site -> the output names stored from it (two names may tap one site)."""
        grouped: dict[Site, list[str]] = {}
        for tap in self.items:
            grouped.setdefault(tap.site, []).append(tap.name)
        return {site: tuple(names) for site, names in grouped.items()}


@dataclass(frozen=True)
class Selection:
    """The module calls a probe observes: module path -> the call indices reported (None: every call), in the
    model's module order. Built once, by ``layers.select_modules`` (names, aliases, ``path_k``, globs)."""

    calls: Mapping[str, frozenset[int] | None]

    @classmethod
    def every(cls, paths: Iterable[str]) -> Selection:
        """Every call of each of ``paths``."""
        return cls(dict.fromkeys(paths))

    @property
    def paths(self) -> list[str]:
        """The selected module paths, in module order."""
        return list(self.calls)

    def __len__(self) -> int:
        return len(self.calls)

    def wants(self, path: str, call: int) -> bool:
        """Whether call number ``call`` of the selected module ``path`` is reported."""
        calls = self.calls[path]
        return calls is None or call in calls
