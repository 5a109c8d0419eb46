"""The commands' defaults are the options dataclasses' defaults, and ``fastload --help`` stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from fastload.cli import main


def _capture(monkeypatch, module: str, name: str) -> list:
    seen: list = []

    def fake(*args, **kwargs):
        seen.append((args, kwargs))
        raise SystemExit(0)

    monkeypatch.setattr(f"{module}.{name}", fake)
    return seen


def test_serve_without_options_builds_the_default_serve_and_front_options(monkeypatch):
    from fastload.serve.app import ServeOptions
    from fastload.serve.routes import FrontOptions

    seen = _capture(monkeypatch, "fastload.serve.app", "run_server")
    result = CliRunner().invoke(main, ["serve", "--model", "simulated", "--batch-ms", "1+0*n"])
    assert result.exit_code == 0, result.output
    (opts,), _ = seen[0]
    assert opts == ServeOptions(model="simulated", batch_ms="1+0*n", front=FrontOptions())


def test_bench_serve_without_options_builds_the_default_bench_options(monkeypatch):
    from fastload.bench.serve import ServeBenchOptions

    seen = _capture(monkeypatch, "fastload.bench.serve", "bench_serve")
    result = CliRunner().invoke(main, ["bench", "serve"])
    assert result.exit_code == 0, result.output
    (opts,), _ = seen[0]
    assert opts == ServeBenchOptions()


def test_bench_loader_decode_encode_and_profile_take_their_dataclass_defaults(monkeypatch, tmp_path: Path):
    from fastload.bench.decode import DecodeBenchOptions
    from fastload.bench.encode import EncodeBenchOptions
    from fastload.bench.loader import LoaderBenchOptions
    from fastload.profiling.profile import ProfileOptions

    runner = CliRunner()
    for module, name, args, expected in [
        ("fastload.bench.loader", "bench_loader", ["bench", "loader", str(tmp_path)], LoaderBenchOptions()),
        ("fastload.bench.decode", "bench_decode", ["bench", "decode", str(tmp_path)], DecodeBenchOptions()),
        ("fastload.bench.encode", "bench_encode", ["bench", "encode", str(tmp_path)], EncodeBenchOptions()),
        ("fastload.profiling.profile", "run_profile", ["profile", "--", "true"], ProfileOptions()),
    ]:
        seen = _capture(monkeypatch, module, name)
        result = runner.invoke(main, args)
        assert result.exit_code == 0, (args, result.output)
        args_seen, kwargs = seen[0]
        got = kwargs.get("options", args_seen[-1])
        assert got == expected, args


def test_convert_without_options_builds_the_default_convert_options(monkeypatch, tmp_path: Path):
    from fastload.pack.convert import ConvertOptions

    seen = _capture(monkeypatch, "fastload.pack.convert", "convert")
    result = CliRunner().invoke(main, ["convert", str(tmp_path), str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    (_, _, opts), _ = seen[0]
    assert opts == ConvertOptions()


def test_help_shows_the_dataclass_defaults():
    out = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    assert "--max-body-mb FLOAT RANGE" in out and "[default: 64.0;" in out
    assert "[default: auto]" in out and "--cpu-fallback / --no-cpu-fallback" in out
    assert "[default: cpu-fallback]" in out


def test_the_top_level_help_imports_no_room():
    code = ("import sys\nfrom fastload.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in sys.modules if m in ('torch', 'numpy') or m.startswith(('fastload.serve', "
            "'fastload.bench', 'fastload.measure', 'fastload.profiling', 'fastload.load')))\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out


def test_the_batching_defaults_are_written_once():
    import inspect

    from fastload.bench.serve import ServeBenchOptions
    from fastload.serve import policy
    from fastload.serve.app import ServeOptions
    from fastload.serve.batcher import DynamicBatcher

    batcher = inspect.signature(DynamicBatcher).parameters
    served = ServeOptions(model="simulated")
    bench = ServeBenchOptions()
    assert (served.max_batch, served.max_wait_ms, served.max_queue) == (
        policy.DEFAULT_MAX_BATCH, policy.DEFAULT_MAX_WAIT_MS, policy.DEFAULT_MAX_QUEUE)
    assert (batcher["max_batch"].default, batcher["max_wait_ms"].default, batcher["max_queue"].default) == (
        served.max_batch, served.max_wait_ms, served.max_queue)
    assert (bench.max_batch, bench.max_queue) == (served.max_batch, served.max_queue)
    for path in ("fastload/serve/app.py", "fastload/serve/batcher.py", "fastload/bench/serve.py", "fastload/cli/serve.py"):
        text = (Path(__file__).resolve().parents[1] / path).read_text()
        assert "max_batch: int = 32" not in text and "max_queue: int = 256" not in text, path
