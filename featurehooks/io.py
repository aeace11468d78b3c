"""Feature dumps to disk; the implementation lives in :mod:`featurehooks.dump`."""

from .dump import DumpResult, dump_features, read_manifest

__all__ = ["DumpResult", "dump_features", "read_manifest"]
