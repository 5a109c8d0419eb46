"""fastload bench serve runs before and after end to end on loopback (its figures are reported, not asserted)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.bench.serve import CONFIGS, PillowEval, ServeBenchOptions
from helpers import jpeg_bytes, photo


@pytest.mark.slow
def test_bench_serve_runs_every_config_at_every_load(tmp_path):
    out = tmp_path / "serve.json"
    r = CliRunner().invoke(main, ["bench", "serve", "--model", "simulated", "--batch-ms", "2+0.1*n",
                                  "--image-size", "64", "--max-batch", "4", "--rates", "15,30", "--rounds", "1",
                                  "--duration", "0.5", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    points = {(p["config"], p["offered_rate"]) for p in report["points"]}
    assert points == {(c, rate) for c in CONFIGS for rate in (15.0, 30.0)}
    for p in report["points"]:
        assert p["sent"] > 0 and p["ok"] + p["rejected"] + p["errors"] == p["sent"]
        assert p["errors"] == 0 and p["p99_ms"] >= p["p50_ms"] > 0
        assert 0 < p["busy_fraction"] < 1 and p["mean_batch_size"] >= 1
    assert "before" in r.output and "after greedy" in r.output and "vs before" in r.output


def test_before_preprocessing_gives_the_same_geometry_as_fastloads():
    from fastload.load.transforms import EvalTransform

    data = jpeg_bytes(photo(300, 200, seed=1))
    a, b = PillowEval(64, 96)(data), EvalTransform(64, 96).from_bytes(data)
    assert a.shape == b.shape == (3, 64, 64) and a.dtype == b.dtype
    assert (a.float() - b.float()).abs().mean() < 8  # same crop; pixels differ by decoder rounding only


@pytest.mark.parametrize("bad", [dict(configs=("sideways",)), dict(rates=(0.0,)), dict(rounds=0)])
def test_bench_options_are_validated(bad):
    with pytest.raises(ValueError):
        ServeBenchOptions(**bad)


@pytest.mark.slow
def test_bench_serve_fronts_runs_both_fronts_as_processes_at_every_load(tmp_path):
    pytest.importorskip("uvicorn", reason="the asgi front needs the serve extra")
    out = tmp_path / "fronts.json"
    r = CliRunner().invoke(main, ["bench", "serve", "--fronts", "stdlib,asgi", "--model", "simulated", "--batch-ms",
                                  "2+0.1*n", "--image-size", "64", "--max-batch", "4", "--rates", "15,30",
                                  "--rounds", "1", "--duration", "0.5", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert {(p["front"], p["offered_rate"]) for p in report["points"]} == {
        (f, rate) for f in ("stdlib", "asgi") for rate in (15.0, 30.0)}
    for p in report["points"]:
        assert p["sent"] > 0 and p["errors"] == 0 and p["ok"] + p["rejected"] == p["sent"]
        assert p["cpu_ms_per_request"] > 0 and p["rss_mb"] > 0
    assert [x["of"] for x in report["ratios"]] == ["asgi/stdlib"] * 2
    assert "asgi/stdlib per round" in r.output


def test_bench_fronts_needs_both_fronts():
    r = CliRunner().invoke(main, ["bench", "serve", "--fronts", "asgi"])
    assert r.exit_code == 2 and "--fronts must be 'stdlib,asgi'" in r.output
