"""The report of a sharded conversion is the report of one store of the same folder, field for field:
a folder of photos with PNGs (named .jpg and .png), canonicalised, salvaged, warned-about and broken
files spread over several shards, on both engines, through the library and the CLI (into a bucket
too), fresh, complete and resumed. The CLI exits 0 and prints the lossy writes' median."""

from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.pack.convert import ConvertOptions, convert
from fastload.pack.engines import EngineOptions, convert_sharded
from fastload.store.reader import load_store_metas
from helpers import bad_files, jpeg_bytes, photo, png_bytes, png_chunk, special_images

QUIET = dict(progress=False, workers=1)
FIELDS = ("stored", "total", "skipped", "canonicalised", "reencoded", "reencoded_reasons", "lossy", "bytes_stored",
          "salvaged", "decoder_warnings")


def _salvageable_png(seed: int) -> bytes:
    good = png_bytes(photo(30, 20, seed=seed))
    i = good.index(b"IDAT") - 4
    text = png_chunk(b"tEXt", b"Comment\0hello")
    return good[:i] + text[:-4] + b"\0\0\0\0" + good[i:]


def _bad_exif_jpeg(seed: int) -> bytes:
    tiff = b"II*\x00\x08\x00\x00\x00" + struct.pack("<H", 50) + b"\x12\x01\x03\x00\x01\x00\x00\x00\x06\x00\x00\x00"
    return jpeg_bytes(photo(40, 30, seed=seed), exif=b"Exif\x00\x00" + tiff)


@pytest.fixture(scope="module")
def mixed_tree(tmp_path_factory) -> Path:
    """3 classes of 10 files: JPEG photos, PNGs named .jpg and .png (re-encoded, lossy), canonicalised
    CMYK and EXIF-rotated JPEGs, a salvaged PNG, a JPEG Pillow warns about, and broken files."""
    root = tmp_path_factory.mktemp("mixed") / "tree"
    special, bad = special_images(), bad_files()
    for c, name in enumerate(("cat", "dog", "emu")):
        d = root / name
        d.mkdir(parents=True)
        files = {
            "00.jpg": jpeg_bytes(photo(64, 48, seed=10 * c)),
            "01-png-named.jpg": png_bytes(photo(50 + 7 * c, 40, seed=10 * c + 1)),
            "02.jpg": jpeg_bytes(photo(48, 64, seed=10 * c + 2)),
            "03-cmyk.jpg": special["cmyk.jpg"],
            "04-broken.jpg": bad[("truncated.jpg", "notimage.jpg", "empty.jpg")[c]],
            "05.png": png_bytes(photo(40 + 5 * c, 60, seed=10 * c + 5)),
            "06-fixed.png": _salvageable_png(seed=c),
            "07-exif.jpg": _bad_exif_jpeg(seed=c),
            "08-rotated.jpg": special["exif6.jpg"],
            "09-png-named.jpg": png_bytes(photo(33, 44 + c, seed=10 * c + 9)),
        }
        for rel, data in files.items():
            (d / rel).write_bytes(data)
    return root


@pytest.fixture(scope="module")
def one_store(mixed_tree, tmp_path_factory):
    """The report of one (unsharded) store of the tree: what every sharded report must equal."""
    report = convert(mixed_tree, tmp_path_factory.mktemp("one") / "store", ConvertOptions(**QUIET))
    assert report.lossy["count"] >= 9 and report.skipped and report.salvaged and report.decoder_warnings
    assert report.canonicalised and report.reencoded_reasons
    return report


def _fields(report) -> dict:
    return {k: getattr(report, k) for k in FIELDS}


def _spread(dst: Path) -> None:
    """The shards really mix lossy, salvaged and skipped files (else the test proves little)."""
    headers = [m.header for m in load_store_metas(dst)]
    assert len(headers) == 4
    assert sum(1 for h in headers if h["lossy"]["count"]) >= 3
    assert sum(1 for h in headers if h["skipped"]) >= 2 and sum(1 for h in headers if h["salvaged"]) >= 2
    assert len({h["lossy"]["psnr_median"] for h in headers}) > 1  # one shard's median is not the store's


