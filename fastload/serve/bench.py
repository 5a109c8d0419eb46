"""``fastload bench serve``: an open-loop load test of the HTTP front over loopback.

Owns: Poisson arrivals at a target rate for a bounded duration and request count (it
stops by itself), sending ``POST /predict`` to ``127.0.0.1`` only, and the side-by-side
comparison of several ``max_wait_ms`` values, each on a fresh server with the same model,
in one process tree. Open loop: a request is sent at its scheduled time whether or not
earlier ones have finished, as real traffic arrives; a closed loop would slow down with
the server and hide queueing.

``rate="auto"`` measures the model's compute time for a batch of 1 and of ``max_batch``
and offers a load between the two capacities: more than one-at-a-time serving can
sustain, well within what batching can.

Must not: send traffic anywhere but loopback.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

__all__ = ["ServeBenchOptions", "bench_serve", "run_load"]


@dataclass(frozen=True, kw_only=True)
class ServeBenchOptions:
    model: str = "mobilenet_v3_small"
    waits_ms: tuple[float, ...] = (0.0, 8.0, 50.0)
    max_batch: int = 16
    max_queue: int = 256
    rate: float | str = "auto"  # requests/s, or "auto"
    duration_s: float = 10.0
    max_requests: int = 5000
    image_size: int = 224
    workers: int = 2
    seed: int = 0


@dataclass
class LoadResult:
    max_wait_ms: float
    offered_rate: float
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    server: dict = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        lat = np.asarray(self.latencies_ms) if self.latencies_ms else np.zeros(1)
        return {"max_wait_ms": self.max_wait_ms, "offered_rate": self.offered_rate, "sent": self.sent,
                "ok": self.ok, "rejected": self.rejected, "errors": self.errors,
                "throughput": self.ok / self.seconds if self.seconds else 0.0,
                "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
                "mean_batch_size": self.server.get("mean_batch_size", 0.0),
                "server_compute_ms": self.server.get("compute_ms", {})}


def _request(port: int, body: bytes) -> tuple[int, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/predict", body=body, headers={"Content-Type": "image/jpeg"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, (time.perf_counter() - t0) * 1e3
    finally:
        conn.close()


def run_load(port: int, bodies: list[bytes], rate: float, duration_s: float, max_requests: int,
             seed: int = 0, max_wait_ms: float = 0.0) -> LoadResult:
    """Send Poisson arrivals at ``rate``/s to ``127.0.0.1:port`` for ``duration_s`` (or ``max_requests``)."""
    rng = np.random.default_rng(seed)
    result = LoadResult(max_wait_ms, rate)
    lock = threading.Lock()

    def send(k: int) -> None:
        try:
            status, ms = _request(port, bodies[k % len(bodies)])
        except OSError:
            status, ms = -1, 0.0
        with lock:
            if status == 200:
                result.ok += 1
                result.latencies_ms.append(ms)
            elif status == 503:
                result.rejected += 1
            else:
                result.errors += 1

    start = time.perf_counter()
    next_at = start
    with ThreadPoolExecutor(max_workers=128, thread_name_prefix="fastload-load") as pool:
        k = 0
        while k < max_requests:
            next_at += rng.exponential(1.0 / rate)
            if next_at - start > duration_s:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, k)
            k += 1
        result.sent = k
    result.seconds = time.perf_counter() - start
    return result


def _bodies(n: int, size: int, seed: int) -> list[bytes]:
    from fastload.datasets import DatasetSpec, encode_image

    spec = DatasetSpec(num_classes=1, per_class=n, min_side=size + 32, max_side=int(size * 1.6), png_every=0,
                       seed=seed)
    return [encode_image(spec, 0, i) for i in range(n)]


def _compute_ms(model: torch.nn.Module, batch: int, size: int, repeat: int = 9) -> float:
    """Median model time for one batch (the median: this machine's timings are noisy)."""
    x = torch.randn(batch, 3, size, size)
    times = []
    with torch.inference_mode():
        for _ in range(2):
            model(x)
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def bench_serve(options: ServeBenchOptions = ServeBenchOptions(), *, progress: bool = True) -> dict:
    """Run the load against one fresh server per ``max_wait_ms``; return every figure."""
    import torchvision

    from fastload.load.transforms import EvalTransform
    from fastload.serve.batcher import DynamicBatcher
    from fastload.serve.http import make_server, serve_forever

    torch.manual_seed(options.seed)
    model = torchvision.models.get_model(options.model, weights=None, num_classes=1000).eval()
    one = _compute_ms(model, 1, options.image_size)
    full = _compute_ms(model, options.max_batch, options.image_size)
    cap1, capb = 1e3 / one, options.max_batch * 1e3 / full
    # auto: a little more than one-at-a-time serving sustains, half of what full batches sustain
    # (preprocessing, HTTP and this load generator share the same CPUs as the model)
    rate = float(options.rate) if options.rate != "auto" else min(cap1 * 1.2, capb * 0.5)
    bodies = _bodies(32, options.image_size + 32, options.seed)
    results = []
    for wait in options.waits_ms:
        batcher = DynamicBatcher(model, preprocess=EvalTransform(options.image_size, options.image_size + 32),
                                 max_batch=options.max_batch, max_wait_ms=wait, max_queue=options.max_queue,
                                 device="cpu", workers=options.workers).start()
        server = make_server(batcher, port=0)
        thread = serve_forever(server)
        port = server.server_address[1]
        try:
            if progress:
                print(f"max_wait_ms={wait:g}: {rate:.0f} requests/s for {options.duration_s:g}s ...", flush=True)
            res = run_load(port, bodies, rate, options.duration_s, options.max_requests, options.seed, wait)
            res.server = batcher.stats()
        finally:
            server.shutdown()
            thread.join()
            server.server_close()
            batcher.stop()
        results.append(res)
    return {"options": asdict(options), "compute_ms": {"batch_1": one, f"batch_{options.max_batch}": full},
            "capacity_per_s": {"batch_1": cap1, f"batch_{options.max_batch}": capb}, "offered_rate": rate,
            "runs": [r.summary() for r in results]}


def format_table(report: dict) -> str:
    o = report["options"]
    full = report["compute_ms"]["batch_{}".format(o["max_batch"])]
    lines = [f"{o['model']}, max_batch {o['max_batch']}, offered {report['offered_rate']:.0f} requests/s "
             f"(Poisson, {o['duration_s']:g}s); model alone: batch 1 {report['compute_ms']['batch_1']:.1f} ms, "
             f"batch {o['max_batch']} {full:.1f} ms",
             f"{'max_wait_ms':>11}{'throughput/s':>14}{'p50 ms':>9}{'p99 ms':>9}{'p99 bound':>12}{'mean batch':>12}"
             f"{'rejected':>10}{'errors':>8}"]
    for r in report["runs"]:
        bound = r["max_wait_ms"] + 2 * full  # the window plus two full-batch computes
        mark = "ok" if r["p99_ms"] <= bound else "over"
        lines.append(f"{r['max_wait_ms']:>11g}{r['throughput']:>14.1f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
                     f"{bound:>7.0f} {mark:<4}{r['mean_batch_size']:>12.1f}{r['rejected']:>10}{r['errors']:>8}")
    lines.append("p99 bound = max_wait_ms + 2 x the model's full-batch time")
    return "\n".join(lines)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1)
