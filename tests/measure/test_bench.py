"""Benchmarks and doctor run end to end on tiny data (their figures are not asserted)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fastload.cli import main


def test_doctor_prints_plan_and_budget():
    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "DataLoader workers per process" in r.output and "Pinned-memory budget" in r.output
    data = json.loads(CliRunner().invoke(main, ["doctor", "--json", "--batch-size", "8"]).output)
    assert data["pinned_memory"]["batch_bytes"] == 8 * 3 * 224 * 224
    assert data["workers"]["recommended"] >= 0


def test_bench_loader_reports_every_requested_path(tiny_tree, tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), "--workers", "1", "--batch-size", "4",
                                  "--image-size", "32", "--batches", "2", "--rounds", "1", "--max-side", "64",
                                  "--path", "torchvision", "--path", "fastload", "--path", "fastload-reduced",
                                  "--path", "ffcv", "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    names = [p["name"] for p in result["paths"]]
    assert names[:3] == ["torchvision", "fastload", "fastload (max-side 64)"]
    assert all(p["images_per_s"] > 0 for p in result["paths"][:3])
    assert result["paths"][0]["ratio"] == 1.0
    assert result["ceiling_per_core"] > 0 and "environment" in result
    ffcv = result["paths"][3]
    assert ffcv["images_per_s"] is not None or "ffcv" in ffcv["skipped"]
    assert "single-core ceiling" in r.output


def test_bench_convert(tiny_tree, tmp_path):
    out = tmp_path / "c.json"
    r = CliRunner().invoke(main, ["bench", "convert", str(tiny_tree), "--workers", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    names = [p["name"] for p in json.loads(out.read_text())["paths"]]
    assert names == ["read (cat)", "read+decode", "convert"]
