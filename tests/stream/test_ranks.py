"""The one protocol of every distributed entry point (dumps, statistics), on two CPU ranks: rank 0 plans for
every rank (``Distributed.from_main``, ``planned_on_main``), every rank computes its share (``Distributed.each``),
and a rank that fails makes the others stop with its reason instead of waiting."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from featurehooks._stream.sharding import Distributed
from featurehooks.errors import RunFailedError

from helpers import each_rank, write_pngs

pytestmark = pytest.mark.slow  # two Python processes a test

_RANK = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from featurehooks._stream import planned_on_main, resolve_inputs
    from featurehooks._stream.sharding import Distributed
    from featurehooks.errors import InvalidValueError
    from helpers import tiny_extractor

    folder, rank = sys.argv[1], int(os.environ["RANK"])
    ranks = Distributed.from_environment(torch.device("cpu"))
    report = {}

    def outcome(work):
        try:
            return ["ok", work()]
        except Exception as exc:
            return [type(exc).__name__, str(exc)]

    def planned():
        if rank:
            raise AssertionError("rank 1 listed the folder itself")
        return "plan", resolve_inputs(tiny_extractor(), folder, None, None, "avg")

    def plan_on_main():
        value, inputs = planned_on_main(ranks, folder, planned)
        return [value, [os.path.basename(name) for name in inputs.names], list(inputs.image_shape)]

    def refused():
        raise InvalidValueError("rank 0 refuses the plan")

    def share():
        if rank == 1:
            raise ValueError("rank 1 cannot read its share")
        return rank

    report["from_main"] = outcome(lambda: ranks.from_main(lambda: "planned on rank %d" % rank))
    report["planned"] = outcome(plan_on_main)
    report["refused"] = outcome(lambda: ranks.from_main(refused))
    report["each"] = outcome(lambda: ranks.each(lambda: rank * 10, "adding"))
    report["failed"] = outcome(lambda: ranks.each(share, "while reading", "rerun it"))
    ranks.close()
    print(json.dumps(report))
    """
)


def _two_ranks(script: Path, folder: Path) -> list[dict[str, list[object]]]:
    path = os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])
    ranks = each_rank([sys.executable, str(script), str(folder)], {"PYTHONPATH": path})
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    return [json.loads(rank.stdout.strip().splitlines()[-1]) for rank in ranks]


def test_rank_zero_plans_and_a_failing_rank_stops_the_others(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    folder = write_pngs(tmp_path / "images", count=3, size=(12, 14))
    rank0, rank1 = _two_ranks(script, folder)
    assert rank0["from_main"] == rank1["from_main"] == ["ok", "planned on rank 0"]
    # one listing, rank 0's: the ranks agree on the rows even if the folder changes between two listings
    assert rank0["planned"] == rank1["planned"] == ["ok", ["plan", ["0.png", "1.png", "2.png"], [3, 12, 14]]]
    assert rank0["refused"] == rank1["refused"] == ["InvalidValueError", "rank 0 refuses the plan"]
    assert rank0["each"] == rank1["each"] == ["ok", [0, 10]]
    assert rank1["failed"] == ["ValueError", "rank 1 cannot read its share"]
    assert rank0["failed"] == [
        "RunFailedError",
        "another rank failed while reading (rank 1: ValueError: rank 1 cannot read its share); rerun it",
    ]


def test_one_process_runs_the_work_itself_and_raises_its_own_error() -> None:
    alone = Distributed()
    assert alone.from_main(lambda: "x") == "x" and alone.each(lambda: 3, "adding") == [3]
    with pytest.raises(KeyError):
        alone.each(lambda: {}["missing"], "adding")
    with pytest.raises(RunFailedError, match="no"):
        alone.from_main(lambda: (_ for _ in ()).throw(RunFailedError("no")))


_LISTS_ON_MAIN = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import torch
    import featurehooks as fh
    from featurehooks._stream import sources
    from featurehooks.metrics import fid_extractor, fid_statistics
    from helpers import tiny_extractor

    folder, rank = sys.argv[1], int(os.environ["RANK"])
    if rank:  # only rank 0 may list the folder: the ranks would count another listing's files
        def listed_here(source):
            raise AssertionError("rank 1 listed the folder itself")
        sources.list_images = listed_here
    extractor = tiny_extractor()
    torch.manual_seed(0)
    fid = fid_extractor(weights=None, dims=64, device="cpu")
    options = {"num_workers": 0, "batch_size": 1, "resize_size": None, "crop_size": None}
    stats = fh.feature_statistics(extractor, folder, layer="relu1", pool="avg", **options)
    fid_stats = fid_statistics(folder, extractor=fid, **options)
    dump = fh.dump_features(extractor, folder, Path(folder).parent / "dump", pool="avg", **options)
    print(json.dumps([stats.count, fid_stats.count, dump.num_rows, dump.rows_computed]))
    """
)


def test_statistics_fid_and_dumps_use_rank_zeros_listing(tmp_path: Path) -> None:
    script = tmp_path / "lists.py"
    script.write_text(_LISTS_ON_MAIN)
    folder = write_pngs(tmp_path / "images", count=3, size=(12, 14))
    rank0, rank1 = _two_ranks(script, folder)
    assert rank0[:3] == rank1[:3] == [3, 3, 3]  # type: ignore[comparison-overlap]
