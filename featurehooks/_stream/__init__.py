"""The input pipeline: image collections in, batches of features out (what dumps, metrics and the CLI share).

Modules, in the order data flows through them:

- ``sources``: a folder, glob, brace pattern, file list, container file, dataset, tensor or generator resolved to
  ``Inputs`` (the rows, the image shape every row gets, the transform), and one row decoded into a ``Sample``;
- ``generated``: a generator's batches as a source (``GeneratedImages``, public as ``featurehooks.GeneratedImages``):
  rows drawn in order in this process, a pass opened where its rows start, its first batch what a resume checks;
- ``members``: rows inside container files, named ``<container>/<inner>``: finding a name's container, reading a
  row from its name alone, the containers each process holds open; ``archives`` (ZIP archives, WebDataset tar
  shards: members read in place, decoded as files are) and ``arrays`` (``.npy``/``.npz`` of ``uint8`` images);
- ``loader``: rows decoded in DataLoader worker processes and collated into batches cut to a pixel budget;
- ``cpus``: the CPUs this process may use (affinity, cgroup quota), shared by decoding workers and torch's threads;
- ``forward``: features of one batch, pooled and cast to arrays; a row's shapes before any forward
  (from the extractor's meta trace); where a model computes (``placement``);
- ``tiling``: CPU micro-batches whose largest activation fits the cache, for models whose rows are provably
  independent of their batch (``independence``);
- ``pipeline``: ``feature_batches``, the one loop from batches of rows to batches of features, and
  ``extract_batches``, that loop for a ``FeatureExtractor`` over ``Inputs``;
- ``options``: the keyword options every streaming entry point takes (``StreamOptions``), checked once;
- ``progress``: the best-effort bar on stderr;
- ``sharding``: torchrun ranks, the contiguous share of the rows each takes, and the collectives that join them;
  the shards of jobs that share nothing (``shard=(i, n)``, the ``Shard`` their parts record, ``check_cover``).

It imports the modules below it (``images``, ``_layout``, ``errors``; ``extractor`` for types only) and
nothing from ``dump``, ``metrics`` or ``cli``, which all import it.
"""

from .forward import placement, row_shapes
from .generated import GeneratedImages
from .loader import Batch, loader_workers, pixel_pieces, row_loader, worker_deaths
from .members import container_of, read_row
from .options import Streaming, StreamOptions
from .pipeline import FeatureBatch, Forward, dtype_name, extract_batches, feature_batches
from .progress import Progress
from .sources import (
    IMAGE_SUFFIXES,
    Inputs,
    Sample,
    SourceSpec,
    inputs_digest,
    list_images,
    planned_on_main,
    resolve_inputs,
)

__all__ = [
    "IMAGE_SUFFIXES",
    "Batch",
    "FeatureBatch",
    "Forward",
    "GeneratedImages",
    "Inputs",
    "Progress",
    "Sample",
    "StreamOptions",
    "Streaming",
    "SourceSpec",
    "container_of",
    "dtype_name",
    "extract_batches",
    "feature_batches",
    "inputs_digest",
    "list_images",
    "loader_workers",
    "pixel_pieces",
    "placement",
    "planned_on_main",
    "read_row",
    "resolve_inputs",
    "row_loader",
    "row_shapes",
    "worker_deaths",
]
