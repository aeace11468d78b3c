"""Every pair of a folder, streamed (issue 43): ``iter_pair_scores`` yields the scores in the order of the pairs,
each equal to the metric on the pair read alone, decoding by tiles (about N² / side decodes, not N²); the running
summary equals ``statistics`` over all scores bit for bit; the commands write the rows and the summary line as the
list-based code did; memory grows with N, not with the N (N - 1) / 2 pairs."""

from __future__ import annotations

import csv
import io
import itertools
import math
import statistics
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import featurehooks.metrics.pair_scores as pairs_module
from featurehooks.cli import main
from featurehooks.errors import InvalidValueError
from featurehooks.images import read_image
from featurehooks.metrics import LPIPS, PairsWithin, RunningSummary, iter_pair_scores, pairs_within, score_pairs


def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A pair metric whose value for a pair does not depend on the rest of its batch."""
    return (a - b).abs().mean(dim=(1, 2, 3)) + a[:, 0, 0, 0]  # not symmetric: the order within a pair shows


def write_folder(root: Path, count: int, size: int = 16) -> Path:
    """``count`` seeded PNGs, every fourth in a subfolder (the names sort across folders)."""
    rng = np.random.default_rng(count)
    for i in range(count):
        path = root / (f"sub/{i:03d}.png" if i % 4 == 3 else f"{i:03d}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Thirteen 16x16 PNGs: 78 pairs, in tiles of 5 with batch_size=5 (groups of 5, 5 and 3)."""
    return write_folder(tmp_path_factory.mktemp("pairs"), 13)


def by_hand(pairs: PairsWithin) -> list[float]:
    """Each pair's score from its two files read alone, in the pairs' order (the oracle)."""

    def prepared(path: str) -> torch.Tensor:
        return read_image(path).float()[None] / 255

    return [distance(prepared(pair.a), prepared(pair.b)).item() for pair in pairs]


@pytest.mark.parametrize(
    ("options", "side"),
    [
        ({"batch_size": 5}, 5),  # tiles of 5 images, batches of 5 pairs
        ({"batch_size": 64, "batch_pixels": 3 * 256}, 3),  # the pixel budget sets the side: 3 images of 16x16
        ({"batch_size": 64, "batch_pixels": 256}, 1),  # one image a group: a tile is a pair, its row image kept
        ({"batch_size": 4, "num_workers": 2}, 4),  # tiles dealt to two workers, scores put back in order
    ],
)
def test_scores_stream_in_order_and_each_image_is_decoded_about_n_over_side_times(
    folder: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, int], side: int
) -> None:
    pairs = pairs_within(folder)
    expected = by_hand(pairs)
    decoded: list[str] = []
    monkeypatch.setattr(pairs_module, "read_row", lambda path: decoded.append(path) or read_image(path))
    chunks = list(iter_pair_scores(distance, pairs, **{"num_workers": 0, **options}))
    assert all(chunk.dtype == np.float64 for chunk in chunks) and len(chunks) > 1  # yielded as they come
    np.testing.assert_allclose(np.concatenate(chunks), expected, rtol=1e-6)
    if not options.get("num_workers"):  # decoding happened here: count it (group r kept across its row of tiles)
        groups = range(math.ceil(13 / side))
        size = [min(side, 13 - group * side) for group in groups]
        tiles = [(r, c) for r in groups for c in groups if r <= c and r * side < c * side + size[c] - 1]  # with a pair
        rows = {r for r, _ in tiles}
        assert len(decoded) - 1 == sum(size[r] for r in rows) + sum(size[c] for r, c in tiles if c != r)  # +1: sizing
        assert len(decoded) < 2 * len(pairs)  # the list-based code read 2 images per pair: 156
    assert score_pairs(distance, pairs, **{"num_workers": 0, **options}) == np.concatenate(chunks).tolist()


def test_consecutive_and_listed_pairs_stream_as_before(folder: Path) -> None:
    consecutive = pairs_within(folder, consecutive=True)
    assert list(consecutive) == [consecutive[i] for i in range(len(consecutive))]  # iteration without the root
    every = pairs_within(folder)
    assert list(every) == [every[i] for i in range(len(every))]
    np.testing.assert_allclose(score_pairs(distance, consecutive, num_workers=0, batch_size=3), by_hand(consecutive))
    listed = [(pair.a, pair.b) for pair in every]  # a plain list goes pair by pair, as before
    assert score_pairs(distance, listed, num_workers=0, batch_size=7) == score_pairs(distance, every, num_workers=0)


