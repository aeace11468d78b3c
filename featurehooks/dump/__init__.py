"""Batch feature dumps: streaming per-layer ``.npy`` files, a manifest, resume, and torchrun sharding.

Modules, one job each: ``store`` (files, journal, atomic manifest), ``manifest`` (its typed fields),
``plan`` (settings, resume/overwrite rules, completion), ``run`` (``dump_features``, which ties them together),
``merge`` (``merge_dumps``: the dumps of the shards of a set, made by jobs that share nothing, joined into one).
Images reach it through ``featurehooks._stream`` (listing, decoding, batches of features, torchrun ranks and their
rows), which metrics share; ``list_images`` and ``IMAGE_SUFFIXES`` are its.
"""

from .._stream import IMAGE_SUFFIXES, list_images
from ..errors import CorruptDumpError, DumpLockedError, NoSpaceError
from .manifest import UNRECORDED, InputsRecord, Manifest, Settings, SkippedRow
from .merge import merge_dumps
from .run import DumpResult, dump_features
from .store import read_manifest

__all__ = [
    "IMAGE_SUFFIXES",
    "UNRECORDED",
    "CorruptDumpError",
    "DumpLockedError",
    "DumpResult",
    "InputsRecord",
    "Manifest",
    "Settings",
    "SkippedRow",
    "dump_features",
    "list_images",
    "merge_dumps",
    "NoSpaceError",
    "read_manifest",
]
