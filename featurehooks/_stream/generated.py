"""Images a generator makes, as a source: batches drawn from a callable or an iterable as the pipeline needs them,
in this process, never written to files (a PNG round trip changes FID; clean-fid and EDM2 evaluate generators so).

``GeneratedImages`` is the public source; ``GeneratedRows`` reads its rows in order for one call (rows named
``generated/<row>``), opening a pass of the generator where its rows start: at that row for a ``seekable`` callable,
else at row 0, the rows before made again and discarded. ``fingerprint`` names a generator's images by its first
image, which a dump records and a resume compares.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import InvalidTypeError, InvalidValueError

__all__ = ["GeneratedImages", "GeneratedRows", "fingerprint", "row_names"]

Batches = Union[Callable[..., Iterable[Any]], Iterable[Any]]
_RANGE_SLACK = 0.1  # floats this far outside input_range (a fraction of its width) are the wrong scale


class GeneratedImages:
    """A generator's images as the source of any streaming entry point (``dump_features``, ``feature_statistics``,
    ``fid_statistics``, ``fid``, ``evaluate``...): batches drawn as the images are needed, never written to files.

    Each batch is an ``(N, C, H, W)`` tensor or numpy array of ``uint8`` pixels (0..255) or of floats in the
    extractor's ``input_range`` ((0, 1) by default), on any device, of any length; its rows get exactly what the
    same images concatenated into one tensor source get. The rows are named ``generated/000000000`` on, and the
    generator is asked for no batch past ``num_images`` (clean-fid's ``num_gen``). Batches are drawn in the calling
    process under ``torch.no_grad()`` (``num_workers`` does not apply) and copied to the CPU. A batch that is not
    images (another dimensionality or dtype, no images, another image shape than the first batch's, floats off
    ``input_range`` by more than a tenth of it, NaN) stops the run with one error naming the batch, as do too few
    images and an exception of the generator; a dump keeps the batches committed before, and ``resume=True``
    finishes it.

    A resume, a shard (``shard=(i, n)``) and a torchrun rank draw their rows from a pass of their own, so the
    generator must make the same images on every pass (seeded). What a dump records of them, and a resume checks,
    is their count and the SHA-256 of the first batch (in ``inputs.npy``), not the later batches.

    Args:
        batches: a callable returning an iterable of batches (called again for each pass), or an iterable of
            batches (a list, or any re-iterable; a generator object is read once: enough for one call).
        num_images: the images to take (the generator may yield more; fewer is an error).
        seekable: ``batches`` is a callable taking the row to start from: ``batches(start)`` yields the images from
            row ``start`` on (which may fall inside one of its batches: seed each image by its row, as EDM2 seeds
            its images), so a resume, a shard or a rank draws only its own rows (and the first batch). Otherwise
            each of them draws from row 0 and discards the rows before its own, with a warning saying how many.

    Examples:
        >>> import torch
        >>> from featurehooks import FeatureExtractor, GeneratedImages, feature_statistics
        >>> def image(row: int):  # each image seeded by its row, as EDM2 seeds its images
        ...     return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(row))
        >>> def sample(start: int):  # a stand-in for G(z): the images from row start on, in batches of 4
        ...     for first in range(start, 10, 4):
        ...         yield torch.stack([image(row) for row in range(first, min(first + 4, 10))])
        >>> images = GeneratedImages(sample, num_images=10, seekable=True)
        >>> ext = FeatureExtractor("resnet18", ["layer4"], weights=None)
        >>> feature_statistics(ext, images, batch_size=4).count
        10
    """

    def __init__(self, batches: Batches, num_images: int, *, seekable: bool = False) -> None:
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise InvalidValueError(f"num_images must be a positive int, got {num_images!r}")
        if not isinstance(seekable, bool):
            raise InvalidTypeError(f"seekable must be True or False, got {seekable!r}")
        if not callable(batches) and not isinstance(batches, Iterable):
            raise InvalidTypeError(
                f"batches must be a callable returning batches of images, or an iterable of them; got "
                f"{type(batches).__name__}"
            )
        if seekable and not callable(batches):
            raise InvalidTypeError("seekable=True needs a callable taking the row to start from (batches(start))")
        self.batches = batches
        self.num_images = num_images
        self.seekable = seekable
        self._head: _Pass | None = None  # the pass from row 0 whose first batch was read, for the rows to come
        self._once_read = False  # a one-pass iterable (an iterator) was opened

    def __len__(self) -> int:
        return self.num_images

    def __repr__(self) -> str:
        seek = ", seekable=True" if self.seekable else ""
        return f"GeneratedImages({self.batches!r}, num_images={self.num_images}{seek})"

    def first_batch(self) -> Tensor:
        """The first batch, checked, on the CPU: drawn once, then kept with its pass for the rows that follow."""
        if self._head is None:
            head = self.open(0)
            head.advance()
            self._head = head
        return self._head.batch  # type: ignore[return-value]  # advanced: it holds a batch

    def open(self, start: int) -> _Pass:
        """A pass of the generator from row ``start`` (a seekable one's), or from row 0 (the kept one, if any; a
        pass opened elsewhere lets it go, with what its generator holds)."""
        head, self._head = self._head, None
        if head is not None and (start == 0 or not self.seekable):
            return head
        with torch.no_grad():  # a callable may compute its batches at once
            if self.seekable:
                return _Pass(self, iter(self.batches(start)), start)  # type: ignore[operator]
            if callable(self.batches):
                return _Pass(self, iter(self.batches()), 0)
        iterator = iter(self.batches)
        if iterator is self.batches:  # an iterator: one pass only
            if self._once_read:
                raise InvalidValueError(
                    "this GeneratedImages was built on a generator object, which yields its batches once and is "
                    "spent; pass a function that returns a new one (GeneratedImages(lambda: sample(), ...))"
                )
            self._once_read = True
        return _Pass(self, iterator, 0)


class _Pass:
    """One pass of a generator: its iterator, the batch it holds (rows ``[start, stop)``) and that batch's number."""

    def __init__(self, source: GeneratedImages, iterator: Iterator[Any], start: int) -> None:
        self.source, self.iterator = source, iterator
        self.opened_at = start
        self.start = self.stop = start
        self.batch: Tensor | None = None
        self.shape: tuple[int, ...] | None = None  # of every image: the first batch's
        self.number = -1  # batches drawn in this pass, less one

    def where(self) -> str:
        """The batch held, as an error names it: its number in the pass, and its first row."""
        called = f" called with start={self.opened_at}" if self.opened_at else ""
        return f"batch {self.number} of the generator{called} (rows from {self.start})"

    def advance(self) -> None:
        """Draw the next batch (under ``no_grad``), check it and hold it; rows past ``num_images`` are cut off."""
        total = self.source.num_images
        with torch.no_grad():
            try:
                raw = next(self.iterator)
            except StopIteration:
                raise InvalidValueError(
                    f"the generator stopped after row {self.stop} but num_images={total}: make it yield "
                    f"{total} images, or pass num_images={self.stop}"
                ) from None
        self.number += 1
        self.start = self.stop
        batch = _as_images(raw, self.where(), self.shape)
        self.shape = tuple(batch.shape[1:])
        self.batch = batch[: total - self.start]
        self.stop = self.start + len(self.batch)


