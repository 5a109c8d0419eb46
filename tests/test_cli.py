"""The fastload CLI through click's CliRunner: exit codes and what it prints."""

from __future__ import annotations

import json
import shutil

import lmdb
from click.testing import CliRunner

from fastload.cli import main
from fastload.store import format as fmt
from helpers import copy_tree


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_convert_verify_inspect(tmp_path, tiny_tree):
    src = copy_tree(tiny_tree, tmp_path / "src")
    (src / "aurora" / "broken.jpg").write_bytes(b"")
    r = run("convert", src, tmp_path / "out", "--quiet", "--workers", "2")
    assert r.exit_code == 0, r.output
    assert "stored 24 of 25 images, skipped 1" in r.output
    assert "skipped aurora/broken.jpg: empty file" in r.output

    r = run("verify", tmp_path / "out", "--quiet")
    assert r.exit_code == 0 and "24 samples checked, OK" in r.output

    r = run("inspect", tmp_path / "out")
    assert r.exit_code == 0
    assert "samples   24" in r.output and "aurora" in r.output and "complete" in r.output
    info = json.loads(run("inspect", tmp_path / "out", "--json").output)
    assert info["count"] == 24 and info["classes"] == {"aurora": 8, "basalt": 8, "coral": 8}

    r = run("convert", src, tmp_path / "out", "--quiet")
    assert r.exit_code == 0 and "already complete" in r.output


def test_verify_reports_failing_indices(tmp_path, tiny_store):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        good = txn.get(fmt.sample_key(2))
        txn.put(fmt.sample_key(2), good[:-10] + b"0123456789")  # same length, wrong bytes
        txn.put(fmt.sample_key(5), b"garbage")
    env.close()
    r = run("verify", store, "--quiet", "--workers", "1")
    assert r.exit_code == 1
    assert "sample 2 (" in r.output and "checksum mismatch" in r.output
    assert "sample 5 (" in r.output and "2 bad" in r.output
    out = json.loads(run("verify", store, "--json", "--workers", "1").output)
    assert [f["index"] for f in out["failures"]] == [2, 5] and out["ok"] is False


def test_inspect_incomplete_store_exits_nonzero(tmp_path, tiny_store):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.delete(fmt.META_KEY)
        txn.put(fmt.BUILD_KEY, b"{}")
    env.close()
    r = run("inspect", store)
    assert r.exit_code == 1 and "INCOMPLETE" in r.output


def test_errors_are_one_clear_line(tmp_path, tiny_tree):
    r = run("convert", tmp_path / "missing", tmp_path / "out")
    assert r.exit_code == 2 and "does not exist" in r.output
    r = run("verify", tmp_path / "nostore")
    assert r.exit_code == 1 and "does not exist" in r.output and "Traceback" not in r.output
    r = run("convert", tiny_tree, tmp_path / "o", "--num-shards", "2", "--shard-index", "2")
    assert r.exit_code == 2 and "--shard-index" in r.output


def test_dataset_command_writes_a_tree(tmp_path):
    r = run("dataset", tmp_path / "d", "--classes", "2", "--per-class", "3", "--quiet")
    assert r.exit_code == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir() if p.is_dir()) == ["aurora", "basalt"]
    assert len(list((tmp_path / "d").rglob("*.jpg"))) + len(list((tmp_path / "d").rglob("*.png"))) == 6


def test_dataset_command_makes_large_photos_on_request(tmp_path):
    from PIL import Image

    r = run("dataset", tmp_path / "d", "--classes", "1", "--per-class", "4", "--min-side", "300", "--max-side", "420",
            "--png-every", "2", "--quiet")
    assert r.exit_code == 0, r.output
    files = sorted(p for p in (tmp_path / "d").rglob("*") if p.is_file() and p.suffix in (".jpg", ".png"))
    assert [p.suffix for p in files].count(".png") == 2
    for p in files:
        with Image.open(p) as img:
            assert 300 <= min(img.size) and max(img.size) <= 420, img.size


def test_convert_lossless_and_the_lossy_default_say_what_they_stored(tmp_path, tiny_tree):
    r = run("convert", tiny_tree, tmp_path / "lossy", "--quiet", "--workers", "2")
    assert r.exit_code == 0, r.output
    assert "re-encoded 6: PNG source stored as JPEG q95 4:4:4 (lossy; --lossless keeps it exact)" in r.output
    assert "lossy writes 6: PSNR min" in r.output
    r = run("convert", tiny_tree, tmp_path / "exact", "--quiet", "--workers", "2", "--lossless")
    assert r.exit_code == 0 and "re-encoded" not in r.output and "lossy writes" not in r.output
    r = run("inspect", tmp_path / "lossy", "--no-advise")
    assert "re-encoded 6: PNG source" in r.output and "encodings jpeg 24, png 0" in r.output
    assert "encodings jpeg 18, png 6" in run("inspect", tmp_path / "exact", "--no-advise").output
    r = run("convert", tiny_tree, tmp_path / "x", "--lossless", "--max-side", "64")
    assert r.exit_code == 2 and "--encoding raw" in r.output


def test_convert_and_inspect_measure_the_max_side_advice(tmp_path, tiny_tree):
    """tiny_tree's images (48-160 px) are 'far larger' than 16 px training needs (--max-side 32)."""
    r = run("convert", tiny_tree, tmp_path / "out", "--quiet", "--workers", "2", "--train-size", "16")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if "sampled images" in x)
    assert "training at 16 px" in line and "at --max-side 32" in line and "ms an image as stored" in line
    info = json.loads(run("inspect", tmp_path / "out", "--json", "--train-size", "16").output)
    advice = info["max_side_advice"]
    assert advice["max_side"] == 32 and advice["sampled"] == 8 and advice["rounds"] == 3
    assert advice["speedup"] > 0 and 0 < advice["bytes_ratio"] < 1
    assert advice["worthwhile"] == (advice["speedup"] >= 1.5)
    # at 224 px these images are small: nothing is measured, convert says nothing, inspect says so
    r = run("convert", tiny_tree, tmp_path / "out224", "--quiet", "--workers", "2")
    assert "sampled images" not in r.output
    r = run("inspect", tmp_path / "out224")
    assert "not far larger than --max-side 448 would make them; no reduction advised" in r.output
