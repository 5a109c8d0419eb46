"""``fastload bench encode`` (every candidate measured on the same images, fidelity right) and the raw
reduced store of ``bench loader``; never a timing."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner
from PIL import Image

from fastload.cli import main
from fastload.image.policy import decode_reference
from fastload.bench import encode as be


def test_every_candidate_is_measured_with_its_real_size_and_fidelity(tiny_tree, monkeypatch):
    timed = []
    real = be._encode
    monkeypatch.setattr(be, "_encode", lambda img, name: timed.append(name) or real(img, name))
    result = be.bench_encode(tiny_tree, be.EncodeBenchOptions(images=5, rounds=2, size=32))
    assert result.images == 5 and sum(result.formats.values()) == 5
    assert list(result.candidates) == list(be.CANDIDATES) and timed == [n for n in be.CANDIDATES for _ in range(5)]
    c = result.candidates
    for cand in c.values():
        assert len(cand.rounds) == 2 and cand.preset_ms == np.median(cand.rounds)
    assert c["png"].psnr_min == c["webp-lossless"].psnr_min == 100.0  # lossless: exact
    assert 25 < c["jpeg-q90-420"].psnr_min < c["jpeg-q95-444"].psnr_median < 100
    # the bits per pixel are those of the bytes the candidate writes
    files = sorted(p for p in tiny_tree.rglob("*") if p.suffix in (".jpg", ".png"))[:5]
    refs = [decode_reference(p.read_bytes()) for p in files]
    bits = 8 * sum(len(real(r, "jpeg-q95-444")) for r in refs) / sum(r.width * r.height for r in refs)
    assert abs(c["jpeg-q95-444"].bits_per_pixel - bits) < 1e-9
    assert c["png"].bits_per_pixel > c["jpeg-q95-444"].bits_per_pixel > c["jpeg-q90-420"].bits_per_pixel


def test_cli_prints_the_table_and_writes_json(tmp_path):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "a.webp")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnope")  # skipped, not fatal
    r = CliRunner().invoke(main, ["bench", "encode", str(tmp_path), "--rounds", "1", "--size", "16",
                                  "--json", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    assert "1 images (webp 1;" in r.output and "jpeg-q95-444" in r.output and "exact" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["images"] == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(main, ["bench", "encode", str(empty)])
    assert r.exit_code != 0 and "no readable image files" in r.output


def test_bench_loader_reduced_store_can_be_raw(tiny_tree, tmp_path, monkeypatch):
    """--reduced-encoding reaches the conversion of the --max-side store, and the row says so."""
    import fastload.pack.convert as pc

    seen, real = [], pc.convert
    monkeypatch.setattr(pc, "convert", lambda src, dst, opts: seen.append(opts) or real(src, dst, opts))
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), "--workers", "1", "--batch-size", "4",
                                  "--image-size", "32", "--batches", "1", "--rounds", "1", "--max-side", "48",
                                  "--floor-seconds", "0.1",
                                  "--reduced-encoding", "raw", "--path", "torchvision", "--path", "fastload-reduced"])
    assert r.exit_code == 0, r.output
    assert "fastload (threads, max-side 48, raw)" in r.output and "different data: the max-side 48 store" in r.output
    assert [(o.max_side, o.encoding) for o in seen if o.max_side] == [(48, "raw")]
