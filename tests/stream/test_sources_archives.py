"""ZIP archives and WebDataset tar shards as sources: the same features as the same image files in a folder, bitwise;
row names that list the same rows again; hostile archives (bombs, traversal names, links and devices, truncated or
fake shards) answered with an invalid row or one clear error, nothing written outside the output."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from featurehooks import dump_features, images
from featurehooks._stream import list_images, sources
from featurehooks._stream.sources import expand_braces
from featurehooks.errors import InputNotFoundError, InvalidValueError

from helpers import tiny_extractor

OPTIONS = {"batch_size": 3, "num_workers": 0, "progress": False, "resize_size": 36, "crop_size": 32}
_FILE_SIZE = 24  # offset of "uncompressed size" in a ZIP central directory entry
_FLAGS = 8  # offset of the general purpose flags (bit 0: encrypted)


def encoded(image: np.ndarray, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format=fmt, quality=90)
    return buffer.getvalue()


def image(seed: int, size: tuple[int, int] = (40, 44)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def folder_of(files: dict[str, bytes], folder: Path) -> Path:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def write_zip(path: Path, members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", method) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def dumped(source: object, out: Path, **options: object) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """conv2 maps of a dump (unpooled: any pixel that differs shows) and its skipped rows as (row, reason)."""
    result = dump_features(tiny_extractor(), source, out, **{**OPTIONS, **options})
    arrays = result.load("conv2")
    return np.array(arrays), [(row.row, row.reason) for row in result.manifest.skipped]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_zip_members_are_the_folders_files_bitwise(tmp_path: Path, fmt: str) -> None:
    suffix = fmt.lower().replace("jpeg", "jpg")
    files = {f"imgs/{i}.{suffix}": encoded(image(i), fmt) for i in range(5)}
    reference, _ = dumped(folder_of(files, tmp_path / "folder"), tmp_path / "ref")
    write_zip(tmp_path / "x.zip", {"imgs/": b"", **files, "imgs/notes.txt": b"left out"})
    found, skipped = dumped(tmp_path / "x.zip", tmp_path / "out")
    assert skipped == []
    np.testing.assert_array_equal(found, reference)


def test_tar_shards_by_brace_pattern_are_the_folders_files_bitwise(tmp_path: Path) -> None:
    files = {f"{i:06d}.png": encoded(image(i)) for i in range(5)}
    reference, _ = dumped(folder_of(files, tmp_path / "folder"), tmp_path / "ref")
    (tmp_path / "shards").mkdir()
    for shard, keys in enumerate([range(3), range(3, 5)]):
        with tarfile.open(tmp_path / f"shards/{shard:03d}.tar", "w") as tar:
            for key in keys:  # WebDataset samples: the image, its class, its metadata
                add(tar, f"{key:06d}.cls", b"7")
                add(tar, f"{key:06d}.png", files[f"{key:06d}.png"])
                add(tar, f"{key:06d}.json", b"{}")
    found, skipped = dumped(f"{tmp_path}/shards/{{000..001}}.tar", tmp_path / "out")
    assert skipped == []
    np.testing.assert_array_equal(found, reference)


def test_sizes_that_vary_are_read_from_members_headers(tmp_path: Path) -> None:
    """Pooled without a crop, each row's size comes from its header (``Inputs.pixels``, for ``batch_pixels``)."""
    files = {f"{i}.png": encoded(image(i, (40, 44) if i % 2 else (30, 52))) for i in range(4)}
    options = {"pool": "avg", "crop_size": None, "resize_size": None, "batch_pixels": 3000}
    reference, _ = dumped(folder_of(files, tmp_path / "folder"), tmp_path / "ref", **options)
    found, skipped = dumped(write_zip(tmp_path / "x.zip", files), tmp_path / "out", **options)
    assert skipped == []
    np.testing.assert_array_equal(found, reference)


def test_rows_are_named_inside_their_archive_and_list_again(tmp_path: Path) -> None:
    png = encoded(image(0))
    write_zip(tmp_path / "x.zip", {"b/2.png": png, "a.PNG": png, "b/1.jpg": png, "b/": b"", "b/c.txt": b""})
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for name in ("x/002.jpg", "x/002.cls", "x/001.seg.png", "x/001.cls", "003.seg.png", "README", "000.png"):
            add(tar, name, png)
    zip_rows = list_images(tmp_path / "x.zip")
    assert zip_rows == [f"{tmp_path}/x.zip/{name}" for name in ("a.PNG", "b/1.jpg", "b/2.png")]  # sorted, images
    tar_rows = list_images(tmp_path / "s.tar")
    assert tar_rows == [f"{tmp_path}/s.tar/x/002", f"{tmp_path}/s.tar/000"]  # the shard's order; an image member each
    assert list_images(f"{tmp_path}/x.zip/b") == zip_rows[1:]  # a folder inside
    assert list_images([f"{tmp_path}/s.tar/000", f"{tmp_path}/x.zip/b/c.txt"]) == [
        f"{tmp_path}/s.tar/000",
        f"{tmp_path}/x.zip/b/c.txt",  # named, so kept whatever its suffix (an invalid row later), as a file is
    ]
    assert list_images(zip_rows + tar_rows) == zip_rows + tar_rows  # the CLI lists, then passes the names on
    with pytest.raises(InputNotFoundError, match="no member or folder 'c' in"):
        list_images(f"{tmp_path}/x.zip/c")
    with pytest.raises(InputNotFoundError, match="no sample or folder 'x/001' in"):
        list_images(f"{tmp_path}/s.tar/x/001")  # its only png is a "seg.png": not the sample's image


