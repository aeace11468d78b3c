"""A generator's batches as a source (``GeneratedImages``): the features of the same images as one tensor, bitwise;
a generator that raises leaves a dump that a resume finishes byte for byte; shards and ranks each draw their own
rows; batches that are not images refused in one line naming the batch."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from featurehooks import dump_features
from featurehooks._stream.generated import GeneratedImages
from featurehooks.dump import merge_dumps
from featurehooks.errors import InvalidTypeError, InvalidValueError
from featurehooks.metrics import feature_statistics

from helpers import each_rank, tiny_extractor

COUNT, SIZE = 10, (3, 20, 22)  # 10 images: pipeline batches of 4 (4, 4, 2) across generator batches of 3
OPTIONS = {"batch_size": 4, "num_workers": 0, "progress": False}


def image(row: int, dtype: torch.dtype) -> torch.Tensor:
    """Row ``row``'s image, seeded by the row alone (as EDM2 seeds each image): the same whatever pass draws it."""
    seeded = torch.Generator().manual_seed(row)
    if dtype == torch.uint8:
        return torch.randint(0, 256, SIZE, generator=seeded, dtype=torch.uint8)
    return torch.rand(SIZE, generator=seeded).to(dtype)


def sample(
    start: int = 0,
    *,
    dtype: torch.dtype = torch.uint8,
    size: int = 3,
    fail_at: int | None = None,
    starts: list[int] | None = None,
) -> Iterator[torch.Tensor]:
    """Batches of ``size`` images from row ``start`` on (and past ``COUNT``: the source stops there); raises at
    batch number ``fail_at``; records each ``start`` it is called with in ``starts``."""
    if starts is not None:
        starts.append(start)
    first, number = start, 0
    while True:
        if number == fail_at:
            raise RuntimeError(f"the sampler failed at batch {number}")
        yield torch.stack([image(row, dtype) for row in range(first, first + size)])
        first, number = first + size, number + 1


