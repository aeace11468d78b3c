"""Batch feature dumps: streaming per-layer ``.npy`` files, a manifest, resume, and torchrun sharding.

Modules, one job each: ``sources`` (listing inputs, the per-row datasets), ``forward`` (features
of one batch, pooled and cast), ``store`` (files, journal, atomic manifest), ``plan`` (settings,
resume/overwrite rules, completion), ``sharding`` (ranks and their rows), ``run``
(``dump_features``, which ties them together). Reading and preparing images is
``featurehooks.images``.
"""

from ..stream.sources import IMAGE_SUFFIXES, list_images
from .run import DumpResult, dump_features
from .store import CorruptDumpError, DumpLockedError, NoSpaceError, read_manifest

__all__ = [
    "IMAGE_SUFFIXES",
    "CorruptDumpError",
    "DumpLockedError",
    "DumpResult",
    "dump_features",
    "list_images",
    "NoSpaceError",
    "read_manifest",
]
