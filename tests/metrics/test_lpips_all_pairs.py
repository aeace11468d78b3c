"""LPIPS over the pairs of one folder: the diversity number of ``lpips_1dir_allpairs.py``, per pair the lpips
package's distance on its own scaling of the pixels (``im2tensor``; its ``load_image`` reads PNGs with OpenCV, which
is not installed here: the same RGB pixels as Pillow's)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks.cli import main
from featurehooks.errors import InvalidValueError
from featurehooks.metrics import LPIPS, pairs_within, score_pairs

from helpers import SEED

lpips = pytest.importorskip("lpips")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Twelve 32x32 PNGs: 66 pairs."""
    root = tmp_path_factory.mktemp("diversity")
    rng = np.random.default_rng(SEED)
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / f"{i:02d}.png")
    return root


def test_every_pair_scores_as_the_lpips_script_does(lpips_trunks: None, folder: Path) -> None:
    pairs = pairs_within(folder)
    files = sorted(folder.glob("*.png"))
    assert [(pair.a, pair.b) for pair in pairs] == [(str(a), str(b)) for a, b in itertools.combinations(files, 2)]
    reference = lpips.LPIPS(net="alex", verbose=False)
    with torch.no_grad():
        expected = [
            reference(*(lpips.im2tensor(np.asarray(Image.open(path).convert("RGB"))) for path in (a, b))).item()
            for a, b in itertools.combinations(files, 2)
        ]
    scores = score_pairs(LPIPS("alex", reduction="none"), pairs, num_workers=0, batch_size=16)
    assert len(scores) == 66
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-7)


def test_consecutive_pairs_and_too_few_images(folder: Path, tmp_path: Path) -> None:
    consecutive = pairs_within(folder, consecutive=True)
    assert [pair.name for pair in consecutive[:2]] == ["(00.png,01.png)", "(01.png,02.png)"] and len(consecutive) == 11
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp_path / "alone.png")
    with pytest.raises(InvalidValueError, match="holds 1 readable image"):
        pairs_within(tmp_path)


def test_the_command_scores_a_folder_alone(
    lpips_trunks: None, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pairs.csv"
    argv = ["lpips", str(folder), "--all-pairs", "--workers", "0", "--device", "cpu", "-q", "--out", str(out)]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(" over 66 pairs")
    rows = out.read_text().splitlines()
    assert rows[0] == "name,score" and rows[1].startswith('"(00.png,01.png)",') and len(rows) == 67
    assert main(["lpips", str(folder), str(folder), "--all-pairs"]) == 2
    assert "scores the images of DIR_A alone" in capsys.readouterr().err