def _as_images(raw: Any, where: str, shape: tuple[int, ...] | None) -> Tensor:
    """``raw`` as a CPU copy of an ``(N, C, H, W)`` batch of ``uint8`` or floats, its images of ``shape`` (when not
    ``None``); else one error naming the batch (``where``)."""
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8 and raw.dtype.kind != "f":
            raise InvalidTypeError(f"{where} is a numpy array of {raw.dtype}, not uint8 pixels or floats")
        tensor = torch.tensor(raw)
    elif isinstance(raw, Tensor):
        tensor = raw.detach().to("cpu", copy=True)
    else:
        hint = " (yield the images only)" if isinstance(raw, (tuple, list)) else ""
        raise InvalidTypeError(f"{where} is a {type(raw).__name__}, not an (N, C, H, W) tensor or numpy array{hint}")
    if tensor.dim() != 4:
        hint = "; a callable returning one tensor of images yields them one by one: return [images]"
        raise InvalidValueError(
            f"{where} has shape {tuple(tensor.shape)}, not (N, C, H, W)" + (hint if tensor.dim() == 3 else "")
        )
    if tensor.dtype != torch.uint8 and not tensor.is_floating_point():
        raise InvalidTypeError(f"{where} is {tensor.dtype}: pass uint8 pixels (0..255) or floats in input_range")
    if len(tensor) == 0:
        raise InvalidValueError(f"{where} holds no images")
    if shape is not None and tuple(tensor.shape[1:]) != shape:
        raise InvalidValueError(f"{where} holds images of shape {tuple(tensor.shape[1:])}, the first batch {shape}")
    if shape is None and tensor.shape[1] not in (1, 3, 4) and tensor.shape[-1] in (1, 3, 4):
        raise InvalidValueError(
            f"{where} has shape {tuple(tensor.shape)}: channels last? pass (N, C, H, W) "
            "(a tensor's .permute(0, 3, 1, 2), an array's .transpose(0, 3, 1, 2))"
        )
    return tensor


