"""fastload bench serve runs end to end on loopback (its figures are reported, not asserted)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from fastload.cli import main


def test_bench_serve_compares_waits(tmp_path):
    out = tmp_path / "serve.json"
    r = CliRunner().invoke(main, ["bench", "serve", "--model", "mobilenet_v3_small", "--image-size", "64",
                                  "--max-batch", "4", "--wait-ms", "0", "--wait-ms", "8", "--rate", "20",
                                  "--duration", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert [run["max_wait_ms"] for run in report["runs"]] == [0.0, 8.0]
    for run in report["runs"]:
        assert run["sent"] > 0 and run["ok"] + run["rejected"] + run["errors"] == run["sent"]
        assert run["errors"] == 0 and run["p99_ms"] >= run["p50_ms"] > 0
    assert "max_wait_ms" in r.output and "throughput" in r.output