def test_braces_expand_as_webdataset_expands_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert expand_braces("s/{000..002}.tar") == ["s/000.tar", "s/001.tar", "s/002.tar"]
    assert expand_braces("{a,b}/{8..10}") == ["a/8", "a/9", "a/10", "b/8", "b/9", "b/10"]
    assert expand_braces("{3..1}{x}") == ["3{x}", "2{x}", "1{x}"]  # counts down; a group of neither form stays
    with pytest.raises(InvalidValueError, match="stands for more than 1000000 names"):
        expand_braces("{0..999999999}")  # refused before a name is made
    monkeypatch.setattr(sources, "_MAX_EXPANDED", 50)
    with pytest.raises(InvalidValueError, match="stands for more than 50 names"):
        expand_braces("{0..9}/{a,b,c,d,e,f}")  # each group alone is within the limit, not their product


def test_a_missing_shard_of_a_pattern_is_named(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "0.tar", "w") as tar:
        add(tar, "k.png", encoded(image(0)))
    with pytest.raises(InputNotFoundError, match="no such file or folder: .*1.tar"):
        list_images(f"{tmp_path}/{{0..1}}.tar")


def patched(path: Path, member: str, offset: int, value: int) -> None:
    """Overwrite a 4-byte field of ``member``'s central directory entry (what zipfile trusts)."""
    data = bytearray(path.read_bytes())
    entry = data.rindex(b"PK\x01\x02", 0, data.rindex(member.encode()))
    struct.pack_into("<L" if offset == _FILE_SIZE else "<H", data, entry + offset, value)
    path.write_bytes(bytes(data))


def files_under(root: Path) -> set[str]:
    return {str(path) for path in root.rglob("*")}


def test_hostile_zip_members_are_invalid_rows_or_only_names(tmp_path: Path) -> None:
    good = encoded(image(0))
    archive = tmp_path / "in" / "x.zip"
    archive.parent.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of the duplicate it is asked to write
        write_zip(archive, {"a.png": good, "../evil.png": good, "/abs.png": good, "bad.png": b"not an image"})
        with zipfile.ZipFile(archive, "a", zipfile.ZIP_DEFLATED) as more:
            more.writestr("dup.png", good)
            more.writestr("dup.png", good)
            more.writestr("enc.png", good)
            more.writestr("lie.png", bytes(1 << 20))  # 1 MiB of zeros, declared as 100 bytes below
    patched(archive, "enc.png", _FLAGS, 0x1)
    patched(archive, "lie.png", _FILE_SIZE, 100)
    before = files_under(tmp_path)
    rows = list_images(archive)
    assert [row[len(str(archive)) + 1 :] for row in rows] == [
        "../evil.png", "/abs.png", "a.png", "bad.png", "dup.png", "enc.png", "lie.png"
    ]  # fmt: skip
    assert list_images(rows) == rows
    found, skipped = dumped(archive, tmp_path / "out")
    reasons = dict(skipped)
    assert sorted(reasons) == [3, 4, 5, 6]  # the traversal and absolute names are read as names, and valid
    assert "cannot identify image file" in reasons[3] and f"{archive}/bad.png" in reasons[3]
    assert "'dup.png' appears 2 times" in reasons[4]
    assert "'enc.png'" in reasons[5] and "encrypted" in reasons[5]
    assert reasons[6].startswith("BadZipFile: Bad CRC-32")  # inflated up to its declared 100 bytes, no further
    np.testing.assert_array_equal(found[0], found[2])  # ../evil.png is a.png's pixels
    assert files_under(tmp_path) - before == files_under(tmp_path / "out") | {str(tmp_path / "out")}