def reference(dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.stack([image(row, dtype) for row in range(COUNT)])


def dump_files(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


@pytest.mark.parametrize("kind", ["uint8 tensors", "float32 tensors", "float16 tensors", "uint8 numpy arrays"])
def test_generated_rows_have_the_concatenated_tensors_features_bitwise(tmp_path: Path, kind: str) -> None:
    dtype = {"float32 tensors": torch.float32, "float16 tensors": torch.float16}.get(kind, torch.uint8)
    batches = partial(sample, dtype=dtype)
    if kind.endswith("numpy arrays"):
        source = GeneratedImages(lambda: (batch.numpy() for batch in batches()), num_images=COUNT)
    else:
        source = GeneratedImages(batches, num_images=COUNT)
    generated = dump_features(tiny_extractor(), source, tmp_path / "generated", **OPTIONS)
    tensor = dump_features(tiny_extractor(), reference(dtype), tmp_path / "tensor", **OPTIONS)
    for layer in ("relu1", "conv2"):
        np.testing.assert_array_equal(generated.load(layer), tensor.load(layer))
    names = [line.split(",")[2] for line in (tmp_path / "generated" / "index.csv").read_text().splitlines()[1:]]
    assert names == [f"generated/{row:09d}" for row in range(COUNT)]


def test_statistics_of_generated_images_are_the_tensors(tmp_path: Path) -> None:
    ext = tiny_extractor(["conv2"])
    options = {**OPTIONS, "batch_size": 3}
    generated = feature_statistics(ext, GeneratedImages(sample, num_images=COUNT), keep=COUNT, **options)
    tensor = feature_statistics(ext, reference(), keep=COUNT, **options)
    assert generated.count == tensor.count == COUNT
    assert torch.equal(generated.mean, tensor.mean) and torch.equal(generated.covariance, tensor.covariance)


def test_the_generator_is_asked_for_no_batch_past_num_images() -> None:
    drawn: list[int] = []

    def counted() -> Iterator[torch.Tensor]:
        for number, batch in enumerate(sample()):
            drawn.append(number)
            yield batch

    stats = feature_statistics(tiny_extractor(["conv2"]), GeneratedImages(counted, num_images=7), **OPTIONS)
    assert stats.count == 7 and drawn == [0, 1, 2]  # rows 0:9 hold the 7; batch 3 is never drawn


@pytest.mark.parametrize("seekable", [False, True], ids=["discarding", "seekable"])
def test_a_generator_that_raises_leaves_a_dump_that_resume_finishes_bitwise(tmp_path: Path, seekable: bool) -> None:
    whole = dump_features(tiny_extractor(), GeneratedImages(sample, COUNT), tmp_path / "whole", **OPTIONS)
    out = tmp_path / "out"
    failing = GeneratedImages(partial(sample, fail_at=2), COUNT, seekable=seekable)  # rows 6:9: pipeline batch 1
    with pytest.raises(RuntimeError, match="the sampler failed at batch 2"):
        dump_features(tiny_extractor(), failing, out, **OPTIONS)
    assert json.loads((out / "manifest.json").read_text())["status"] == "running"
    starts: list[int] = []
    again = GeneratedImages(partial(sample, starts=starts), COUNT, seekable=seekable)
    if seekable:
        resumed = dump_features(tiny_extractor(), again, out, resume=True, **OPTIONS)
        assert starts == [0, 4]  # the first batch (what a resume checks), then the rows not committed
    else:
        with pytest.warns(UserWarning, match="discarding rows 3:4 to reach row 4"):
            resumed = dump_features(tiny_extractor(), again, out, resume=True, **OPTIONS)
        assert starts == [0]  # one pass: its first batch checked, then continued
    assert resumed.rows_computed == COUNT - 4  # batch 0 (rows 0:4) was committed before the sampler failed
    assert dump_files(out) == dump_files(whole.out_dir)


def test_a_resume_takes_the_same_images_in_batches_of_another_size(tmp_path: Path) -> None:
    whole = dump_features(tiny_extractor(), GeneratedImages(sample, COUNT), tmp_path / "whole", **OPTIONS)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        dump_features(tiny_extractor(), GeneratedImages(partial(sample, fail_at=2), COUNT), out, **OPTIONS)
    bigger = GeneratedImages(partial(sample, size=5), COUNT)  # another GPU, another batch size: the same images
    dump_features(tiny_extractor(), bigger, out, resume=True, **OPTIONS)  # row 4 lies in its first batch
    assert dump_files(out) == dump_files(whole.out_dir)


def test_a_resume_refuses_a_generator_that_makes_other_images(tmp_path: Path) -> None:
    failing = GeneratedImages(partial(sample, fail_at=2), COUNT)
    with pytest.raises(RuntimeError):
        dump_features(tiny_extractor(), failing, tmp_path, **OPTIONS)
    other = GeneratedImages(lambda: (batch.flip(-1) for batch in sample()), COUNT)  # an unseeded sampler's next pass
    with pytest.raises(InvalidValueError, match="the generator's first image differs from the earlier run's"):
        dump_features(tiny_extractor(), other, tmp_path, resume=True, **OPTIONS)


@pytest.mark.parametrize("seekable", [False, True], ids=["discarding", "seekable"])
def test_shards_of_a_generator_merge_into_the_one_run_dump(tmp_path: Path, seekable: bool) -> None:
    whole = dump_features(tiny_extractor(), GeneratedImages(sample, COUNT), tmp_path / "whole", **OPTIONS)
    starts: list[int] = []
    source = GeneratedImages(partial(sample, starts=starts), COUNT, seekable=seekable)
    dump_features(tiny_extractor(), source, tmp_path / "part0", shard=(0, 2), **OPTIONS)  # rows 0:8
    if seekable:
        dump_features(tiny_extractor(), source, tmp_path / "part1", shard=(1, 2), **OPTIONS)  # rows 8:10
        assert starts == [0, 0, 8]  # each part: the first batch (its identity), then its own rows
    else:
        with pytest.warns(UserWarning, match="discarding rows 3:8"):
            dump_features(tiny_extractor(), source, tmp_path / "part1", shard=(1, 2), **OPTIONS)
    merged = merge_dumps(tmp_path / "merged", [tmp_path / "part1", tmp_path / "part0"])
    assert dump_files(merged.out_dir) == dump_files(whole.out_dir)


def test_parts_of_two_generators_are_refused_by_the_merge(tmp_path: Path) -> None:
    dump_features(tiny_extractor(), GeneratedImages(sample, COUNT), tmp_path / "part0", shard=(0, 2), **OPTIONS)
    other = GeneratedImages(lambda: (255 - batch for batch in sample()), COUNT)  # other images
    with pytest.warns(UserWarning, match="discarding"):
        part1 = dump_features(tiny_extractor(), other, tmp_path / "part1", shard=(1, 2), **OPTIONS)
    assert part1.manifest.settings.inputs.kind == "generated"
    with pytest.raises(InvalidValueError, match="come from generators that made other images"):
        merge_dumps(tmp_path / "merged", [tmp_path / "part0", tmp_path / "part1"])


def test_a_pass_from_another_row_makes_images_of_the_first_batchs_shape() -> None:
    def elsewhere_smaller(start: int) -> Iterator[torch.Tensor]:
        return (batch if start == 0 else batch[..., :10] for batch in sample(start))

    source = GeneratedImages(elsewhere_smaller, COUNT, seekable=True)
    message = r"^batch 0 of the generator called with start=8 \(rows from 8\) holds images of shape \(3, 20, 10\)"
    with pytest.raises(InvalidValueError, match=message):
        feature_statistics(tiny_extractor(["conv2"]), source, shard=(1, 2), **OPTIONS)


def test_a_generator_object_is_read_once() -> None:
    def mean(source: object) -> torch.Tensor:
        return feature_statistics(tiny_extractor(["conv2"]), source, **OPTIONS).mean  # type: ignore[arg-type]

    expected = mean(reference())
    once = GeneratedImages(sample(), COUNT)
    assert torch.equal(mean(once), expected)
    with pytest.raises(InvalidValueError, match="generator object, which yields its batches once"):
        mean(once)
    in_a_list = GeneratedImages(sample_batches(COUNT), COUNT)  # a list is read again
    assert torch.equal(mean(in_a_list), expected) and torch.equal(mean(in_a_list), expected)


def sample_batches(count: int) -> list[torch.Tensor]:
    return list(reference().split(3))[: -(-count // 3)]


def bad_batch(kind: str) -> object:
    """Batch 2 of a sampler gone wrong, as ``kind`` says."""
    good = reference()[:3]
    return {
        "3-D": good[0],
        "int32": good.int(),
        "(-1, 1) floats": good.float() / 127.5 - 1,
        "NaN": torch.full((3, *SIZE), float("nan")),
        "another size": good[..., :10],
        "(images, labels)": (good, torch.arange(3)),
        "empty": good[:0],
        "a string": "images",
    }[kind]


BAD = {
    "3-D": (InvalidValueError, r"has shape \(3, 20, 22\), not \(N, C, H, W\)"),
    "int32": (InvalidTypeError, "is torch.int32: pass uint8 pixels"),
    "(-1, 1) floats": (InvalidValueError, r"spans \[-1, 1\], not input_range=\(0.0, 1.0\)"),
    "NaN": (InvalidValueError, "holds NaN or infinite values"),
    "another size": (InvalidValueError, r"holds images of shape \(3, 20, 10\), the first batch \(3, 20, 22\)"),
    "(images, labels)": (InvalidTypeError, r"is a tuple, not an \(N, C, H, W\) tensor or numpy array \(yield the"),
    "empty": (InvalidValueError, "holds no images"),
    "a string": (InvalidTypeError, "is a str"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_batch_that_is_not_images_is_refused_naming_it(kind: str) -> None:
    def gone_wrong() -> Iterator[object]:
        batches = sample()
        yield next(batches)
        yield next(batches)
        yield bad_batch(kind)

    error, message = BAD[kind]
    with pytest.raises(error, match=r"^batch 2 of the generator \(rows from 6\) " + message):
        feature_statistics(tiny_extractor(["conv2"]), GeneratedImages(gone_wrong, COUNT), **OPTIONS)


def test_channels_last_and_too_few_images_are_named() -> None:
    channels_last = GeneratedImages(lambda: (batch.permute(0, 2, 3, 1) for batch in sample()), COUNT)
    with pytest.raises(InvalidValueError, match=r"^batch 0 of the generator .* channels last\? pass \(N, C, H, W\)"):
        feature_statistics(tiny_extractor(["conv2"]), channels_last, **OPTIONS)
    few = GeneratedImages(lambda: iter(sample_batches(6)), COUNT)
    with pytest.raises(InvalidValueError, match="the generator stopped after row 6 but num_images=10"):
        feature_statistics(tiny_extractor(["conv2"]), few, **OPTIONS)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((sample, 0), InvalidValueError, "num_images must be a positive int, got 0"),
        ((sample, True), InvalidValueError, "num_images must be a positive int"),
        ((3, 10), InvalidTypeError, "batches must be a callable returning batches of images, or an iterable"),
        (([], 10, True), InvalidTypeError, r"seekable=True needs a callable taking the row to start from"),
    ],
)
def test_a_source_that_cannot_be_is_refused(args: tuple[object, ...], error: type, message: str) -> None:
    batches, count, *seekable = args
    with pytest.raises(error, match=message):
        GeneratedImages(batches, count, seekable=bool(seekable and seekable[0]))  # type: ignore[arg-type]


_RANK = textwrap.dedent(
    """
    import json, sys
    from functools import partial
    from featurehooks import dump_features
    from featurehooks._stream.generated import GeneratedImages
    from helpers import tiny_extractor
    from test_generated_source import COUNT, OPTIONS, sample

    starts = []
    source = GeneratedImages(partial(sample, starts=starts), COUNT, seekable=True)
    dump_features(tiny_extractor(), source, sys.argv[1], **OPTIONS)
    print(json.dumps(starts))
    """
)


@pytest.mark.slow  # two Python processes
def test_torchrun_ranks_each_draw_their_own_rows(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    ranks = each_rank([sys.executable, str(script), str(tmp_path / "two")], {"PYTHONPATH": path})
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    starts = [json.loads(rank.stdout.strip().splitlines()[-1]) for rank in ranks]
    assert starts == [[0], [8]]  # batches (0:4, 4:8) on rank 0 from its first batch; (8:10) on rank 1 from row 8
    whole = dump_features(tiny_extractor(), GeneratedImages(sample, COUNT), tmp_path / "one", **OPTIONS)
    assert dump_files(tmp_path / "two") == dump_files(whole.out_dir)
