"""Batch feature dumps: streaming per-layer ``.npy`` files, a manifest, resume, and torchrun sharding.

Modules, one job each: ``sources`` (listing and decoding inputs), ``transform`` (resize, crop,
scale), ``forward`` (features of one batch, pooled and cast), ``store`` (files, journal, atomic
manifest), ``plan`` (settings, resume/overwrite rules, completion), ``sharding`` (ranks and their
rows), ``run`` (``dump_features``, which ties them together).
"""

from .run import DumpResult, dump_features
from .sources import IMAGE_SUFFIXES, decode_image, list_images, read_image
from .store import read_manifest
from .transform import ImageTransform, transform_for

__all__ = [
    "IMAGE_SUFFIXES",
    "DumpResult",
    "ImageTransform",
    "decode_image",
    "dump_features",
    "list_images",
    "read_image",
    "read_manifest",
    "transform_for",
]
