"""Pairs of images to score with a pairwise metric such as LPIPS or DISTS.

``pair_files`` matches the images of two folders by their path relative to each folder, ``pairs_within`` lists
every pair of one folder (or each image with the next); both are read as dumps read a folder
(``featurehooks._stream.list_images``). Scoring them is ``pair_scores``' job.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple, overload

from .._stream import container_of, list_images
from ..errors import InputNotFoundError, InvalidValueError, first_line
from ..images import read_image

__all__ = ["ImagePair", "PairsWithin", "pair_files", "pairs_within"]

_NAMED_SKIPS = 3  # inputs named in the warning about unreadable entries; the rest are counted


class ImagePair(NamedTuple):
    """Two image files with the same relative path ``name`` under two folders (``a`` and ``b`` are absolute).

    Examples:
        >>> from featurehooks.metrics import ImagePair
        >>> pair = ImagePair("cat/0001.png", "/data/outputs/cat/0001.png", "/data/references/cat/0001.png")
        >>> pair.name, pair.b
        ('cat/0001.png', '/data/references/cat/0001.png')
    """

    name: str
    a: str
    b: str


class _Listed(NamedTuple):
    """An entry of a folder: its relative path, absolute path, and why it cannot be read ("" for an image file)."""

    name: str
    path: str
    reason: str


def _images_by_name(folder: str | os.PathLike[str], ignore_suffix: bool) -> dict[str, _Listed]:
    """``{key: entry}`` of the images under ``folder`` and of what only looks like one; relative paths use ``/``.

    The entries are what ``list_images`` finds, as for a dump. Those that are not regular files (a FIFO,
    a socket, a device, a dangling link) carry the reason ``read_image`` refuses them for, so that they are
    reported, not lost; only their ``stat`` is read.
    """
    root = Path(folder)
    archive = container_of(os.fspath(root)) is not None  # a ZIP, tar shard or array: its rows, by inner name
    if not root.is_dir() and not archive:
        kind = "is not a folder or an archive" if root.exists() else "does not exist"
        raise InputNotFoundError(f"{os.fspath(folder)} {kind}; pass two folders of images")
    base = os.path.abspath(root)
    found: dict[str, _Listed] = {}
    for path in list_images(os.fspath(root)):
        reason = "" if archive or os.path.isfile(path) else _refusal(path)  # a row unreadable: named when scored
        name = Path(os.path.relpath(path, base)).as_posix()
        key = name.rsplit(".", 1)[0] if ignore_suffix and "." in Path(name).name else name
        if key in found:
            raise InvalidValueError(
                f"{found[key].path} and {path} both match {key!r} with ignore_suffix=True; keep one of them"
            )
        found[key] = _Listed(name, path, reason)
    return found


def _refusal(path: str) -> str:
    """Why ``read_image`` refuses ``path``, in the words a dump records for an invalid row.

    ``read_image`` checks the file's ``stat`` before it opens anything, so a FIFO or a device is refused
    without being opened (it could block for ever).
    """
    try:
        read_image(path)
    except Exception as exc:  # noqa: BLE001 - whatever read_image raises is the reason, as for a dump's rows
        return first_line(exc)
    return "not a regular file when the folder was listed"


def _warn_unreadable(unreadable: list[_Listed]) -> None:
    if not unreadable:
        return
    named = "; ".join(f"{entry.path}: {entry.reason}" for entry in unreadable[:_NAMED_SKIPS])
    more = f" and {len(unreadable) - _NAMED_SKIPS} more" if len(unreadable) > _NAMED_SKIPS else ""
    warnings.warn(
        f"{len(unreadable)} input(s) could not be read and are left out of the pairs ({named}{more})", stacklevel=3
    )


def pair_files(
    dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str], *, ignore_suffix: bool = False
) -> tuple[list[ImagePair], list[str], list[str]]:
    """Pair the images of two folders by their path relative to each folder (searched recursively).

    An entry with an image suffix that is not a regular file (a FIFO, a socket, a device, a dangling
    link) is never opened; it is left out with a warning that names it and the reason (``not a regular
    file: fifo``), as a dump reports its unreadable inputs, and so is the pair it would belong to.

    Args:
        dir_a: the first folder (e.g. generated images), or a ZIP archive, WebDataset tar shard, ``.npy`` or
            ``.npz`` of images, whose rows pair by their inner names (member paths, sample keys, indices).
        dir_b: the second folder (e.g. references), or such a file.
        ignore_suffix: match ``x/0001.png`` with ``x/0001.jpg`` (the name without its suffix);
            two images of one folder with the same name then are an error.

    Returns:
        ``(pairs, only_in_a, only_in_b)``: the pairs sorted by relative path (named as in ``dir_a``),
        and the relative paths of the images found in one folder only (sorted).

    Raises:
        InputNotFoundError: a folder does not exist or holds no images.
        InvalidValueError: two images of one folder match one name with ``ignore_suffix``.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import pair_files
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("outputs/cat/0001.png", "references/cat/0001.png", "references/cat/0002.png"):
        ...     (root / name).parent.mkdir(parents=True, exist_ok=True)
        ...     save_image(torch.rand(3, 32, 32), root / name)
        >>> pairs, only_a, only_b = pair_files(root / "outputs", root / "references")
        >>> [pair.name for pair in pairs], only_a, only_b
        (['cat/0001.png'], [], ['cat/0002.png'])
    """
    in_a, in_b = _images_by_name(dir_a, ignore_suffix), _images_by_name(dir_b, ignore_suffix)
    unreadable = sorted(
        (entry for entry in (*in_a.values(), *in_b.values()) if entry.reason), key=lambda entry: entry.path
    )
    _warn_unreadable(unreadable)
    readable = {key for key in in_a.keys() & in_b.keys() if not (in_a[key].reason or in_b[key].reason)}
    pairs = [ImagePair(in_a[key].name, in_a[key].path, in_b[key].path) for key in sorted(readable)]
    only_in_a = sorted(in_a[key].name for key in in_a.keys() - in_b.keys() if not in_a[key].reason)
    only_in_b = sorted(in_b[key].name for key in in_b.keys() - in_a.keys() if not in_b[key].reason)
    return pairs, only_in_a, only_in_b


class PairsWithin(Sequence[ImagePair]):
    """Every pair ``(i, j)``, ``i < j``, of a list of images (or each image with the next only, ``consecutive``),
    in the order ``lpips_1dir_allpairs.py`` scores them: ``(0, 1), (0, 2), ..., (1, 2), ...``. Pairs are made when
    asked for, so ``N (N - 1) / 2`` of them cost no memory; each is named ``(a,b)`` as the script prints it.

    Examples:
        >>> from featurehooks.metrics import PairsWithin
        >>> pairs = PairsWithin(["/x/a.png", "/x/b.png", "/x/c.png"], ["a.png", "b.png", "c.png"])
        >>> len(pairs), [pair.name for pair in pairs]
        (3, ['(a.png,b.png)', '(a.png,c.png)', '(b.png,c.png)'])
    """

    def __init__(self, paths: Sequence[str], names: Sequence[str], *, consecutive: bool = False) -> None:
        self.paths, self.names, self.consecutive = list(paths), list(names), consecutive
        count = len(self.paths)
        self._length = max(count - 1, 0) if consecutive else count * (count - 1) // 2

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> ImagePair: ...

    @overload
    def __getitem__(self, index: slice) -> list[ImagePair]: ...

    def __getitem__(self, index: int | slice) -> ImagePair | list[ImagePair]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"pair {index} of {self._length}")
        return self._pair(*((index, index + 1) if self.consecutive else self._row_and_column(index)))

    def __iter__(self) -> Iterator[ImagePair]:
        """The pairs in order, one at a time (without the square root that finds a pair by its index)."""
        count = len(self.paths)
        steps = zip(range(count - 1), range(1, count)) if self.consecutive else itertools.combinations(range(count), 2)
        return itertools.starmap(self._pair, steps)

    def _pair(self, first: int, second: int) -> ImagePair:
        return ImagePair(f"({self.names[first]},{self.names[second]})", self.paths[first], self.paths[second])

    def _row_and_column(self, index: int) -> tuple[int, int]:
        """``(i, j)`` of pair ``index`` in the rows of the upper triangle: row ``i`` holds ``N - 1 - i`` pairs."""
        count = len(self.paths)
        before = lambda row: row * (2 * count - row - 1) // 2  # noqa: E731 - pairs in the rows above ``row``
        row = int((2 * count - 1 - math.sqrt((2 * count - 1) ** 2 - 8 * index)) // 2)
        while before(row + 1) <= index:  # the float root may land one row short
            row += 1
        while before(row) > index:
            row -= 1
        return row, row + 1 + index - before(row)


def pairs_within(folder: str | os.PathLike[str], *, consecutive: bool = False) -> PairsWithin:
    """Every pair of the images of one folder (searched recursively, sorted by relative path): the pairs of
    ``lpips_1dir_allpairs.py --all-pairs``, whose mean score is the diversity of a set of samples; with
    ``consecutive``, each image with the next (the script without ``--all-pairs``). Unreadable entries are left
    out with a warning, as ``pair_files`` leaves them out.

    Raises:
        InputNotFoundError: the folder does not exist or holds no images.
        InvalidValueError: fewer than two readable images.

    Examples:
        >>> import pathlib, tempfile, torch
        >>> from torchvision.utils import save_image
        >>> from featurehooks.metrics import pairs_within
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("0.png", "1.png", "2.png", "3.png"):
        ...     save_image(torch.rand(3, 16, 16), root / name)
        >>> len(pairs_within(root)), len(pairs_within(root, consecutive=True))
        (6, 3)
    """
    listed = _images_by_name(folder, ignore_suffix=False)
    _warn_unreadable(sorted((entry for entry in listed.values() if entry.reason), key=lambda entry: entry.path))
    readable = sorted((entry for entry in listed.values() if not entry.reason), key=lambda entry: entry.name)
    if len(readable) < 2:
        raise InvalidValueError(f"{os.fspath(folder)} holds {len(readable)} readable image(s); pairs need 2 or more")
    return PairsWithin([entry.path for entry in readable], [entry.name for entry in readable], consecutive=consecutive)
