"""Scoring pairs of images from two folders with a pairwise metric such as LPIPS.

``pair_files`` matches the images of two folders by their path relative to each folder;
``score_pairs`` streams the pairs through a DataLoader (decoding in worker processes while the
metric runs) and returns one score per pair, in order. Images are read and prepared by
``featurehooks.images``, as dumps read them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import InterpolationMode

from ..dump.run import Progress, loader_workers
from ..dump.sources import list_images
from ..errors import InputNotFoundError, InvalidTypeError, InvalidValueError, first_line
from ..images import ImageTransform, read_image

__all__ = ["ImagePair", "pair_files", "score_pairs"]

PairMetric = Callable[[Tensor, Tensor], Tensor]


class ImagePair(NamedTuple):
    """Two image files with the same relative path ``name`` under two folders (``a`` and ``b`` are absolute)."""

    name: str
    a: str
    b: str


def _images_by_name(folder: str | os.PathLike[str], ignore_suffix: bool) -> dict[str, tuple[str, str]]:
    """``{key: (relative path, absolute path)}`` of the images under ``folder``; relative paths use ``/``."""
    root = Path(folder)
    if not root.is_dir():
        kind = "is not a folder" if root.exists() else "does not exist"
        raise InputNotFoundError(f"{os.fspath(folder)} {kind}; pass two folders of images")
    base = os.path.abspath(root)
    found: dict[str, tuple[str, str]] = {}
    for path in list_images(root):
        name = Path(os.path.relpath(path, base)).as_posix()
        key = name.rsplit(".", 1)[0] if ignore_suffix and "." in Path(name).name else name
        if key in found:
            raise InvalidValueError(
                f"{found[key][1]} and {path} both match {key!r} with ignore_suffix=True; keep one of them"
            )
        found[key] = (name, path)
    return found


def pair_files(
    dir_a: str | os.PathLike[str], dir_b: str | os.PathLike[str], *, ignore_suffix: bool = False
) -> tuple[list[ImagePair], list[str], list[str]]:
    """Pair the images of two folders by their path relative to each folder (searched recursively).

    Args:
        dir_a: the first folder (e.g. generated images).
        dir_b: the second folder (e.g. references).
        ignore_suffix: match ``x/0001.png`` with ``x/0001.jpg`` (the name without its suffix);
            two images of one folder with the same name then are an error.

    Returns:
        ``(pairs, only_in_a, only_in_b)``: the pairs sorted by relative path (named as in ``dir_a``),
        and the relative paths found in one folder only (sorted).

    Raises:
        InputNotFoundError: a folder does not exist or holds no images.
        InvalidValueError: two images of one folder match one name with ``ignore_suffix``.

    Example:
        >>> pairs, only_a, only_b = pair_files("outputs/", "references/")  # doctest: +SKIP
        >>> pairs[0]  # doctest: +SKIP
        ImagePair(name='cat/0001.png', a='/data/outputs/cat/0001.png', b='/data/references/cat/0001.png')
    """
    in_a, in_b = _images_by_name(dir_a, ignore_suffix), _images_by_name(dir_b, ignore_suffix)
    pairs = [ImagePair(in_a[key][0], in_a[key][1], in_b[key][1]) for key in sorted(in_a.keys() & in_b.keys())]
    only_in_a = sorted(in_a[key][0] for key in in_a.keys() - in_b.keys())
    only_in_b = sorted(in_b[key][0] for key in in_b.keys() - in_a.keys())
    return pairs, only_in_a, only_in_b


class _PairImages(Dataset):
    """Decoded and prepared images of each pair; a failure is returned as a reason, raised by the main process."""

    def __init__(self, pairs: Sequence[ImagePair] | Sequence[tuple[str, str]], transform: ImageTransform) -> None:
        self.pairs = [_paths(item) for item in pairs]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[Tensor | None, Tensor | None, str]:
        images = []
        for path in self.pairs[index]:
            try:
                images.append(self.transform(read_image(path)))
            except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
                return None, None, f"cannot read image {path}: {first_line(exc)}"
        a, b = images
        if a.shape != b.shape:
            a_path, b_path = self.pairs[index]
            return (
                None,
                None,
                (
                    f"images of a pair differ in size after preparation: {a_path} is {tuple(a.shape[1:])}, "
                    f"{b_path} is {tuple(b.shape[1:])}; pass a crop_size (or resize both to one size)"
                ),
            )
        return a, b, ""


def _paths(item: tuple[str, str] | ImagePair) -> tuple[str, str]:
    """``(path_a, path_b)`` of an ``ImagePair`` or of a pair of paths."""
    if isinstance(item, ImagePair):
        return item.a, item.b
    try:
        a, b = item
        return os.fspath(a), os.fspath(b)
    except (TypeError, ValueError):
        raise InvalidValueError(f"pairs holds {item!r}; give ImagePair items or (path_a, path_b) pairs") from None


def _collate(items: list[tuple[Tensor | None, Tensor | None, str]]) -> list[tuple[Tensor | None, Tensor | None, str]]:
    return items  # pairs of different sizes share a batch; they are grouped by size in the main process


def _reference(metric: Any) -> Tensor:
    """A floating tensor of the metric (its device and dtype), or a CPU float32 one for a plain function."""
    if isinstance(metric, torch.nn.Module):
        for tensor in (*metric.buffers(), *metric.parameters()):
            if tensor.is_floating_point():
                return tensor
    return torch.empty(0)


def score_pairs(
    metric: PairMetric,
    pairs: Sequence[ImagePair] | Sequence[tuple[str, str]],
    *,
    batch_size: int = 16,
    num_workers: int | None = None,
    resize_size: int | None = None,
    crop_size: int | None = None,
    interpolation: str = "bilinear",
    progress: bool = False,
) -> list[float]:
    """One score per pair of image files: ``metric(a, b)`` for each pair, in the order of ``pairs``.

    Images are decoded in DataLoader workers (``featurehooks.images.read_image``), optionally resized
    (shorter side) and center-cropped, scaled to the metric's ``input_range`` (``(0, 1)`` for a
    callable without one) and moved to its device. Both images of a pair must have the same size
    after that; pairs of different sizes are scored in separate forwards.

    Args:
        metric: a module or function ``(a, b) -> (B,)`` distances, e.g. ``LPIPS(reduction="none")``.
        pairs: the ``ImagePair`` items of ``pair_files``, or ``(path_a, path_b)`` items.
        batch_size: pairs per forward.
        num_workers: decoding processes (default: up to 4, one less than the CPU cores; 0 decodes
            in this process).
        resize_size: resize the shorter side of both images to this size first (``None``: keep).
        crop_size: then center-crop a square of this size (``None``: keep).
        interpolation: ``"bilinear"`` or ``"bicubic"`` for the resize.
        progress: show a tqdm bar (pairs) on stderr.

    Returns:
        The scores as floats, aligned with ``pairs``.

    Raises:
        InvalidValueError: an image cannot be read (the error names the file), the images of a pair
            differ in size, or the metric does not return one value per pair (for ``LPIPS`` pass
            ``reduction="none"``).

    Example:
        >>> from featurehooks.metrics.lpips import LPIPS
        >>> pairs, _, _ = pair_files("outputs/", "references/")  # doctest: +SKIP
        >>> scores = score_pairs(LPIPS("alex", reduction="none"), pairs, batch_size=32)  # doctest: +SKIP
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if num_workers is not None and (
        isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0
    ):
        raise InvalidValueError(f"num_workers must be a non-negative int or None, got {num_workers!r}")
    if not callable(metric):
        raise InvalidTypeError(f"metric must be callable as metric(a, b), got {type(metric).__name__}")
    for name, size in (("resize_size", resize_size), ("crop_size", crop_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise InvalidValueError(f"{name} must be a positive int or None, got {size!r}")
    try:
        InterpolationMode(interpolation)
    except ValueError:
        modes = [mode.value for mode in InterpolationMode]
        raise InvalidValueError(f"interpolation must be one of {modes}, not {interpolation!r}") from None
    if not pairs:
        return []
    input_range = tuple(float(v) for v in getattr(metric, "input_range", (0.0, 1.0)))
    transform = ImageTransform(resize_size, crop_size, interpolation, (input_range[0], input_range[1]))
    batches = -(-len(pairs) // batch_size)
    workers = loader_workers(num_workers, batches)
    loader = DataLoader(
        _PairImages(pairs, transform),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=_collate,
        prefetch_factor=2 if workers > 0 else None,
    )
    reference = _reference(metric)
    scores: list[float] = []
    bar = Progress(len(pairs), 0, 1, progress, label="score", unit="pair")
    try:
        with torch.no_grad():
            for batch in loader:
                scores.extend(_score_batch(metric, batch, reference))
                bar.update(len(batch))
    finally:
        bar.close()
    return scores


def _score_batch(
    metric: PairMetric, batch: list[tuple[Tensor | None, Tensor | None, str]], reference: Tensor
) -> list[float]:
    """Scores of one batch, in order: one ``metric`` call per image size found in it."""
    by_size: dict[tuple[int, ...], list[int]] = {}
    for index, (a, _, reason) in enumerate(batch):
        if reason or a is None:
            raise InvalidValueError(reason)
        by_size.setdefault(tuple(a.shape), []).append(index)
    scores = [0.0] * len(batch)
    for indices in by_size.values():
        a = torch.stack([batch[i][0] for i in indices]).to(device=reference.device, dtype=reference.dtype)  # type: ignore[misc]
        b = torch.stack([batch[i][1] for i in indices]).to(device=reference.device, dtype=reference.dtype)  # type: ignore[misc]
        values = metric(a, b)
        if not isinstance(values, Tensor) or tuple(values.shape) != (len(indices),):
            shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise InvalidValueError(
                f"the metric returned {shape} for {len(indices)} pairs; it must return one value per pair "
                "(for LPIPS pass reduction='none' and spatial=False)"
            )
        for i, value in zip(indices, values.float().cpu().tolist()):
            scores[i] = value
    return scores
