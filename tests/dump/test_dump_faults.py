"""Faults during dumps: corrupt files and odd image modes, kill -9 / Ctrl-C then resume, half-written outputs."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from featurehooks import FeatureExtractor
from featurehooks.dump import dump_features, read_manifest
from featurehooks.images import decode_image, read_image, transform_for

from dump_helpers import mark_unfinished, scribble
from helpers import tiny_extractor

CROP = 32
ROWS = 32
BATCH = 4


def dump(ext: FeatureExtractor, source: object, out: Path, **kwargs: object):
    options = {"batch_size": BATCH, "num_workers": 0, "progress": False, "resize_size": CROP, "crop_size": CROP}
    options.update(kwargs)
    return dump_features(ext, source, out, **options)


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_odd_and_corrupt(folder: Path) -> tuple[list[str], list[str]]:
    """Images in every awkward mode (all readable) and broken files; returns (readable, corrupt) names."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
    readable = {
        "a_rgb.png": rgb,
        "b_gray.png": rgb.convert("L"),
        "c_gray_alpha.png": rgb.convert("LA"),
        "d_rgba.png": rgb.convert("RGBA"),
        "e_palette.png": rgb.convert("P"),
        "f_bilevel.png": rgb.convert("1"),
        "g_gray16.png": Image.fromarray((rng.integers(0, 65536, (40, 40))).astype(np.uint16)),
        "h_cmyk.jpg": rgb.convert("CMYK"),
        "i_cmyk.tif": rgb.convert("CMYK"),
        "j_float.tif": Image.fromarray(rng.random((40, 40), dtype=np.float32)),
    }
    for name, image in readable.items():
        image.save(folder / name)
    full = png_bytes(rgb)
    corrupt = {
        "k_truncated.png": full[: len(full) // 2],
        "l_garbage.jpg": rng.integers(0, 256, 500, dtype=np.uint8).tobytes(),
        "m_empty.png": b"",
        "n_text.png": b"this is not an image\n",
    }
    for name, data in corrupt.items():
        (folder / name).write_bytes(data)
    return sorted(readable), sorted(corrupt)


@pytest.mark.parametrize("under", [False, True])
def test_an_output_folder_that_is_a_file_is_refused_in_one_line(tmp_path: Path, under: bool) -> None:
    """``out_dir`` naming a file (or a path under one) is refused before any work, not as ``[Errno 17]``."""
    existing = tmp_path / "features.npy"
    existing.write_bytes(b"not a folder")
    out = existing / "sub" if under else existing
    with pytest.raises(ValueError, match="is a file, not a dump folder") as info:
        dump(tiny_extractor(), torch.rand(2, 3, CROP, CROP), out)
    assert "Errno" not in str(info.value) and existing.read_bytes() == b"not a folder"


def test_odd_modes_decode_to_rgb_in_unit_range(tmp_path: Path) -> None:
    Image.new("L", (4, 4), 51).save(tmp_path / "gray.png")
    Image.fromarray(np.full((4, 4), 32768, dtype=np.uint16)).save(tmp_path / "gray16.png")
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(tmp_path / "clear.png")
    Image.new("CMYK", (4, 4), (0, 0, 0, 0)).save(tmp_path / "cmyk.tif")
    gray = decode_image(tmp_path / "gray.png")
    assert gray.shape == (3, 4, 4) and gray.dtype == torch.float32
    assert torch.allclose(gray, torch.full_like(gray, 51 / 255))
    assert torch.allclose(decode_image(tmp_path / "gray16.png"), torch.full((3, 4, 4), 32768 / 65535))
    assert torch.equal(decode_image(tmp_path / "clear.png"), torch.ones(3, 4, 4))  # transparent -> white
    assert torch.equal(decode_image(tmp_path / "cmyk.tif"), torch.ones(3, 4, 4))


def test_corrupt_files_are_listed_and_zero_filled_never_fatal(tmp_path: Path) -> None:
    readable, corrupt = write_odd_and_corrupt(tmp_path / "imgs")
    ext = tiny_extractor()
    result = dump(ext, tmp_path / "imgs", tmp_path / "out", num_workers=2)
    names = [line.split(",", 2) for line in (tmp_path / "out" / "index.csv").read_text().splitlines()[1:]]
    valid = {Path(path).name: flag == "1" for _, flag, path in names}
    assert valid == {**dict.fromkeys(readable, True), **dict.fromkeys(corrupt, False)}
    skipped = {Path(item["path"]).name: item for item in result.skipped}
    assert sorted(skipped) == corrupt
    assert all(item["reason"] for item in skipped.values())
    assert "truncated" in skipped["k_truncated.png"]["reason"] or "OSError" in skipped["k_truncated.png"]["reason"]
    assert result.manifest.num_valid == len(readable)
    transform = transform_for(ext.preprocessing, ext.input_range, CROP, CROP)
    layer = result.load("conv2")
    for row, (_, flag, path) in enumerate(names):
        if flag == "0":
            assert not layer[row].any()
        else:
            with torch.no_grad():
                direct = ext(transform(read_image(path))[None])["conv2"][0].numpy()
            np.testing.assert_allclose(layer[row], direct, rtol=1e-5, atol=1e-6)


def test_a_dataset_item_that_raises_becomes_an_invalid_row(tmp_path: Path) -> None:
    class Flaky(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, index: int) -> torch.Tensor:
            if index == 3:
                raise OSError("disk hiccup")
            return torch.full((3, CROP, CROP), index / 10)

    result = dump(tiny_extractor(), Flaky(), tmp_path / "out")
    assert result.skipped == [{"row": 3, "path": "dataset[3]", "reason": "OSError: disk hiccup"}]


SCRIPT = """
import signal, sys, time, torch
# Ctrl-C raises KeyboardInterrupt even in a process started with SIGINT ignored (a shell's background job, some CI)
signal.signal(signal.SIGINT, signal.default_int_handler)
from collections import OrderedDict
from torch import nn
from featurehooks import FeatureExtractor
from featurehooks.dump import dump_features

class Noise(torch.utils.data.Dataset):
    def __len__(self):
        return {rows}
    def __getitem__(self, index):
        time.sleep({delay} if index < {stall_from} else 20)  # waits there for the signal, however late it comes
        return torch.rand(3, {crop}, {crop}, generator=torch.Generator().manual_seed(index))

torch.manual_seed(0)
net = nn.Sequential(OrderedDict(conv1=nn.Conv2d(3, 8, 3, stride=2), relu1=nn.ReLU(), conv2=nn.Conv2d(8, 16, 3)))
ext = FeatureExtractor(net, ["relu1", "conv2"], mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
dump_features(ext, Noise(), sys.argv[1], batch_size={batch}, num_workers=0, progress=False)
"""


class Noise(torch.utils.data.Dataset):
    """Same items as the script's dataset, without the delay."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(3, CROP, CROP, generator=torch.Generator().manual_seed(index))


def committed_lines(out: Path) -> int:
    journal = out / ".journal" / "rank-0.jsonl"
    return journal.read_text().count("\n") if journal.exists() else 0


def interrupt(tmp_path: Path, out: Path, sig: int) -> subprocess.CompletedProcess:
    script = tmp_path / "slow_dump.py"
    # rows from the fourth chunk on stall until the signal comes: on a busy machine (parallel test workers) the
    # parent may poll the journal late
    stall_from = 3 * BATCH
    script.write_text(
        textwrap.dedent(SCRIPT.format(rows=ROWS, delay=0.05, stall_from=stall_from, crop=CROP, batch=BATCH))
    )
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while committed_lines(out) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the dump ended before it could be interrupted: {proc.communicate()[1][-2000:]}")
        time.sleep(0.02)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    dump_features(tiny_extractor(), Noise(), out, batch_size=BATCH, num_workers=0, progress=False)
    return out


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_interrupted_dump_resumes_to_identical_bytes(tmp_path: Path, reference: Path, sig: int) -> None:
    out = tmp_path / "out"
    done = interrupt(tmp_path, out, sig)
    assert done.returncode != 0
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in done.stderr
    manifest = read_manifest(out)
    assert manifest is not None and manifest.status == "running"  # never taken for complete
    committed = committed_lines(out)
    assert 2 <= committed < ROWS // BATCH
    with pytest.raises(FileExistsError, match="unfinished.*resume"):
        dump_features(tiny_extractor(), Noise(), out, batch_size=BATCH, num_workers=0, progress=False)
    result = dump_features(tiny_extractor(), Noise(), out, batch_size=BATCH, num_workers=0, progress=False, resume=True)
    assert result.manifest.status == "complete"
    same_files(out, reference)


def test_resume_recomputes_only_uncommitted_chunks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    ext = tiny_extractor()
    items = torch.rand(10, 3, CROP, CROP, generator=torch.Generator().manual_seed(1))
    dump(ext, items, tmp_path / "ref")
    # an unfinished dump: chunks 0 and 2 committed, a torn line after them, the rest never written
    dump(ext, items, out)
    store = mark_unfinished(out, [(chunk, chunk * BATCH, (chunk + 1) * BATCH) for chunk in (0, 2)])
    scribble(store, BATCH, 2 * BATCH, 7.0)  # chunk 1: garbage that resume must overwrite
    store.close_arrays()
    with open(out / ".journal" / "rank-0.jsonl", "a") as journal:
        journal.write('{"chunk": 1, "rows": [4')  # what a kill mid-write leaves
    assert sorted(store.committed()) == [0, 2]
    dump(ext, items, out, resume=True)
    same_files(out, tmp_path / "ref")


def test_arrays_cut_short_by_a_kill_are_recreated_on_resume(tmp_path: Path) -> None:
    ext = tiny_extractor()
    items = torch.rand(6, 3, CROP, CROP, generator=torch.Generator().manual_seed(2))
    dump(ext, items, tmp_path / "ref")
    out = tmp_path / "out"
    dump(ext, items, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["status"] = "running"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with open(out / "conv2.npy", "r+b") as handle:
        handle.truncate(100)  # killed while preallocating
    with pytest.raises(FileExistsError):
        dump(ext, items, out)
    dump(ext, items, out, resume=True)
    same_files(out, tmp_path / "ref")


def test_unreadable_manifest_needs_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{ half a manif")
    items = torch.rand(2, 3, CROP, CROP)
    with pytest.raises(ValueError, match="overwrite"):
        dump(tiny_extractor(), items, out, resume=True)
    assert dump(tiny_extractor(), items, out, overwrite=True).manifest.status == "complete"
    assert not any(name.startswith(".manifest") for name in os.listdir(out))  # no temporary files left
