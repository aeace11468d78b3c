"""``--bootstrap``, ``--infinity`` and ``--infinity-smallest``: how far a Fréchet distance is from its value at
infinitely many images, declared once for ``fd``, ``fid`` and ``eval``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, NamedTuple

from ._common import UserError, at_least

if TYPE_CHECKING:
    from ..metrics import FeatureStatistics
    from ..metrics.frechet import Moments

__all__ = ["SampleSize", "add_sample_size_options", "sample_size", "sample_size_asked"]


def add_sample_size_options(parser: argparse.ArgumentParser, resampled: str = "B") -> None:
    """The three flags; ``resampled`` names the set whose images are resampled (every vector of it is kept)."""
    parser.add_argument(
        "--bootstrap",
        type=at_least(2),
        default=None,
        metavar="ROUNDS",
        help=f"also the 95%% interval of each FD over ROUNDS resamples of {resampled}'s images (keeps every vector "
        f"of {resampled})",
    )
    parser.add_argument(
        "--infinity",
        action="store_true",
        help=f"also FD∞, each FD extrapolated to infinitely many images of {resampled} (Chong & Forsyth 2020; keeps "
        f"every vector of {resampled})",
    )
    parser.add_argument(
        "--infinity-smallest",
        type=at_least(2),
        default=5000,
        metavar="N",
        help=f"the smallest subset of {resampled} that FD∞ fits on, below its count (default: 5000, the paper's for "
        "50,000)",
    )


def sample_size_asked(args: argparse.Namespace) -> bool:
    """Whether ``--bootstrap`` or ``--infinity`` was given (then every vector of the resampled set is kept)."""
    return bool(args.bootstrap or args.infinity)


class SampleSize(NamedTuple):
    """What ``--bootstrap`` and ``--infinity`` found: the 95% interval and FD∞, each ``None`` when not asked for."""

    bootstrap: tuple[float, float] | None
    infinity: float | None

    def text(self, rounds: int | None) -> str:
        """`` [low, high] (95% bootstrap, N rounds)`` and ``, FD∞ value`` as found, or nothing."""
        text = ""
        if self.bootstrap is not None:
            text += f" [{self.bootstrap[0]:.6g}, {self.bootstrap[1]:.6g}] (95% bootstrap, {rounds} rounds)"
        if self.infinity is not None:
            text += f", FD∞ {self.infinity:.6g}"
        return text


def sample_size(args: argparse.Namespace, a: Moments, b: FeatureStatistics, resampled: str = "B") -> SampleSize:
    """The interval and FD∞ of the distance from ``a`` to ``b`` as the flags ask (``b``'s vectors resampled)."""
    from ..metrics import fd_bootstrap, fd_infinity

    bootstrap = fd_bootstrap(a, b, rounds=args.bootstrap) if args.bootstrap else None
    infinity = None
    if args.infinity:
        if b.count <= args.infinity_smallest:
            raise UserError(
                f"FD∞ fits on subsets of {resampled} from --infinity-smallest {args.infinity_smallest} images up to "
                f"its {b.count}: pass --infinity-smallest {max(2, b.count // 10)} (a tenth of {resampled}) for a set "
                "this small"
            )
        infinity = fd_infinity(a, b, smallest=args.infinity_smallest).value
    return SampleSize(bootstrap, infinity)
