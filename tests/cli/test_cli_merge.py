"""``--shard I/N`` (and ``--shard slurm``) on extract and stats, and ``featurehooks merge``: the parts of a job array
merged on the command line give what one run gives; a merge that cannot is one error line, exit 2."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from featurehooks.cli import main
from featurehooks.cli._common import shard_from
from featurehooks.dump import read_manifest
from featurehooks.metrics import FeatureStatistics, load_statistics, save_statistics

from helpers import two_ranks

MODEL = ["--backbone", "resnet18", "--weights", "none", "--layers", "layer1", "--pool", "avg"]
SIZES = ["--resize", "32", "--crop", "32", "--workers", "0", "--batch-size", "1", "-q"]


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: "), stderr
    return lines[0]


def test_extract_parts_of_a_slurm_array_merge_into_one_extract(
    images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["extract", str(images), "--out", str(tmp_path / "single"), *MODEL, *SIZES]) == 0
    for task in (1, 2, 3):  # sbatch --array=1-3: SLURM numbers the tasks from the array's lowest index
        environment = {"ID": task, "COUNT": 3, "MIN": 1, "MAX": 3, "STEP": 1}
        for name, value in environment.items():
            monkeypatch.setenv(f"SLURM_ARRAY_TASK_{name}", str(value))
        out = tmp_path / f"part{task}"
        assert main(["extract", str(images), "--out", str(out), "--shard", "slurm", *MODEL, *SIZES]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1].endswith("(shard 2/3 (rows 4:5 of 5); join the parts with `featurehooks merge`)")
    shard = read_manifest(tmp_path / "part2").settings.shard  # type: ignore[union-attr]
    assert (shard.index, shard.count, shard.start, shard.stop) == (1, 3, 2, 4)  # type: ignore[union-attr]
    parts = [str(tmp_path / f"part{task}") for task in (3, 1, 2)]
    assert main(["merge", str(tmp_path / "merged"), *parts]) == 0
    assert capsys.readouterr().out == f"merged 3 parts into {tmp_path / 'merged'}: 5 rows\n"
    for name in ("layer1.npy", "index.csv", "inputs.npy", "manifest.json"):
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "single" / name).read_bytes(), name
    assert main(["merge", str(tmp_path / "merged"), *parts]) == 0
    assert capsys.readouterr().out.startswith("already complete: ")
    assert main(["merge", str(tmp_path / "missing"), *parts[:2]]) == 2  # shard 1/3 left out
    assert "rows 2:4 of the 5 are in no part; missing: shard 1/3" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "missing").exists()


def test_stats_parts_merge_into_one_stats_file(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", str(images), "--out", str(tmp_path / "whole.npz"), *MODEL, *SIZES]) == 0
    for index in range(2):
        out = str(tmp_path / f"part{index}.npz")
        assert main(["stats", str(images), "--out", out, "--shard", f"{index}/2", *MODEL, *SIZES]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(", 2 images of shard 1/2 (rows 3:5 of 5), 64 features")
    parts = [str(tmp_path / f"part{index}.npz") for index in range(2)]
    assert main(["merge", str(tmp_path / "merged.npz"), *parts]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'merged.npz'}: layer1, 5 images from 2 parts, 64 features\n"
    merged, whole = (FeatureStatistics.load(tmp_path / name) for name in ("merged.npz", "whole.npz"))
    assert merged.count == whole.count == 5 and merged.shard is None
    assert float((merged.covariance - whole.covariance).abs().max() / whole.covariance.abs().max()) < 1e-12
    assert main(["fd", parts[0], str(tmp_path / "whole.npz"), *MODEL[:-2], "-q"]) == 2  # a shard is no whole set
    assert "one holds shard 0/2 (rows 0:3 of 5) only; join the shards" in one_error_line(capsys.readouterr().err)
    assert main(["merge", str(tmp_path / "mixed"), parts[0], str(tmp_path)]) == 2
    assert "PART mixes dump folders" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("text", "environment", "expected"),
    [
        ("2/5", {}, (2, 5)),
        ("slurm", {"ID": "4", "COUNT": "5"}, (4, 5)),
        ("slurm", {"ID": "12", "COUNT": "3", "MIN": "10", "MAX": "12", "STEP": "1"}, (2, 3)),
        ("5/5", {}, "expected I/N with 0 <= I < N"),
        ("slurm", {}, "SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT are not set"),
        ("slurm", {"ID": "2", "COUNT": "3", "MIN": "0", "MAX": "4", "STEP": "2"}, "not one range of consecutive"),
        ("slurm", {"ID": "7", "COUNT": "3", "MIN": "1", "MAX": "7"}, "use --array=0-2"),  # --array=1,4,7
    ],
)
def test_shard_flag_reads_i_of_n_or_a_slurm_array_task(
    text: str, environment: dict[str, str], expected: object
) -> None:
    environ = {f"SLURM_ARRAY_TASK_{name}": value for name, value in environment.items()}
    if isinstance(expected, tuple):
        assert shard_from(text, environ) == expected
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=str(expected)):
            shard_from(text, environ)


@pytest.mark.slow  # two processes
def test_torchrun_ranks_split_a_shard_into_the_part_one_process_writes(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nodes without a shared filesystem: each node's ranks (here two, on a disk of their own) split its shard."""
    shard = ["extract", str(images), *MODEL, *SIZES, "--shard", "1/2"]
    ranks = two_ranks([*shard, "--out", str(tmp_path / "ranks")])
    assert ranks.returncode == 0, ranks.stderr[-2000:]
    assert main([*shard, "--out", str(tmp_path / "one")]) == 0
    for name in ("layer1.npy", "index.csv", "inputs.npy", "manifest.json"):
        assert (tmp_path / "ranks" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


EVAL = ["--metrics", "cmmd", "--workers", "0", "--batch-size", "2", "--device", "cpu", "-q"]


def test_eval_parts_of_a_reference_set_merge_into_the_set_one_run_writes(
    images: Path, png_folder: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    from clip_reference import cached_clip

    with cached_clip(tmp_path / "hub"):  # a tiny seeded CLIP tower where CLIP ViT-L/14@336's weights are cached
        assert main(["eval", "--save-stats", str(images), str(tmp_path / "whole.npz"), *EVAL]) == 0
        for index in range(3):
            out = str(tmp_path / f"part{index}.npz")
            assert main(["eval", "--save-stats", str(images), out, "--shard", f"{index}/3", *EVAL]) == 0
        printed = capsys.readouterr().out.splitlines()[-1]
        assert printed.endswith(": the statistics of REAL of shard 2/3 (rows 4:5 of 5) for cmmd (clip 1 images x 16)")
        parts = [str(tmp_path / f"part{index}.npz") for index in (1, 2, 0)]
        assert main(["merge", str(tmp_path / "merged.npz"), *parts]) == 0
        wrote = f"wrote {tmp_path / 'merged.npz'}: the statistics set of 3 parts (clip 5 images x 16)\n"
        assert capsys.readouterr().out == wrote
        merged, whole = (load_statistics(tmp_path / name)["clip"] for name in ("merged.npz", "whole.npz"))
        assert merged.count == whole.count == 5 and merged.shard is None and merged.origin == whole.origin
        assert float((merged.covariance - whole.covariance).abs().max() / whole.covariance.abs().max()) < 1e-12
        assert torch.equal(merged.features, whole.features)  # every embedding, in row order
        fake = str(png_folder(4, (40, 44), seed=2))
        for reference in ("merged.npz", "whole.npz"):  # the merged file serves as the reference set
            assert main(["eval", str(tmp_path / reference), fake, *EVAL]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0] == lines[1] and lines[0].startswith("cmmd: ")


def test_eval_shards_only_a_reference_set_and_merge_names_parts_of_another_kind(
    images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(images), str(images), "--shard", "0/2", *EVAL]) == 2
    assert "--shard computes a part of REAL's statistics: pass it with --save-stats" in one_error_line(
        capsys.readouterr().err
    )
    parts = [str(tmp_path / f"part{index}.npz") for index in range(2)]
    assert main(["stats", str(images), "--out", parts[0], "--shard", "0/2", *MODEL, *SIZES]) == 0
    save_statistics(parts[1], {"inception": FeatureStatistics.load(parts[0])})
    assert main(["merge", str(tmp_path / "merged.npz"), parts[1], parts[0]]) == 2
    error = one_error_line(capsys.readouterr().err)
    assert f"{parts[0]} holds one statistics" in error and "not a set of named statistics" in error
    assert not (tmp_path / "merged.npz").exists()
