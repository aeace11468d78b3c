"""``featurehooks eval``: the numbers ``evaluate`` finds on the same sets, one line each or one JSON object, and
bad input in one line."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from featurehooks.cli import main
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import METRICS, PRDC, Evaluation, evaluate, fd_bootstrap, fd_infinity

pytestmark = pytest.mark.filterwarnings("ignore:.*feature vectors in .* dimensions:UserWarning")
pytest.importorskip("transformers")
from clip_reference import cached_clip  # noqa: E402

SMALL = {"kid_subset_size": 3, "prdc_k": 2, "is_splits": 2}  # four images a set
# every metric but fid, whose 2048-d Fréchet distance costs seconds of CPU (two 2048x2048 eigendecompositions):
# fd_dinov2 is printed as fid is, and the slow test reads fid
FAST = ("fd_dinov2", "cmmd", "is", "kid", "prdc")
FLAGS = ["--dinov2-model", "vits14", "--kid-subset-size", "3", "--prdc-k", "2", "--is-splits", "2"]
RUN = ["--workers", "0", "--batch-size", "2", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def sets(
    png_folder: Callable[..., Path],
    fid_weights: Path,
    dinov2_vits14_cached: object,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Path]]:
    """Two folders of four random PNGs, with seeded FID Inception, DINOv2 ViT-S/14 and tiny CLIP weights where the
    command's defaults find them."""
    with cached_clip(tmp_path_factory.mktemp("hub")):
        yield png_folder(4, (40, 44), seed=1), png_folder(4, (40, 44), seed=2)


@pytest.fixture(scope="module")
def expected(sets: tuple[Path, Path]) -> Evaluation:
    """``evaluate`` of the metrics but fid on the two sets, as the command is asked for them."""
    return _evaluate(sets, FAST)


def _evaluate(sets: tuple[Path, Path], metrics: tuple[str, ...]) -> Evaluation:
    return evaluate(*sets, metrics, dinov2_model="vits14", device="cpu", num_workers=0, batch_size=2, **SMALL)


def _lines(out: str) -> dict[str, str]:
    found = dict(line.split(": ", 1) for line in out.splitlines())
    assert list(found) == [line.split(": ", 1)[0] for line in out.splitlines()], out  # each metric once
    return found


def _mean_std(text: str) -> tuple[float, float]:
    mean, std = text.split(" ± ")
    return float(mean), float(std)


def _prdc(text: str) -> PRDC:
    fields, k = text.rsplit(" (k=", 1)
    assert k == "2)"
    values = dict(field.split(" ") for field in fields.split(", "))
    return PRDC(**{name: float(value) for name, value in values.items()})


def _check_lines(out: str, expected: Evaluation) -> None:
    """The lines of ``out`` hold ``expected``'s numbers, one metric each, in its order."""
    lines = _lines(out)
    numbers = expected.numbers
    assert list(lines) == list(numbers)
    for name in {"fid", "fd_dinov2", "cmmd", "sfid"} & set(lines):
        assert float(lines[name]) == pytest.approx(numbers[name], rel=5e-6)  # printed to 6 digits
    for name in {"is", "kid"} & set(lines):
        mean, std = _mean_std(lines[name])
        assert mean == pytest.approx(numbers[name][0], rel=5e-6, abs=1e-12)
        assert std == pytest.approx(numbers[name][1], rel=5e-3, abs=1e-12)  # 3 digits
    assert tuple(_prdc(lines["prdc"])) == pytest.approx(tuple(numbers["prdc"]), abs=5e-5)  # 4 decimals


@pytest.mark.slow  # a reference oracle with networks of its own
def test_prints_evaluates_numbers_one_line_each(
    sets: tuple[Path, Path], expected: Evaluation, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["eval", *map(str, sets), "--metrics", ",".join(FAST), *FLAGS, *RUN]) == 0
    _check_lines(capsys.readouterr().out, expected)


@pytest.mark.slow
def test_prints_every_metric_by_default(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["eval", *map(str, sets), *FLAGS, *RUN]) == 0
    _check_lines(capsys.readouterr().out, _evaluate(sets, METRICS))


