"""``fastload bench serve --fronts stdlib,asgi``: the two HTTP fronts side by side under the same load.

Owns: one real ``fastload serve`` process per front, both with the same model (the
simulated device, or a torchvision model), preprocessing, batching and limits
(``fastload serve``'s defaults: fastload's preprocessing on every CPU, the 8 ms window),
the same open-loop Poisson arrivals sent to each from this process (``bench/serve.py``'s ``run_load``),
interleaved rounds (every round runs every load on every front, the order of the fronts
alternating), the server's CPU time per answered request and its resident memory (psutil,
sampled every 50 ms), and the table: each front's medians over rounds with their range,
then the second front over the first as per-round ratios (median and range).

Why a process per front: in one process the load generator's threads and the server would
share the GIL and the CPU counters, so neither the latency nor the CPU per request would
be the front's alone.

Must not: be imported by ``serve/``; assert performance.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from fastload.bench.serve import ServeBenchOptions, _bodies, _capacity, _median_point, run_load

__all__ = ["bench_fronts", "check_fronts", "format_fronts_table"]

_KEYS = ("throughput", "p50_ms", "p99_ms", "cpu_ms_per_request", "rss_mb")


def check_fronts(fronts: tuple[str, ...]) -> None:
    """Raises ValueError unless ``fronts`` is stdlib and asgi, in either order (the first is the baseline)."""
    if len(fronts) != 2 or set(fronts) != {"stdlib", "asgi"}:
        raise ValueError(f"--fronts must be 'stdlib,asgi' (or 'asgi,stdlib'; the first is the baseline of the "
                         f"ratios), got {','.join(fronts) or 'nothing'!r}")


class _Server:
    """``fastload serve --front FRONT ... --port 0`` on 127.0.0.1; ``port`` from its first line."""

    def __init__(self, front: str, options: ServeBenchOptions, workers: int, timeout: float = 120.0) -> None:
        import psutil

        size = options.image_size
        args = ["--front", front, "--model", options.model, "--devices", options.device,
                "--max-batch", str(options.max_batch), "--max-queue", str(options.max_queue),
                "--size", str(size), "--resize", str(size + 32), "--workers", str(workers),
                "--request-timeout", "60", "--max-connections", "1024", "--host", "127.0.0.1", "--port", "0"]
        if options.model == "simulated":
            args += ["--batch-ms", options.batch_ms]
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.front = front
        self.proc = subprocess.Popen([sys.executable, "-m", "fastload.cli", "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.port: int | None = None
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                if line.startswith("ready on"):
                    ready.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        if not ready.wait(timeout) or self.port is None:
            self.stop()
            raise RuntimeError(f"fastload serve --front {front} did not become ready:\n{''.join(self.lines)}")
        self.ps = psutil.Process(self.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        self.proc.stdout.close()


def _point(server: _Server, bodies: list[bytes], rate: float, options: ServeBenchOptions, seed: int) -> dict:
    """One load point against one server: the load's summary plus the server's CPU per request and RSS."""
    peak = [server.ps.memory_info().rss]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], server.ps.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    cpu0 = server.cpu_s()
    sampler.start()
    try:
        res = run_load(server.port, bodies, rate, options.duration_s, options.max_requests, seed=seed,
                       config=server.front)
    finally:
        done.set()
        sampler.join()
    cpu = server.cpu_s() - cpu0
    out = res.summary()
    out.update(front=server.front, cpu_ms_per_request=cpu * 1e3 / res.ok if res.ok else float("nan"),
               rss_mb=peak[0] / 2**20)
    return out


def bench_fronts(options: ServeBenchOptions, fronts: tuple[str, ...], *, progress: bool = True) -> dict:
    """Every (round, load, front) point against one long-running server per front; every figure."""
    from fastload.serve.models import build_model
    from fastload.system import available_cpus, resolve_device

    check_fronts(fronts)
    workers = options.workers or available_cpus()
    bodies = _bodies(32, options.image_size + 32, options.seed)
    model = build_model(options.model, batch_ms=options.batch_ms if options.model == "simulated" else None)
    capacity = _capacity(options, model, bodies, workers, resolve_device(options.device, what="--device"))
    rates = list(options.rates) if options.rates else [f * capacity["estimate_per_s"] for f in options.loads]
    servers = {}
    try:
        for front in fronts:
            servers[front] = _Server(front, options, workers)
            run_load(servers[front].port, bodies, 50.0, 1.0, 50, seed=options.seed)  # first-call costs: untimed
        raw: dict[tuple[str, float], list[dict]] = {}
        for rnd in range(options.rounds):
            for i, rate in enumerate(rates):
                order = fronts if (rnd + i) % 2 == 0 else fronts[::-1]  # neither front always goes first
                for front in order:
                    if progress:
                        print(f"round {rnd + 1}/{options.rounds}: {front:<6} at {rate:7.1f} requests/s for "
                              f"{options.duration_s:g}s ...", flush=True)
                    raw.setdefault((front, rate), []).append(_point(servers[front], bodies, rate, options,
                                                                    options.seed + rnd))
    finally:
        for server in servers.values():
            server.stop()
    points = [_median_point(raw[(front, rate)], "front", _KEYS) for rate in rates for front in fronts]
    ratios = [_ratios(raw[(fronts[0], rate)], raw[(fronts[1], rate)], rate) for rate in rates]
    return {"options": {**dataclasses.asdict(options), "fronts": list(fronts)}, "workers": workers,
            "capacity": capacity, "rates": rates, "points": points, "ratios": ratios,
            "runs": [r for runs in raw.values() for r in runs]}


def _ratios(base: list[dict], other: list[dict], rate: float) -> dict:
    out = {"offered_rate": rate, "of": f"{other[0]['front']}/{base[0]['front']}"}
    for key in _KEYS:
        vals = [o[key] / b[key] for b, o in zip(base, other) if b[key]]
        out[key] = float(np.median(vals)) if vals else float("nan")
        out[f"{key}_range"] = [float(min(vals)), float(max(vals))] if vals else [float("nan")] * 2
    return out


def _cell(p: dict, key: str, fmt: str) -> str:
    lo, hi = p[f"{key}_range"]
    return format(p[key], fmt) if p.get("rounds", 2) == 1 else f"{p[key]:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def format_fronts_table(report: dict) -> str:
    o = report["options"]
    model = f"simulated device ({o['batch_ms']} ms per batch of n)" if o["model"] == "simulated" else o["model"]
    lines = [f"HTTP fronts: {model} on {o['device']}, max_batch {o['max_batch']}, {report['workers']} preprocessing "
             f"thread(s), {o['rounds']} interleaved round(s) x {o['duration_s']:g}s per point, Poisson arrivals over "
             "loopback HTTP (a new connection per request); each front a fastload serve process",
             f"{'offered/s':>9}  {'front':<7}{'throughput/s':>22}{'p50 ms':>20}{'p99 ms':>22}{'CPU ms/req':>18}"
             f"{'RSS MB':>18}{'rejected':>9}{'errors':>7}"]
    for p in report["points"]:
        lines.append(f"{p['offered_rate']:>9.0f}  {p['front']:<7}{_cell(p, 'throughput', '.1f'):>22}"
                     f"{_cell(p, 'p50_ms', '.1f'):>20}{_cell(p, 'p99_ms', '.1f'):>22}"
                     f"{_cell(p, 'cpu_ms_per_request', '.2f'):>18}{_cell(p, 'rss_mb', '.0f'):>18}"
                     f"{p['rejected']:>9}{p['errors']:>7}")
    of = report["ratios"][0]["of"] if report["ratios"] else ""
    lines.append(f"{of} per round, median [min-max]:")
    lines.append(f"{'offered/s':>9}  {'throughput':>20}{'p50':>20}{'p99':>20}{'CPU/req':>20}{'RSS':>20}")
    for r in report["ratios"]:
        lines.append(f"{r['offered_rate']:>9.0f}  " + "".join(f"{_cell(r, k, '.2f'):>20}" for k in _KEYS))
    lines.append("medians over rounds [min-max]; p50/p99 over answered requests; CPU = the server process's user + "
                 "system time / answered requests; RSS = its peak resident memory during the point")
    return "\n".join(lines)
