"""Inputs of a dump: listing image files and the per-row datasets (decoding lives in ``featurehooks.images``).

Every input becomes one row. A file that cannot be decoded still owns its row (zero-filled and
marked invalid), so row numbers depend only on the sorted input list, never on which files failed.
"""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..images import read_image, to_input_range

__all__ = [
    "IMAGE_SUFFIXES",
    "ImageFiles",
    "Sample",
    "SourceSpec",
    "TensorRows",
    "list_images",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
SourceSpec = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], Dataset, Tensor]
_GLOB_CHARS = set("*?[")


@dataclass
class Sample:
    """One decoded row: ``image`` (C, H, W) float, or zeros with ``reason`` saying why it is invalid."""

    image: Tensor
    reason: str


def _expand(item: str | os.PathLike[str]) -> list[str]:
    text = os.fspath(item)
    if _GLOB_CHARS & set(text) and not os.path.exists(text):  # "photo [1].jpg" is a file, not a pattern
        found = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"no files match {text!r}")
        return found
    path = Path(text)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES[:4])}, ...) under {text}")
        return files
    if not path.exists():
        raise FileNotFoundError(f"no such file or folder: {text}")
    return [text]


def list_images(source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Absolute paths of the images in ``source``, in a deterministic order.

    ``source`` is a folder (searched recursively for common image suffixes), a glob pattern, a file,
    or a list of any of these. Each folder or glob is sorted; the items keep the order given.
    Files listed explicitly are kept whatever their suffix (an unreadable one is reported later).
    A path that exists is taken literally even if it contains ``*?[`` (``photo [1].jpg``).
    """
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise ValueError("no inputs given: pass a folder, a glob pattern or a list of image paths")
    paths: list[str] = []
    for item in items:
        paths.extend(os.path.abspath(p) for p in _expand(item))
    return paths


def inputs_digest(names: Sequence[str]) -> str:
    """SHA-256 of the input list, to check that a resumed dump sees the same inputs in the same order."""
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ImageFiles(Dataset):
    """Rows of image files, decoded and prepared by ``transform``; failures become invalid rows."""

    def __init__(self, paths: Sequence[str], transform: Any, shape: tuple[int, ...]) -> None:
        self.paths = list(paths)
        self.transform = transform
        self.shape = shape

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Sample:
        try:
            image = self.transform(read_image(self.paths[index]))
        except Exception as exc:  # Pillow raises OSError, ValueError, SyntaxError, DecompressionBombError...
            return Sample(torch.zeros(self.shape), _describe(exc))
        if tuple(image.shape) != self.shape:
            return Sample(torch.zeros(self.shape), f"size {tuple(image.shape)} differs from {self.shape}; set a crop")
        return Sample(image, "")


class TensorRows(Dataset):
    """Rows of a user's dataset of image tensors (or tuples whose first item is one).

    Float tensors are taken as they are (already in ``input_range``); ``uint8`` tensors hold 0..255
    pixels, as ``torchvision.io.decode_image`` returns them, and are scaled to ``input_range`` like image files.
    """

    def __init__(self, dataset: Dataset, shape: tuple[int, ...], input_range: tuple[float, float] = (0.0, 1.0)) -> None:
        self.dataset = dataset
        self.shape = shape
        self.input_range = input_range

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Sample:
        try:
            item = first_tensor(self.dataset[index])
        except Exception as exc:  # a user's dataset may raise anything for a bad item
            return Sample(torch.zeros(self.shape), _describe(exc))
        if tuple(item.shape) != self.shape:
            return Sample(torch.zeros(self.shape), f"shape {tuple(item.shape)} differs from {self.shape}")
        if item.dtype == torch.uint8:
            return Sample(to_input_range(item, self.input_range), "")
        return Sample(item.float(), "")


def first_tensor(item: Any) -> Tensor:
    """The image tensor of a dataset item: the item itself, or the first element of a tuple/list."""
    if isinstance(item, (tuple, list)) and item:
        item = item[0]
    if not isinstance(item, Tensor):
        raise TypeError(f"dataset items must be image tensors (C, H, W), got {type(item).__name__}")
    return item


def collate(samples: list[Sample]) -> tuple[Tensor, list[str]]:
    """Stack a batch of samples: images and the reasons (empty for valid rows)."""
    return torch.stack([s.image for s in samples]), [s.reason for s in samples]