def test_sharded_report_equals_the_one_store_report(mixed_tree, one_store, tmp_path):
    dst = tmp_path / "dst"
    report = convert_sharded(mixed_tree, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=4))
    _spread(dst)
    assert _fields(report) == _fields(one_store)
    assert report.lossy["psnr_median"] is not None
    # complete: read back from the manifest; resumed: from the published shards' headers
    again = convert_sharded(mixed_tree, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=4))
    assert again.already_complete and _fields(again) == _fields(one_store)
    (dst / "manifest.json").unlink()
    shutil.rmtree(dst / "shard-00002-of-00004")
    resumed = convert_sharded(mixed_tree, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=4))
    assert resumed.resumed_from and _fields(resumed) == _fields(one_store)


def _lossy_line(one_store) -> str:
    lossy = one_store.lossy
    return (f"lossy writes {lossy['count']}: PSNR min {lossy['psnr_min']:.1f} dB, "
            f"median {lossy['psnr_median']:.1f} dB")


@pytest.mark.parametrize("how", [["--engine", "local", "--num-shards", "4"], ["--shard-size", "4KB"]])
def test_cli_sharded_conversion_exits_0_with_the_true_report(mixed_tree, one_store, tmp_path, how):
    args = ["convert", str(mixed_tree), str(tmp_path / "dst"), *how, "-q"]
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"stored {one_store.stored} of {one_store.total} images, skipped {len(one_store.skipped)}" in r.output
    assert _lossy_line(one_store) in r.output
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0 and "already complete" in r.output and _lossy_line(one_store) in r.output


def test_cli_folder_with_pngs_into_a_bucket_exits_0(mixed_tree, one_store, s3_server, fresh_bucket):
    r = CliRunner().invoke(main, ["convert", str(mixed_tree), f"s3://{fresh_bucket}/store", "--num-shards", "4",
                                  "-q"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert _lossy_line(one_store) in r.output
    for rel in ("cat/04-broken.jpg", "dog/04-broken.jpg", "emu/04-broken.jpg"):
        assert f"skipped {rel}" in r.output


def test_cli_prints_a_manifest_of_an_older_fastload_without_the_median(mixed_tree, tmp_path):
    """Manifests written before the median was recorded have no psnr_median: printed without it."""
    import json

    dst = tmp_path / "dst"
    convert_sharded(mixed_tree, dst, ConvertOptions(**QUIET), EngineOptions(num_shards=2))
    m = json.loads((dst / "manifest.json").read_text())
    m["counts"]["lossy"] = {"count": m["counts"]["lossy"]["count"], "psnr_min": m["counts"]["lossy"]["psnr_min"]}
    (dst / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["convert", str(mixed_tree), str(dst), "--engine", "local", "--num-shards", "2", "-q"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert re.search(r"lossy writes \d+: PSNR min [\d.]+ dB \(against", r.output), r.output


@pytest.mark.slow
def test_ray_sharded_report_equals_the_one_store_report(ray_cluster, mixed_tree, one_store, tmp_path):
    dst = tmp_path / "dst"
    report = convert_sharded(mixed_tree, dst, ConvertOptions(**QUIET), EngineOptions(engine="ray", num_shards=4))
    _spread(dst)
    assert _fields(report) == _fields(one_store)


@pytest.mark.slow
def test_cli_engine_ray_into_a_bucket_exits_0_with_the_true_report(ray_cluster, mixed_tree, one_store, s3_server,
                                                                    fresh_bucket):
    r = CliRunner().invoke(main, ["convert", str(mixed_tree), f"s3://{fresh_bucket}/store", "--engine", "ray",
                                  "--num-shards", "4", "-q"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert _lossy_line(one_store) in r.output
