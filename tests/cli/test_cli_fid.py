"""``featurehooks fid``: the number ``python -m pytorch_fid`` prints, statistics files both ways, one-line errors."""

from __future__ import annotations

import tracemalloc
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.cli import main
from featurehooks.metrics import (
    FeatureOrigin,
    FeatureStatistics,
    fd_bootstrap,
    fd_infinity,
    fid_statistics,
    load_mu_sigma,
)

pytest.importorskip("pytorch_fid")
from pytorch_fid.fid_score import calculate_fid_given_paths, get_activations  # noqa: E402
from pytorch_fid.inception import InceptionV3  # noqa: E402

RUN = ["--workers", "0", "--device", "cpu", "-q"]
FAST = ["--dims", "64"]  # pytorch-fid's first block: the whole command, with a 64-d covariance


def _folder(root: Path, name: str, shift: int, size: tuple[int, int]) -> Path:
    folder = root / name
    folder.mkdir()
    rng = np.random.default_rng(shift)
    for i in range(3):
        pixels = np.clip(rng.integers(0, 200, (*size, 3)) + shift, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory, fid_weights: Path) -> tuple[Path, Path]:
    """Three PNGs a set, of another size in each set (pytorch-fid stacks a batch: one size per folder)."""
    root = tmp_path_factory.mktemp("fid_sets")
    return _folder(root, "a", 0, (33, 47)), _folder(root, "b", 40, (50, 38))


def _printed(out: str) -> float:
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FID:  "), out
    return float(lines[0][len("FID:  ") :])


def _pytorch_fid(sets: tuple[Path, Path], dims: int) -> float:
    """What ``python -m pytorch_fid A B --dims dims --device cpu`` prints."""
    return float(
        calculate_fid_given_paths([str(s) for s in sets], batch_size=50, device="cpu", dims=dims, num_workers=0)
    )


def _pytorch_fid_exact_root(sets: tuple[Path, Path], dims: int) -> float:
    """pytorch-fid's number from its own activations, with tr sqrtm(S_a S_b) taken exactly: S_a = A^T A for the
    three centred rows of A, so the nonzero eigenvalues of S_a S_b are those of the 3x3 A S_b A^T. scipy's sqrtm
    of a 2048x2048 product takes 25 s of CPU; the 64-d tests above hold the rest of pytorch-fid's arithmetic."""
    model = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[dims]])
    a, b = (get_activations(sorted(s.glob("*.png")), model, 50, dims, "cpu", 0).astype(np.float64) for s in sets)
    rows = (a - a.mean(0)) / np.sqrt(len(a) - 1)
    cov_b = np.cov(b, rowvar=False)
    cross = np.sqrt(np.linalg.eigvalsh(rows @ cov_b @ rows.T).clip(min=0)).sum()
    diff = a.mean(0) - b.mean(0)
    return float(diff @ diff + (rows * rows).sum() + np.trace(cov_b) - 2 * cross)