def test_an_unreadable_image_is_named_when_its_pair_comes(tmp_path: Path) -> None:
    root = write_folder(tmp_path / "images", 6)
    (root / "002.png").write_bytes(b"not a png")
    chunks = iter_pair_scores(distance, pairs_within(root), num_workers=0, batch_size=2)
    with pytest.raises(InvalidValueError, match=r"cannot read image .*002\.png"):
        list(chunks)
    (root / "000.png").write_bytes(b"not a png")  # the first image is read before any pair: to size the tiles
    with pytest.raises(InvalidValueError, match=r"cannot read image .*000\.png"):
        iter_pair_scores(distance, pairs_within(root), num_workers=0)


def test_the_running_summary_equals_statistics_over_all_scores() -> None:
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.random(500) * 10.0 ** rng.integers(-8, 3), rng.random(300).astype(np.float32)])
    running = RunningSummary()
    for chunk in np.array_split(scores, [1, 7, 100, 101, 640]):
        running.add(chunk)
    summary = running.summary()
    values = scores.tolist()
    assert (summary.count, summary.mean, summary.std) == (800, statistics.fmean(values), statistics.stdev(values))
    naive = np.float64(0.0)  # a float64 running sum agrees to 1e-12 too, not bitwise in general
    for value in values:
        naive += value
    assert abs(naive / 800 - summary.mean) <= 1e-12 * abs(summary.mean)
    one = RunningSummary()
    one.add([0.25])
    assert (one.summary().mean, one.summary().std) == (0.25, 0.0)
    assert math.isnan(RunningSummary().summary().mean)
    special = RunningSummary()
    special.add([1.0, math.inf])
    assert special.summary().mean == math.inf and math.isnan(special.summary().std)


def old_report(names: list[str], scores: list[float], label: str) -> tuple[str, str]:
    """The CSV and the summary line as the list-based report wrote them (before streaming)."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["name", "score"])
    writer.writerows([name, repr(score)] for name, score in zip(names, scores))
    spread = statistics.stdev(scores) if len(scores) > 1 else 0.0
    return text.getvalue(), f"{label}: {statistics.fmean(scores):.6g} ± {spread:.3g} over {len(scores)} pairs"


@pytest.mark.parametrize("mode", ["--all-pairs", "--consecutive"])
def test_the_command_writes_what_it_wrote_before(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    root = write_folder(tmp_path / "images", 7, size=32)
    out = tmp_path / "pairs.csv"
    argv = ["lpips", str(root), mode, "--weights", "none", "--seed", "0", "--workers", "0", "--device", "cpu"]
    assert main([*argv, "-q", "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    pairs = pairs_within(root, consecutive=mode == "--consecutive")
    scores = [float(row["score"]) for row in csv.DictReader(out.open())]
    text, line = old_report([pair.name for pair in pairs], scores, "LPIPS (alex, v0.1, calibrated)")
    assert out.read_text() == text and printed == line + "\n"
    assert not list(tmp_path.glob(".pairs.csv.tmp-*"))  # the file was renamed into place
    if mode == "--all-pairs":  # scored by tiles: the same scores as pair by pair (consecutive pairs still go so)
        torch.manual_seed(0)
        metric = LPIPS("alex", weights=None, reduction="none")  # the command's network
        np.testing.assert_allclose(scores, score_pairs(metric, list(pairs), num_workers=0), rtol=1e-6)


def test_a_failed_run_leaves_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_folder(tmp_path / "images", 6, size=32)
    (root / "004.png").write_bytes(b"not a png")
    out = tmp_path / "pairs.csv"
    argv = ["lpips", str(root), "--all-pairs", "--weights", "none", "--workers", "0", "--device", "cpu", "-q"]
    assert main([*argv, "--batch-size", "2", "--out", str(out)]) != 0
    assert "004.png" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".pairs.csv.tmp-*"))


def peak_python_memory(folder: Path) -> int:
    """Peak bytes of Python objects while every pair of ``folder`` is scored and summed up (tiles of 8 images)."""
    tracemalloc.start()
    try:
        running = RunningSummary()
        for chunk in iter_pair_scores(distance, pairs_within(folder), num_workers=0, batch_size=8):
            running.add(chunk)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_grows_with_the_images_not_with_the_pairs(tmp_path: Path) -> None:
    small, large = write_folder(tmp_path / "small", 24), write_folder(tmp_path / "large", 96)
    peak_python_memory(write_folder(tmp_path / "warm", 3))  # imports and caches first
    ratio = peak_python_memory(large) / peak_python_memory(small)
    # 4x the images, 16.5x the pairs: the list-based code measured 4.8x (its lists of pairs and scores), the stream 1.4x
    assert ratio < 3, ratio


def test_pairs_are_made_lazily() -> None:
    count = 10_000
    pairs = PairsWithin([f"/x/{i}.png" for i in range(count)], [f"{i}.png" for i in range(count)])
    assert len(pairs) == count * (count - 1) // 2
    assert list(itertools.islice(pairs, 2))[1].name == "(0.png,2.png)" and pairs[-1].name == "(9998.png,9999.png)"
