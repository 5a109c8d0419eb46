"""What `convert` stores, skips and says about odd and damaged sources (docs/jpeg-damage.md):
bit rot, salvaged PNGs, empty classes, decoder warnings, deep trees, a JPEG given as SRC, and
a store opened while it is being written."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import simplejpeg
from click.testing import CliRunner

from fastload.cli import main
from fastload.datasets import DatasetSpec, render_image
from fastload.errors import IncompleteStoreError, SourceError
from fastload.load.dataset import LMDBImageDataset
from fastload.pack.convert import ConvertOptions, convert
from helpers import jpeg_bytes, photo, png_bytes, png_chunk

QUIET = dict(progress=False, workers=1)


def _photo_jpeg(index: int) -> bytes:
    buf = io.BytesIO()
    render_image(DatasetSpec(min_side=96, max_side=200), index % 10, index).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _rotted(data: bytes, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    sos = data.index(b"\xff\xda")
    start, end = sos + 2 + struct.unpack(">H", data[sos + 2:sos + 4])[0], data.rindex(b"\xff\xd9")
    b = bytearray(data)
    for pos in rng.choice(np.arange(start, end), size=int(rng.integers(1, 7)), replace=False):
        b[int(pos)] ^= int(rng.integers(1, 256))
    return bytes(b)


def _warns(data: bytes) -> bool:
    try:
        simplejpeg.decode_jpeg(data, strict=True)
    except ValueError:
        return True
    return False


def test_convert_stores_no_bit_rotted_copy(tmp_path):
    """Every rotted copy that libjpeg-turbo can tell from an intact file (the rest decode cleanly to other
    pixels: the documented limit) is skipped; the intact originals are all stored."""
    intact, rotted = tmp_path / "src" / "intact", tmp_path / "src" / "rotted"
    intact.mkdir(parents=True)
    rotted.mkdir()
    seed = 0
    for i in range(6):
        good = _photo_jpeg(i)
        (intact / f"{i}.jpg").write_bytes(good)
        for _ in range(2):
            bad = _rotted(good, seed)
            while not _warns(bad):
                seed += 1
                bad = _rotted(good, seed)
            (rotted / f"{i}-{seed}.jpg").write_bytes(bad)
            seed += 1
    report = convert(tmp_path / "src", tmp_path / "store", ConvertOptions(**QUIET))
    ds = LMDBImageDataset(tmp_path / "store")
    stored = [rel for rel, _ in ds.samples]
    assert sorted(stored) == sorted(f"intact/{i}.jpg" for i in range(6))
    assert len(report.skipped) == 12 and all("damaged JPEG" in s["reason"] for s in report.skipped)
    assert report.empty_classes == ["rotted"]


def _salvageable_png() -> bytes:
    """A PNG with a tEXt chunk whose CRC is wrong before its image data: Pillow refuses the file."""
    good = png_bytes(photo(30, 20))
    i = good.index(b"IDAT") - 4
    text = png_chunk(b"tEXt", b"Comment\0hello")
    return good[:i] + text[:-4] + b"\0\0\0\0" + good[i:]


def test_salvaged_png_is_named_in_the_report_and_the_output(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    (src / "fixed.png").write_bytes(_salvageable_png())
    (src / "plain.png").write_bytes(png_bytes(photo(30, 20, seed=2)))
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), str(tmp_path / "store"), "--quiet",
                                       "--workers", "1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "salvaged 1" in result.output
    assert "a/fixed.png: salvaged: left out ancillary PNG chunk(s) tEXt with a bad CRC" in result.output
    report = json.loads((tmp_path / "store" / "report.json").read_text())
    assert [s["relpath"] for s in report["salvaged"]] == ["a/fixed.png"]
    assert "plain.png" not in result.output


def test_empty_class_is_warned_about_and_recorded(tmp_path):
    root = tmp_path / "src"
    for name in ("cat", "dog", "empty", "junk"):
        (root / name).mkdir(parents=True)
    (root / "cat" / "1.jpg").write_bytes(jpeg_bytes(photo(seed=1)))
    (root / "dog" / "1.jpg").write_bytes(jpeg_bytes(photo(seed=2)))
    (root / "junk" / "1.jpg").write_bytes(b"not an image")
    result = CliRunner().invoke(main, ["convert", str(root), str(tmp_path / "store"), "--quiet", "--workers", "1"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "2 EMPTY classes" in result.output
    assert "'empty' (label 2: no image files)" in result.output
    assert "'junk' (label 3: every file skipped)" in result.output
    report = convert(root, tmp_path / "store2", ConvertOptions(**QUIET))
    assert report.empty_classes == ["empty", "junk"]
    assert LMDBImageDataset(tmp_path / "store2").classes == ["cat", "dog", "empty", "junk"]


def test_pillow_warnings_go_into_the_report_not_the_terminal(tmp_path, capfd):
    tiff = b"II*\x00\x08\x00\x00\x00" + struct.pack("<H", 50) + b"\x12\x01\x03\x00\x01\x00\x00\x00\x06\x00\x00\x00"
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    (src / "bad-exif.jpg").write_bytes(jpeg_bytes(photo(40, 30), exif=b"Exif\x00\x00" + tiff))
    (src / "plain.jpg").write_bytes(jpeg_bytes(photo(40, 30, seed=1)))
    report = convert(tmp_path / "src", tmp_path / "store", ConvertOptions(**QUIET))
    out, err = capfd.readouterr()
    assert "EXIF" not in out + err
    assert [w["relpath"] for w in report.decoder_warnings] == ["a/bad-exif.jpg"]
    assert "Corrupt EXIF data" in report.decoder_warnings[0]["warnings"][0]
    assert "decoder warnings on 1 files" in report.summary_line()


def test_a_folder_tree_1200_levels_deep_is_walked(tmp_path):
    deep = tmp_path / "src" / "a"
    deep.mkdir(parents=True)
    path = str(deep)
    for _ in range(1200):  # os.makedirs recurses too
        path = os.path.join(path, "d")
        os.mkdir(path)
    with open(os.path.join(path, "x.jpg"), "wb") as f:
        f.write(jpeg_bytes(photo(16, 16)))
    (deep / "top.jpg").write_bytes(jpeg_bytes(photo(16, 16, seed=1)))
    try:
        report = convert(tmp_path / "src", tmp_path / "store", ConvertOptions(**QUIET))
        assert report.stored == 2 and not report.skipped
    finally:  # pytest's own clean-up (shutil.rmtree) recurses: take the tree down from the bottom
        os.remove(os.path.join(path, "x.jpg"))
        while path != str(deep):
            os.rmdir(path)
            path = os.path.dirname(path)


def test_a_jpeg_as_src_is_told_what_a_source_is(tmp_path):
    img = tmp_path / "photo.jpg"
    img.write_bytes(jpeg_bytes(photo()))
    with pytest.raises(SourceError, match=r"is an image \(JPEG\), not a source: SRC must be a folder") as exc:
        convert(img, tmp_path / "store", ConvertOptions(**QUIET))
    assert "UTF-8" not in str(exc.value)
    # a file list whose first path happens to start like a BMP is still a file list
    (tmp_path / "BMW").mkdir()
    (tmp_path / "BMW" / "1.jpg").write_bytes(jpeg_bytes(photo()))
    listing = tmp_path / "list.csv"
    listing.write_text("BMW/1.jpg,car\n")
    assert convert(listing, tmp_path / "store2", ConvertOptions(**QUIET)).stored == 1


_SLOW_HANDLER = textwrap.dedent("""
    import os, time
    from fastload.pack.work import prepare_item as real

    def prepare_item(path, options):
        if os.path.basename(path).startswith("slow"):
            time.sleep(120)  # a conversion that is alive, mid-way
        return real(path, options)
""")


def test_opening_a_store_while_it_is_being_written_says_so(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(3):
        (src / f"{i}.jpg").write_bytes(jpeg_bytes(photo(seed=i)))
    (src / "slow.jpg").write_bytes(jpeg_bytes(photo(seed=9)))
    (tmp_path / "slow_handler.py").write_text(_SLOW_HANDLER)
    script = textwrap.dedent(f"""
        import fastload.pack.convert as c
        c._HANDLER = "slow_handler:prepare_item"
        c.convert({str(tmp_path / 'src')!r}, {str(tmp_path / 'store')!r},
                  c.ConvertOptions(progress=False, workers=1, chunk_size=1))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                LMDBImageDataset(tmp_path / "store")
            except IncompleteStoreError as exc:
                if "3 samples so far" in str(exc):
                    message = str(exc)
                    break
            except Exception:
                pass
            time.sleep(0.05)
        assert "is being written" in message and f"pid {proc.pid} on " in message
        assert "rerun" not in message
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    with pytest.raises(IncompleteStoreError, match="(?s)stopped after 3 samples.*rerun the same"):
        LMDBImageDataset(tmp_path / "store")