def check_range(batch: Tensor, input_range: tuple[float, float], where: str) -> None:
    """Refuse floats that are NaN, infinite or outside ``input_range`` by more than a tenth of its width (the wrong
    scale: a generator's (-1, 1) into (0, 1)); ``uint8`` pixels are in range by their type."""
    if not batch.is_floating_point():
        return
    if not torch.isfinite(batch).all():
        raise InvalidValueError(f"{where} holds NaN or infinite values")
    low, high = input_range
    slack = _RANGE_SLACK * (high - low)
    found_low, found_high = (float(value) for value in torch.aminmax(batch))
    if found_low < low - slack or found_high > high + slack:
        raise InvalidValueError(
            f"{where} spans [{found_low:.3g}, {found_high:.3g}], not input_range={input_range}: map the "
            "generator's output to it (e.g. (x + 1) / 2 for (-1, 1)), or pass uint8 pixels"
        )


class GeneratedRows(Dataset):
    """Row ``i`` of a ``GeneratedImages`` (an image ``(C, H, W)`` as the generator made it, on the CPU), read in
    order through one pass at a time: rows ahead continue the pass, a row behind it opens a new one (at that row
    for a seekable generator, else at row 0), and a seekable generator skips a gap by opening at its end.
    Every image must have ``shape`` (the first batch's); floats are checked against ``input_range`` batch by batch."""

    def __init__(self, source: GeneratedImages, input_range: tuple[float, float], shape: tuple[int, ...]) -> None:
        self.source, self.input_range, self.shape = source, input_range, shape
        self._pass: _Pass | None = None

    def __len__(self) -> int:
        return self.source.num_images

    def __getitem__(self, row: int) -> Tensor:
        if not 0 <= row < self.source.num_images:
            raise IndexError(f"row {row} of {self.source.num_images} generated images")
        current = self._pass
        if current is None or row < current.start or (self.source.seekable and row > current.stop):
            current = self._pass = self._opened(row)
        while row >= current.stop:
            current.advance()
            if row < current.stop:
                check_range(current.batch, self.input_range, current.where())  # type: ignore[arg-type]
        return current.batch[row - current.start]  # type: ignore[index]

    def _opened(self, row: int) -> _Pass:
        """A pass from ``row``, or from row 0 with a warning for the rows before ``row`` it makes again."""
        opened = self.source.open(row)
        opened.shape = self.shape
        if opened.batch is not None:  # the kept first batch
            check_range(opened.batch, self.input_range, opened.where())
        if row > opened.stop:
            warnings.warn(
                f"generating and discarding rows {opened.stop}:{row} to reach row {row}: the GeneratedImages "
                "cannot seek (pass a callable taking the row to start from, with seekable=True)",
                stacklevel=2,
            )
        return opened


def row_names(count: int) -> list[str]:
    """The rows' names of ``count`` generated images: ``generated/000000000`` on (9 digits, more when needed)."""
    width = max(9, len(str(count - 1)))
    return [f"generated/{row:0{width}d}" for row in range(count)]


def fingerprint(batch: Tensor) -> str:
    """SHA-256 of a batch's dtype, shape and bytes: what names a generator's images (a batch of its first image)."""
    digest = hashlib.sha256(f"{batch.dtype} {tuple(batch.shape)}\n".encode())
    flat = batch.contiguous().reshape(-1)
    digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