@pytest.mark.slow  # a reference oracle with networks of its own
def test_json_holds_the_same_numbers_and_the_counts(
    sets: tuple[Path, Path], expected: Evaluation, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every metric but fid (a 2048-d Fréchet distance costs seconds; the test above reads it), in another order."""
    capsys.readouterr()
    asked = ["prdc", "kid", "cmmd", "is", "fd_dinov2"]
    assert main(["eval", *map(str, sets), "--metrics", ",".join(asked), "--json", *FLAGS, *RUN]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1
    found = json.loads(out)
    assert list(found) == [*asked, "images"]  # the order asked
    numbers = expected.numbers
    for name in ("cmmd", "fd_dinov2"):
        assert type(found[name]) is float and found[name] == numbers[name]  # the same pass, the same arithmetic
    for name in ("is", "kid"):
        assert found[name] == dict(zip(("mean", "std"), numbers[name]))
    assert found["prdc"] == numbers["prdc"]._asdict()
    assert found["images"] == {"real": 4, "fake": 4}


@pytest.mark.slow  # a reference oracle with networks of its own
def test_bootstrap_and_infinity_qualify_each_frechet_distance(
    sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    options = ["--bootstrap", "3", "--infinity", "--infinity-smallest", "2", "--json"]
    assert main(["eval", *map(str, sets), "--metrics", "fd_dinov2,kid", *options, *FLAGS, *RUN]) == 0
    found = json.loads(capsys.readouterr().out)
    assert list(found) == ["fd_dinov2", "fd_dinov2_bootstrap", "fd_dinov2_infinity", "kid", "images"]
    expected = evaluate(
        *sets, ["fd_dinov2"], dinov2_model="vits14", device="cpu", keep_vectors=True, num_workers=0, batch_size=2
    )
    real, fake = expected.statistics_of("fd_dinov2")
    assert fake.features.shape[0] == 4  # every vector kept
    assert found["fd_dinov2_bootstrap"] == list(fd_bootstrap(real, fake, rounds=3))
    assert found["fd_dinov2_infinity"] == fd_infinity(real, fake, smallest=2).value
    with pytest.raises(InvalidValueError, match="holds no statistics of 'fid'"):
        expected.statistics_of("fid")


@pytest.mark.slow  # a reference oracle with networks of its own
def test_saved_statistics_stand_in_for_real(
    sets: tuple[Path, Path], expected: Evaluation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real, fake = map(str, sets)
    reference = tmp_path / "real.npz"
    metrics = ["--metrics", "fd_dinov2,kid,prdc"]
    assert main(["eval", "--save-stats", real, str(reference), *metrics, *FLAGS, *RUN]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {reference}: the statistics of REAL for fd_dinov2, kid, prdc")
    assert main(["eval", str(reference), fake, *metrics, "--json", *FLAGS, *RUN]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["fd_dinov2"] == expected.numbers["fd_dinov2"]
    assert found["kid"] == dict(zip(("mean", "std"), expected.numbers["kid"]))
    assert found["prdc"] == expected.numbers["prdc"]._asdict()
    assert main(["eval", str(reference), fake, "--metrics", "cmmd", *FLAGS, *RUN]) == 2  # not in the file
    assert "real holds no statistics of clip" in capsys.readouterr().err
    single = tmp_path / "fid.npz"
    assert main(["fid", "--save-stats", real, str(single), "--dims", "64", *RUN]) == 0
    capsys.readouterr()
    assert main(["eval", str(single), fake, *metrics, *FLAGS, *RUN]) == 2
    assert "holds the statistics of one layer" in capsys.readouterr().err


def test_prints_the_metrics_asked_in_their_order(
    sets: tuple[Path, Path], expected: Evaluation, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["eval", *map(str, sets), "--metrics", "fd_dinov2,cmmd,fd_dinov2", *FLAGS, *RUN]) == 0
    lines = _lines(capsys.readouterr().out)
    assert list(lines) == ["fd_dinov2", "cmmd"]
    assert float(lines["fd_dinov2"]) == pytest.approx(expected.numbers["fd_dinov2"], rel=5e-6)


def test_random_weights_are_said_once(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    argv = ["eval", *map(str, sets), "--metrics", "fd_dinov2", "--dinov2-weights", "none", *FLAGS, *RUN]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("fd_dinov2: ") and len(captured.out.splitlines()) == 1
    warned = [line for line in captured.err.splitlines() if "random init" in line]
    assert warned == [
        "featurehooks: warning: --dinov2-weights none is a random init, not DINOv2: its numbers are no benchmark's"
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--metrics", "fid,fidd"], "--metrics: unknown metric 'fidd'; did you mean 'fid'"),
        (["--metrics", ""], "--metrics: unknown metric ''"),
        (["--fid-mode", "clen"], "--fid-mode: unknown name 'clen'; did you mean 'clean'"),
        (["--dinov2-model", "vitl16"], "--dinov2-model: unknown name 'vitl16'; did you mean 'vitl14'"),
        (["--kid-subset-size", "5"], "kid: a set has 4 images, fewer than --kid-subset-size 5"),
        (["--prdc-k", "4"], "prdc: a set has 4 images, and --prdc-k 4 needs at least 5"),
        (["--is-splits", "5"], "is: FAKE has 4 images, fewer than --is-splits 5"),
        (["--metrics", "fid", "--inception-weights", "no/such.pth"], "--inception-weights: weights file not found"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    sets: tuple[Path, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["eval", *map(str, sets), *FLAGS, *extra, *RUN]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: "), captured.err
    assert message in lines[0], lines[0]
    assert captured.out == ""


def test_a_missing_folder_is_the_usual_one_line(
    sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    missing = tmp_path / "nowhere"
    assert main(["eval", str(sets[0]), str(missing), *RUN]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featurehooks: error: ") and str(missing) in lines[0], lines


def test_missing_weights_name_the_flag(
    sets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library's hint (``weights=None``) as this command's flag."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache: no DINOv2 ViT-B/14 anywhere
    capsys.readouterr()
    argv = ["eval", *map(str, sets), "--metrics", "fd_dinov2", "--dinov2-model", "vitb14", *RUN]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "dinov2_vitb14" in lines[0], lines
    assert "--dinov2-weights none for random init" in lines[0] and "weights=" not in lines[0], lines
