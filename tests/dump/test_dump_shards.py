"""Dumps of shards (``shard=(i, n)``: jobs that share nothing) and ``merge_dumps``: the parts of a job array join
into the dump one process writes, byte for byte; a part killed mid-way resumes and merges the same; every merge
that cannot give that dump is refused in one line, before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from featurehooks import FeatureExtractor, dump_features, read_manifest
from featurehooks._stream.sharding import Distributed
from featurehooks.dump import merge_dumps
from featurehooks.errors import CorruptDumpError, FeatureHooksError, InvalidTypeError, InvalidValueError

from dump_helpers import mark_unfinished, scribble
from helpers import tiny_extractor, write_pngs

BATCH = 2
SIZE = 16
OPTIONS = {"batch_size": BATCH, "num_workers": 0, "progress": False, "resize_size": SIZE, "crop_size": SIZE}


def dump(ext: FeatureExtractor, source: object, out: Path, **kwargs: object):
    return dump_features(ext, source, out, **{**OPTIONS, **kwargs})


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def parts_of(ext: FeatureExtractor, source: object, root: Path, count: int = 3, **kwargs: object) -> list[Path]:
    """The dumps of every shard of ``count``, each in a folder of its own (as jobs with no shared disk write them)."""
    for index in range(count):
        dump(ext, source, root / f"part{index}of{count}", shard=(index, count), **kwargs)
    return [root / f"part{index}of{count}" for index in range(count)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten PNGs and one broken file among them (row 5: ``4_broken.png``), so a part has a skipped row of its own."""
    root = write_pngs(tmp_path_factory.mktemp("shard_pngs"), count=10, size=(20, 24))
    (root / "4_broken.png").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.rand(10, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, images: torch.Tensor) -> dict[str, Path]:
    """Parts of one tensor source for the refusals: the three shards of 3, the two of 2, a dump of the whole set,
    shard 1/3 computed otherwise (float16, other weights), of other images, and unfinished."""
    root = tmp_path_factory.mktemp("shard_parts")
    ext = tiny_extractor()
    found = dict(zip(("0/3", "1/3", "2/3"), parts_of(ext, images, root)))
    found |= dict(zip(("0/2", "1/2"), parts_of(ext, images, root, count=2)))
    found["whole"] = dump(ext, images, root / "whole").out_dir
    found["float16"] = dump(ext, images, root / "float16", shard=(1, 3), dtype="float16").out_dir
    other = tiny_extractor()
    with torch.no_grad():
        other.backbone.conv1.weight[0, 0, 0, 0] += 1
    found["weights"] = dump(other, images, root / "weights", shard=(1, 3)).out_dir
    more = torch.cat([images, images[:2]])  # a dataset's rows are named by index: another set is another count
    found["other set"] = dump(ext, more, root / "other set", shard=(1, 3)).out_dir
    found["unfinished"] = root / "unfinished"
    shutil.copytree(found["1/3"], found["unfinished"])
    manifest = json.loads((found["unfinished"] / "manifest.json").read_text())
    (found["unfinished"] / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    return found


def test_three_job_array_parts_merge_into_the_single_run_dump(folder: Path, tmp_path: Path) -> None:
    ext = tiny_extractor()
    single = dump(ext, folder, tmp_path / "single").out_dir
    parts = parts_of(ext, folder, tmp_path)
    shards = [read_manifest(part).settings.shard for part in parts]  # type: ignore[union-attr]
    assert [(s.index, s.count, s.start, s.stop, s.set_count) for s in shards] == [
        (0, 3, 0, 4, 11), (1, 3, 4, 8, 11), (2, 3, 8, 11, 11)
    ]  # fmt: skip
    second = read_manifest(parts[1])
    assert second is not None and second.num_rows == 4 and [row.row for row in second.skipped or ()] == [1]
    assert (parts[1] / "index.csv").read_text().splitlines()[2].startswith("1,0,")  # its own rows, the broken one
    merged = merge_dumps(tmp_path / "merged", list(reversed(parts)))
    assert merged.rows_computed == 11 and merged.manifest == read_manifest(single)
    same_files(tmp_path / "merged", single)  # arrays, index.csv, inputs.npy and manifest.json, byte for byte
    assert merge_dumps(tmp_path / "merged", parts).rows_computed == 0  # already complete: left as it is


def test_parts_of_a_labelled_dataset_merge_with_their_labels(tmp_path: Path) -> None:
    items = torch.rand(7, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(4))
    dataset = torch.utils.data.TensorDataset(items, torch.arange(7) * 3)
    ext = tiny_extractor()
    single = dump(ext, dataset, tmp_path / "single").out_dir
    parts = parts_of(ext, dataset, tmp_path)
    assert (parts[2] / "index.csv").read_text().splitlines()[1] == "0,1,dataset[6]"  # rows keep their names
    merge_dumps(tmp_path / "merged", parts)
    same_files(tmp_path / "merged", single)


def test_an_interrupted_merge_is_finished_by_running_it_again(made: dict[str, Path], tmp_path: Path) -> None:
    parts = [made["0/3"], made["1/3"], made["2/3"]]
    merge_dumps(tmp_path / "reference", parts)
    out = tmp_path / "merged"
    merge_dumps(out, parts)
    store = mark_unfinished(out, [(0, 0, BATCH)])  # killed after its first commit
    scribble(store, BATCH, 10, 7.0)
    store.close_arrays()
    assert merge_dumps(out, parts).rows_computed == 10 - BATCH
    same_files(out, tmp_path / "reference")


class Stalls(torch.utils.data.Dataset):
    """``images``; from row ``stall_from`` on each item waits a minute (for the kill) while ``stall`` is set."""

    def __init__(self, images: torch.Tensor, stall_from: int) -> None:
        self.images, self.stall_from, self.stall = images, stall_from, False

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.stall and index >= self.stall_from:
            time.sleep(60)
        return self.images[index]


def test_a_part_killed_mid_way_resumes_and_merges_the_same(
    made: dict[str, Path], images: torch.Tensor, tmp_path: Path
) -> None:
    source = Stalls(images, stall_from=6)  # shard 1/3 is rows 4:8: one batch committed, then it stalls
    out = tmp_path / "part1of3"
    source.stall = True
    pid = os.fork()
    if pid == 0:  # the job: a process of its own, killed with -9 mid-way
        try:
            torch.set_num_threads(1)
            dump(tiny_extractor(), source, out, shard=(1, 3))
        finally:
            os._exit(0)
    journal, deadline = out / ".journal" / "rank-0.jsonl", time.monotonic() + 60
    while not (journal.exists() and journal.read_text().count("\n")):
        if time.monotonic() > deadline or os.waitpid(pid, os.WNOHANG)[0]:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the part ended or stalled before its first commit")
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    killed = read_manifest(out)
    assert killed is not None and killed.status == "running"
    with pytest.raises(InvalidValueError, match="unfinished dump .* finish it"):
        merge_dumps(tmp_path / "merged", [made["0/3"], out, made["2/3"]])
    assert not (tmp_path / "merged").exists()
    source.stall = False
    assert dump(tiny_extractor(), source, out, shard=(1, 3), resume=True).rows_computed == BATCH
    merge_dumps(tmp_path / "merged", [made["0/3"], out, made["2/3"]])
    merge_dumps(tmp_path / "reference", [made["0/3"], made["1/3"], made["2/3"]])
    same_files(tmp_path / "merged", tmp_path / "reference")


REFUSALS = {
    "overlap": (
        ["0/2", "1/3", "2/3"],
        r"part0of2 \(shard 0/2 \(rows 0:6 of 10\)\) and .*part1of3 .* overlap in rows 4:6",
    ),
    "missing": (["0/3", "2/3"], r"rows 4:8 of the 10 are in no part; missing: shard 1/3"),
    "twice": (["0/3", "1/3", "1/3", "2/3"], r"part1of3 and .*part1of3 are both shard 1/3"),
    "settings": (["0/3", "float16", "2/3"], r"float16 was computed with other dtype than .*part0of3"),
    "weights": (["0/3", "weights", "2/3"], r"weights was computed with other weights_sha256 than"),
    "other set": (["0/3", "other set", "2/3"], r"other set is a shard of another input set than"),
    "unfinished": (["0/3", "unfinished", "2/3"], r"unfinished is an unfinished dump \(status 'running': its job is"),
    "whole": (["whole"], r"whole is the dump of a whole input set, not of a shard"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_merge_that_cannot_give_the_single_run_dump_is_refused_in_one_line(
    made: dict[str, Path], tmp_path: Path, case: str
) -> None:
    names, expected = REFUSALS[case]
    parts = [made[name] for name in names]
    if case == "twice":
        parts[2] = tmp_path / "copy" / "part1of3"
        shutil.copytree(made["1/3"], parts[2])
    with pytest.raises(FeatureHooksError, match=expected) as info:
        merge_dumps(tmp_path / "merged", parts)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "merged").exists()  # nothing written


def test_a_merge_into_another_dump_is_refused_unless_overwrite(made: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "taken"
    shutil.copytree(made["0/2"], out)
    parts = [made["0/3"], made["1/3"], made["2/3"]]
    with pytest.raises(FileExistsError, match="holds another dump .*overwrite"):
        merge_dumps(out, parts)
    assert read_manifest(out) == read_manifest(made["0/2"])
    assert merge_dumps(out, parts, overwrite=True).manifest == merge_dumps(tmp_path / "new", parts).manifest
    with pytest.raises(InvalidValueError, match="given twice"):
        merge_dumps(tmp_path / "twice", [*parts, parts[0]])
    with pytest.raises(InvalidTypeError, match="list of dump folders"):
        merge_dumps(out, str(made["0/3"]))  # type: ignore[arg-type]


def test_a_part_whose_files_do_not_fit_its_manifest_is_refused(made: dict[str, Path], tmp_path: Path) -> None:
    part = tmp_path / "part1of3"
    shutil.copytree(made["1/3"], part)
    index = (part / "index.csv").read_text()
    (part / "index.csv").write_text(index.replace("dataset[5]", "dataset[9]"))
    with pytest.raises(CorruptDumpError, match="index.csv: its paths are not the rows manifest.json names"):
        merge_dumps(tmp_path / "merged", [made["0/3"], part, made["2/3"]])
    manifest = json.loads((part / "manifest.json").read_text())
    manifest["shard"]["rows"] = [4, 9]
    (part / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptDumpError, match=r"shard rows 4:9 are not inputs.count \(4\) rows"):
        read_manifest(part)


def test_shards_are_checked_and_an_empty_one_is_refused(images: torch.Tensor, tmp_path: Path) -> None:
    ext = tiny_extractor()
    for shard, error in (((3, 3), InvalidValueError), ((True, 2), InvalidTypeError), ("0/2", InvalidTypeError)):
        with pytest.raises(error, match="shard"):
            dump(ext, images, tmp_path / "out", shard=shard)
    with pytest.raises(InvalidValueError, match="shard 5/6 is empty: 10 rows make 5 batch"):
        dump(ext, images, tmp_path / "out", shard=(5, 6))
    assert not (tmp_path / "out").exists()


def test_a_part_resumed_as_another_shard_is_refused(images: torch.Tensor, tmp_path: Path) -> None:
    ext = tiny_extractor()
    out = tmp_path / "part"
    dump(ext, images, out, shard=(0, 3))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))
    with pytest.raises(InvalidValueError, match="cannot resume .*shard"):
        dump(ext, images, out, shard=(1, 3), resume=True)


def test_ranks_of_one_torchrun_given_other_shards_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = Distributed(rank=0, world_size=2)
    monkeypatch.setattr(ranks, "all_gather", lambda value: [value, (1, 2)])  # what rank 1 was given
    ranks.agree((1, 2), "shards")
    with pytest.raises(InvalidValueError, match=r"the ranks were given other shards \(\(0, 2\), \(1, 2\), by rank\)"):
        ranks.agree((0, 2), "shards")