@pytest.fixture(scope="module")
def reference(sets: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """A's statistics saved with --save-stats, and pytorch-fid's number for the two folders, with --dims 64: the
    same code path as 2048 (another layer), where a Fréchet distance costs milliseconds, not 16 s of CPU."""
    path = tmp_path_factory.mktemp("fid_stats") / "a.npz"
    assert main(["fid", "--save-stats", str(sets[0]), str(path), *FAST, *RUN]) == 0
    return path, _pytorch_fid(sets, 64)


@pytest.mark.slow
def test_prints_pytorch_fids_number(
    sets: tuple[Path, Path], reference: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["fid", str(sets[0]), str(sets[1]), *FAST, *RUN]) == 0
    captured = capsys.readouterr()
    assert _printed(captured.out) == pytest.approx(reference[1], rel=1e-6)
    assert _pytorch_fid_exact_root(sets, 64) == pytest.approx(reference[1], rel=1e-6)  # the 2048 test's oracle
    assert "A (" in captured.err and "fewer than 65" in captured.err  # three images a set: a singular covariance


@pytest.mark.slow
def test_prints_pytorch_fids_fid(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The 2048 features of FID."""
    assert main(["fid", str(sets[0]), str(sets[1]), *RUN]) == 0
    captured = capsys.readouterr()
    assert _printed(captured.out) == pytest.approx(_pytorch_fid_exact_root(sets, 2048), rel=1e-6)
    assert "fewer than 2049" in captured.err and "B (" in captured.err


def test_saved_statistics_stand_in_for_the_folder(
    sets: tuple[Path, Path], reference: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    path, theirs = reference
    stats = FeatureStatistics.load(path)
    assert stats.count == 3 and stats.origin is not None and stats.origin.backbone == "fid_inception"
    with np.load(path) as arrays:  # what pytorch-fid reads from it
        assert arrays["mu"].shape == (64,) and arrays["sigma"].shape == (64, 64)
    capsys.readouterr()
    assert main(["fid", str(path), str(sets[1]), *FAST, *RUN]) == 0
    assert _printed(capsys.readouterr().out) == pytest.approx(theirs, rel=1e-6)
    bare = path.with_name("bare.npz")  # pytorch-fid's own --save-stats file: mu and sigma only
    mu, sigma = load_mu_sigma(path)
    np.savez_compressed(bare, mu=mu.numpy(), sigma=sigma.numpy())
    assert main(["fid", str(bare), str(path), *FAST, *RUN]) == 0
    assert _printed(capsys.readouterr().out) == pytest.approx(0.0, abs=1e-6 * theirs)


def test_bootstrap_and_infinity_follow_pytorch_fids_number(
    sets: tuple[Path, Path], reference: tuple[Path, float], capsys: pytest.CaptureFixture[str]
) -> None:
    """A mu/sigma file serves as A; B's images are resampled, as ``fd_bootstrap``/``fd_infinity`` do."""
    path, theirs = reference
    bare = path.with_name("bare_a.npz")
    mu, sigma = load_mu_sigma(path)
    np.savez_compressed(bare, mu=mu.numpy(), sigma=sigma.numpy())
    capsys.readouterr()
    options = ["--bootstrap", "3", "--infinity", "--infinity-smallest", "2"]
    assert main(["fid", str(bare), str(sets[1]), *options, *FAST, *RUN]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("FID:  ") and "(95% bootstrap, 3 rounds), FD∞ " in line
    assert float(line[len("FID:  ") :].split(" ")[0]) == pytest.approx(theirs, rel=1e-6)
    b = fid_statistics(sets[1], dims=64, device="cpu", keep=3, num_workers=0)
    low, high = fd_bootstrap((mu, sigma), b, rounds=3)
    interval = [float(value) for value in line.split("[")[1].split("]")[0].split(", ")]
    assert interval == pytest.approx([low, high], rel=1e-5)
    assert float(line.split("FD∞ ")[1]) == pytest.approx(fd_infinity((mu, sigma), b, smallest=2).value, rel=1e-5)
    assert main(["fid", str(sets[0]), str(bare), "--bootstrap", "3", *FAST, *RUN]) == 2  # B holds no vectors
    assert "resample B's images, and " in capsys.readouterr().err


def test_an_npz_of_samples_is_a_set_of_images(
    sets: tuple[Path, Path], reference: tuple[Path, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ADM's sample batches (``arr_0``, uint8 NHWC) are images; a file with ``mu`` too (its reference batches) is
    read as the statistics it holds."""
    pixels = np.stack([np.asarray(Image.open(path)) for path in sorted(sets[1].glob("*.png"))])
    samples = tmp_path / "samples.npz"
    np.savez(samples, arr_0=pixels)
    capsys.readouterr()
    assert main(["fid", str(sets[0]), str(samples), *FAST, *RUN]) == 0
    assert _printed(capsys.readouterr().out) == pytest.approx(reference[1], rel=1e-6)
    mu, sigma = load_mu_sigma(reference[0])
    batch = tmp_path / "reference_batch.npz"
    np.savez(batch, arr_0=pixels, mu=mu.numpy(), sigma=sigma.numpy())
    assert main(["fid", str(batch), str(sets[0]), *FAST, *RUN]) == 0
    assert _printed(capsys.readouterr().out) == pytest.approx(0.0, abs=1e-6 * reference[1])


def test_errors_are_one_line_exit_2(
    sets: tuple[Path, Path],
    reference: tuple[Path, float],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = reference  # statistics of --dims 64
    other = tmp_path / "resnet.npz"
    FeatureStatistics(origin=None).update(torch.zeros(3, 512)).save(other)
    bare = tmp_path / "bare192.npz"
    np.savez(bare, mu=np.zeros(192), sigma=np.eye(192))
    resnet = tmp_path / "resnet64.npz"
    FeatureStatistics(origin=FeatureOrigin("resnet18", "layer1", "avg", "DEFAULT")).update(torch.zeros(3, 64)).save(
        resnet
    )
    cases = [
        (["fid", str(tmp_path / "missing"), str(sets[1])], "no such file or folder"),
        (["fid", "--save-stats", str(path), str(tmp_path / "x.npz")], "is a statistics file"),
        (["fid", str(path), str(other), *FAST], "512 features, not --dims 64"),
        (["fid", str(path), str(bare), *FAST], "192 features, not --dims 64: pass --dims 192"),
        (["fid", str(path), str(sets[1]), *FAST, "--weights", "none"], "weights pt_inception-2015-12-05-6726825d"),
        (["fid", str(path), str(sets[1]), "--dims", "192"], "64 features of fid_inception maxpool1, not --dims 192"),
        (["fid", str(resnet), str(sets[1]), *FAST], "not FID's (fid_inception maxpool1"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main([*argv, *RUN]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("featurehooks: error: ") and message in err, (argv, err)


def test_statistics_files_are_recognized_in_any_case(
    reference: tuple[Path, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``A.NPZ`` was taken for an image path."""
    path, _ = reference
    upper = tmp_path / "A.NPZ"
    upper.write_bytes(path.read_bytes())
    capsys.readouterr()
    assert main(["fid", str(upper), str(path), *FAST, *RUN]) == 0
    # read as statistics: the FID of a set with itself, up to rounding (the eigenvalues may come out 1e-18 off)
    assert _printed(capsys.readouterr().out) == pytest.approx(0.0, abs=1e-9)


def test_a_file_of_other_dims_is_refused_before_it_is_unpacked(
    reference: tuple[Path, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mu/sigma file was unpacked whole before its dimension was compared with --dims (0.6 MB cost 560 MB)."""
    path, _ = reference
    big = tmp_path / "big.npz"
    np.savez_compressed(big, mu=np.zeros(2048), sigma=np.eye(2048))  # 32 MiB in a file of ~40 KB
    tracemalloc.start()
    try:
        assert main(["fid", str(big), str(path), *FAST, *RUN]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak:,} bytes allocated"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2048 features, not --dims 64: pass --dims 2048" in err and str(big) in err


def test_missing_weights_say_where_to_put_them(
    sets: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def offline(url: str, dst: str, *args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    assert main(["fid", str(sets[0]), str(sets[1]), *FAST, *RUN]) == 2
    err = capsys.readouterr().err
    assert "pt_inception-2015-12-05-6726825d.pth" in err and str(tmp_path / "hub" / "checkpoints") in err
    assert "--weights none" in err and "https://github.com/mseitzer/pytorch-fid/releases" in err


@pytest.mark.slow
def test_help_and_random_weights(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fid", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for word in (
        "--save-stats",
        "--dims",
        "--weights",
        "--num-workers",
        "pt_inception-2015-12-05-6726825d.pth",
        "2049",
    ):
        assert word in text, word
    assert main(["fid", str(sets[0]), str(sets[1]), "--weights", "none", *FAST, *RUN]) == 0
    captured = capsys.readouterr()
    assert _printed(captured.out) > 0 and "random init, not the FID network" in captured.err


def test_mode_picks_the_lineage_and_files_keep_it(
    sets: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--mode``: another number per lineage; a file of one lineage refused by another, naming the flag."""
    values = {}
    for mode in ("legacy_pytorch", "clean"):
        capsys.readouterr()
        assert main(["fid", str(sets[0]), str(sets[1]), "--mode", mode, *FAST, *RUN]) == 0
        values[mode] = _printed(capsys.readouterr().out)
    assert values["legacy_pytorch"] != values["clean"]
    saved = tmp_path / "clean.npz"
    assert main(["fid", "--save-stats", str(sets[0]), str(saved), "--mode", "clean", *FAST, *RUN]) == 0
    assert "mode clean" in capsys.readouterr().out
    assert main(["fid", str(saved), str(sets[1]), "--mode", "clean", *FAST, *RUN]) == 0
    assert _printed(capsys.readouterr().out) == pytest.approx(values["clean"], rel=1e-9)
    assert main(["fid", str(saved), str(sets[1]), *FAST, *RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mode clean" in err and "pass --mode clean" in err, err


def test_bad_mode_is_one_line_with_the_closest(sets: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["fid", str(sets[0]), str(sets[1]), "--mode", "cleen", *FAST, *RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("featurehooks: error: --mode: unknown FID mode 'cleen'"), err
    assert "did you mean 'clean'" in err