def test_a_member_declaring_more_than_its_pixels_allow_is_never_inflated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_zip(tmp_path / "x.zip", {"a.png": encoded(image(0)), "bomb.png": bytes(1 << 20)})
    monkeypatch.setattr(images, "MAX_DECODED_PIXELS", 2000)  # 16 bytes a pixel: 32000 bytes a member
    opened: list[str] = []
    real_open = zipfile.ZipFile.open

    def spy(self: zipfile.ZipFile, name: str | zipfile.ZipInfo, *args: object, **kwargs: object) -> object:
        opened.append(name if isinstance(name, str) else name.filename)
        return real_open(self, name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(zipfile.ZipFile, "open", spy)
    _, skipped = dumped(tmp_path / "x.zip", tmp_path / "out")
    assert [row for row, _ in skipped] == [1]
    assert "declares 1048576 bytes, over 16 bytes a pixel of MAX_DECODED_PIXELS = 2000" in skipped[0][1]
    assert "bomb.png" not in opened and "a.png" in opened


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("fake.zip", b"\x89PNG\r\n\x1a\n not a zip", "fake.zip is not a ZIP archive"),
        ("fake.tar", bytes(range(256)) * 8, "fake.tar is not an uncompressed tar archive"),
        ("empty.tar", b"", "empty.tar is not an uncompressed tar archive"),
    ],
)
def test_a_file_that_is_not_its_archive_is_one_clear_error(
    tmp_path: Path, name: str, data: bytes, message: str
) -> None:
    (tmp_path / name).write_bytes(data)
    with pytest.raises(InvalidValueError, match=message) as caught:
        dump_features(tiny_extractor(), tmp_path / name, tmp_path / "out", **OPTIONS)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_compressed_tar_named_tar_and_an_imageless_one_are_refused(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "gz.tar", "w:gz") as tar:
        add(tar, "k.png", encoded(image(0)))
    with pytest.raises(InvalidValueError, match="gz.tar is not an uncompressed tar archive"):
        list_images(tmp_path / "gz.tar")
    with tarfile.open(tmp_path / "none.tar", "w") as tar:
        add(tar, "k.txt", b"text")
    with pytest.raises(InputNotFoundError, match="no samples with an image member"):
        list_images(tmp_path / "none.tar")


def test_links_and_devices_in_a_tar_are_invalid_rows_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.png"
    secret.write_bytes(encoded(image(1)))
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        add(tar, "0.png", encoded(image(0)))
        add(tar, "1.png", kind=tarfile.SYMTYPE, link=str(secret))
        add(tar, "2.png", kind=tarfile.LNKTYPE, link="0.png")
        add(tar, "3.png", kind=tarfile.CHRTYPE)
        add(tar, "4.png", kind=tarfile.FIFOTYPE)
    _, skipped = dumped(tmp_path / "s.tar", tmp_path / "out")
    reasons = dict(skipped)
    assert sorted(reasons) == [1, 2, 3, 4]
    for row, kind in [(1, "a symbolic link"), (2, "a hard link"), (3, "a character device"), (4, "a FIFO")]:
        assert f"member '{row}.png' of {tmp_path}/s.tar is {kind}; it is not followed" in reasons[row]


def test_a_truncated_shard_keeps_the_rows_before_the_cut(tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for key in range(4):
            add(tar, f"{key}.png", encoded(image(key)))
    with tarfile.open(tmp_path / "s.tar") as tar:
        offsets = [info.offset for info in tar.getmembers()]  # of each member's header
    whole = (tmp_path / "s.tar").read_bytes()
    (tmp_path / "data.tar").write_bytes(whole[: offsets[2] + 512 + 100])  # inside the third image's data
    (tmp_path / "header.tar").write_bytes(whole[: offsets[3] + 100])  # inside the fourth header
    reference, _ = dumped(tmp_path / "s.tar", tmp_path / "ref")
    with pytest.warns(UserWarning, match="data.tar is truncated at byte"):
        found, skipped = dumped(tmp_path / "data.tar", tmp_path / "cut_data")
    assert [row for row, _ in skipped] == [2] and "is cut short (100 of" in skipped[0][1]
    np.testing.assert_array_equal(found[:2], reference[:2])
    with pytest.warns(UserWarning, match=f"header.tar is truncated at byte {offsets[3]}: the samples after it"):
        found, skipped = dumped(tmp_path / "header.tar", tmp_path / "cut_header")
    assert skipped == [] and len(found) == 3
    np.testing.assert_array_equal(found, reference[:3])


def test_a_zip_replaced_between_reads_is_read_again(tmp_path: Path) -> None:
    """Each process keeps archives open; one whose file changed is opened again, never read stale."""
    write_zip(tmp_path / "x.zip", {"a.png": encoded(image(0))})
    first, _ = dumped(tmp_path / "x.zip", tmp_path / "one")
    write_zip(tmp_path / "x.zip", {"a.png": encoded(image(1)), "b.png": encoded(image(2))})
    os.utime(tmp_path / "x.zip", ns=(1, 1))  # a new mtime, even on a coarse clock
    second, _ = dumped(tmp_path / "x.zip", tmp_path / "two")
    assert len(second) == 2 and not np.array_equal(first[0], second[0])
