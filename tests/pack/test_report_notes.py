"""``salvaged`` and ``decoder_warnings`` in the convert report cover every file of the store: kept in
the chunk records across a kill and a resume, in the store's header, and gathered from every shard
of a sharded conversion (docs/jpeg-damage.md)."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time

import pytest

from fastload.pack.convert import ConvertOptions, convert
from fastload.pack.engines import EngineOptions, convert_sharded
from fastload.store import format as fmt
from helpers import jpeg_bytes, photo, png_bytes, png_chunk
from test_kill_resume import cli, committed_chunks, records

QUIET = dict(progress=False, workers=1)


def _salvageable_png(seed: int) -> bytes:
    """A PNG with a tEXt chunk whose CRC is wrong before its image data: Pillow refuses the file."""
    good = png_bytes(photo(30, 20, seed=seed))
    i = good.index(b"IDAT") - 4
    text = png_chunk(b"tEXt", b"Comment\0hello")
    return good[:i] + text[:-4] + b"\0\0\0\0" + good[i:]


def _bad_exif_jpeg(seed: int) -> bytes:
    """A JPEG whose EXIF block Pillow warns about ("Corrupt EXIF data")."""
    tiff = b"II*\x00\x08\x00\x00\x00" + struct.pack("<H", 50) + b"\x12\x01\x03\x00\x01\x00\x00\x00\x06\x00\x00\x00"
    return jpeg_bytes(photo(40, 30, seed=seed), exif=b"Exif\x00\x00" + tiff)


def _tree(root, plain: int):
    """Two classes; each starts with a salvaged PNG and a JPEG Pillow warns about, then ``plain`` files."""
    for c, name in enumerate(("a", "b")):
        d = root / name
        d.mkdir(parents=True)
        (d / "00-fixed.png").write_bytes(_salvageable_png(seed=c))
        (d / "01-bad-exif.jpg").write_bytes(_bad_exif_jpeg(seed=c))
        for i in range(plain):
            (d / f"{i + 2:03d}.jpg").write_bytes(jpeg_bytes(photo(40, 30, seed=100 * c + i)))
    return root


def _notes(report: dict) -> tuple[list, list]:
    return ([s["relpath"] for s in report["salvaged"]],
            [(w["relpath"], any("Corrupt EXIF data" in x for x in w["warnings"])) for w in report["decoder_warnings"]])


WANT = (["a/00-fixed.png", "b/00-fixed.png"], [("a/01-bad-exif.jpg", True), ("b/01-bad-exif.jpg", True)])


def test_old_chunk_records_without_the_notes_still_read():
    old = {k: v for k, v in json.loads(fmt.ChunkRecord(n=3, consumed=2).to_bytes()).items()
           if k not in ("salvaged", "decoder_warnings")}
    chunk = fmt.ChunkRecord.from_bytes(json.dumps(old).encode())
    assert (chunk.n, chunk.consumed, chunk.salvaged, chunk.decoder_warnings) == (3, 2, [], [])


def test_a_resumed_conversion_reports_the_notes_of_the_run_before(tmp_path):
    """In process: a strict run stops at a bad file after committing the noted ones; the rerun that
    finishes the store must still report them (it used to report only the files it handled)."""
    src = _tree(tmp_path / "src", plain=2)
    (src / "b" / "999-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    with pytest.raises(Exception, match="strict"):
        convert(src, tmp_path / "dst", ConvertOptions(strict=True, chunk_size=1, **QUIET))
    (src / "b" / "999-broken.jpg").unlink()
    report = convert(src, tmp_path / "dst", ConvertOptions(strict=True, chunk_size=1, **QUIET))
    assert report.resumed_from == 8
    straight = convert(src, tmp_path / "straight", ConvertOptions(strict=True, chunk_size=1, **QUIET))
    assert _notes(report.to_json()) == _notes(straight.to_json()) == WANT
    assert [w for w in report.warnings if "salvaged" in w] == [w for w in straight.warnings if "salvaged" in w]
    again = convert(src, tmp_path / "dst", ConvertOptions(strict=True, chunk_size=1, **QUIET))
    assert again.already_complete and _notes(again.to_json()) == WANT


@pytest.mark.slow
def test_sigkill_then_rerun_reports_the_same_notes(tmp_path):
    src = _tree(tmp_path / "src", plain=60)
    dst = tmp_path / "killed"
    cmd = cli("convert", src, dst, "--quiet", "--chunk-size", "1", "--workers", "1")
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while committed_chunks(dst) < 3:  # a/00-fixed.png and a/01-bad-exif.jpg are committed
        assert proc.poll() is None, "conversion finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert fmt.META_KEY not in records(dst), "the killed run must not have finished"
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed after" in rerun.stdout and "salvaged 2" in rerun.stdout
    straight = subprocess.run(cli("convert", src, tmp_path / "straight", "--quiet", "--workers", "1"),
                              capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr
    killed = json.loads((dst / "report.json").read_text())
    whole = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert _notes(killed) == _notes(whole) == WANT
    assert killed["warnings"] == whole["warnings"]


def test_sharded_report_gathers_the_notes_of_every_shard(tmp_path):
    src = _tree(tmp_path / "src", plain=2)
    dst = tmp_path / "dst"
    report = convert_sharded(src, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=2))
    assert _notes(report.to_json()) == WANT
    assert "salvaged 2" in report.summary_line()
    assert "a/00-fixed.png: salvaged: left out ancillary PNG chunk(s) tEXt" in "\n".join(report.warnings)
    # a rerun on the complete store reads them back from the manifest; a resume from the shards' headers
    again = convert_sharded(src, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=2))
    assert again.already_complete and _notes(again.to_json()) == WANT
    (dst / "manifest.json").unlink()
    (dst / "shard-00001-of-00002" / "data.mdb").unlink()
    (dst / "shard-00001-of-00002").rmdir()
    resumed = convert_sharded(src, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=2))
    assert resumed.resumed_from == 4 and _notes(resumed.to_json()) == WANT
