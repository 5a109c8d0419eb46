"""``fastload bench serve``: the seed's serving before/after, side by side, under open-loop load on loopback.

Owns: the three serving configurations compared, the offered loads (fractions of an
estimated capacity, up to and past saturation), an open-loop Poisson load generator over
HTTP on 127.0.0.1, interleaved rounds, and the table.

- ``before``: the seed's service. One request at a time is decoded with Pillow (full
  decode, torchvision resize and center crop: one preprocessing thread, as when the
  request thread decodes), and then waits up to 50 ms for a full batch (the window starts
  when its decode ends: ``window_from="ready"``).
- ``after 8ms``: fastload's preprocessing (libjpeg-turbo with DCT-domain scaling, the
  eval preset) on every CPU this process may use, a window of 8 ms with a cap of
  ``max_batch``.
- ``after greedy``: the same with no window (``max_wait_ms=0``): the model takes whatever
  arrived while it was busy.

Every configuration does the same work to the same output: an eval-preset crop of every
image (same geometry; the pixels differ only by decoder rounding and DCT scaling) through
the same model, answered as top-5 JSON over the same HTTP front. The model is a
torchvision model on the CPU, or ``simulated``: a device that sleeps ``A + B*n`` ms per
batch of ``n`` (freeing the CPU as a GPU does), so a CPU machine shows what batching is
worth to a GPU. Device busy fraction = time in the model call (with the normalisation
on the device) / wall time of the run.

Rounds interleave (``measure.rounds.interleave``): round 1 runs every (load, configuration)
point once, then round 2 with the order rotated by one place, and so on, so drift on the
machine reaches every configuration alike and no point always follows the same one; each
point reports the median over rounds and the range.

Lives in ``bench/`` (the benchmarks' room, above ``serve/`` and ``measure/``): it drives ``serve/``
from outside, as a client would. Must not: be imported by ``serve/``; assert performance.
"""

from __future__ import annotations

import http.client
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from fastload.image import DEFAULT_SIZE
from fastload.stats import percentiles
from fastload.serve.policy import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE

__all__ = ["ServeBenchOptions", "bench_serve", "run_load", "format_table", "PillowEval", "CONFIGS"]

# name -> (preprocess, preprocessing threads ("all" = every usable CPU), max_wait_ms)
CONFIGS = {"before": ("pillow", 1, 50.0), "after 8ms": ("fastload", "all", 8.0),
           "after greedy": ("fastload", "all", 0.0)}


@dataclass(frozen=True, kw_only=True)
class ServeBenchOptions:
    """What ``fastload bench serve`` runs; see its ``--help``."""

    model: str = "simulated"
    batch_ms: str | None = "4+0.25*n"
    max_batch: int = DEFAULT_MAX_BATCH
    loads: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5)  # fractions of the estimated capacity
    rates: tuple[float, ...] | None = None  # requests/s; overrides loads
    configs: tuple[str, ...] = tuple(CONFIGS)
    rounds: int = 2
    duration_s: float = 5.0
    max_requests: int = 5000
    image_size: int = DEFAULT_SIZE
    workers: int | None = None
    max_queue: int = DEFAULT_MAX_QUEUE
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"Unknown value {self.device!r} for device. Valid values are 'cpu', 'auto', 'cuda[:N]'.")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"Unknown configs {unknown}. Valid values are {', '.join(CONFIGS)}.")
        if self.rounds < 1 or self.duration_s <= 0 or self.max_requests < 1 or self.max_batch < 1:
            raise ValueError("rounds, max_requests and max_batch must be >= 1 and duration_s > 0")
        if self.rates is not None and (not self.rates or min(self.rates) <= 0):
            raise ValueError(f"rates must be positive requests/s, got {self.rates}")
        if self.rates is None and (not self.loads or min(self.loads) <= 0):
            raise ValueError(f"loads must be positive fractions of capacity, got {self.loads}")


class PillowEval:
    """The seed's preprocessing: Pillow decodes the whole image, torchvision resizes and crops it."""

    def __init__(self, size: int, resize: int) -> None:
        self.size, self.resize = size, resize

    def __call__(self, data: bytes) -> torch.Tensor:
        import torchvision.transforms.functional as F
        from PIL import Image

        img = Image.open(io.BytesIO(data)).convert("RGB")
        img = F.center_crop(F.resize(img, self.resize, antialias=True), self.size)
        return F.pil_to_tensor(img)


@dataclass
class LoadResult:
    config: str
    offered_rate: float
    sent: int = 0
    ok: int = 0
    rejected: int = 0
    errors: int = 0
    seconds: float = 0.0
    busy_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    mean_batch_size: float = 0.0

    def summary(self) -> dict:
        pct = percentiles(self.latencies_ms)
        return {"config": self.config, "offered_rate": self.offered_rate, "sent": self.sent, "ok": self.ok,
                "rejected": self.rejected, "errors": self.errors,
                "throughput": self.ok / self.seconds if self.seconds else 0.0,
                "p50_ms": pct["p50"], "p99_ms": pct["p99"],
                "busy_fraction": self.busy_s / self.seconds if self.seconds else 0.0,
                "mean_batch_size": self.mean_batch_size}


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


def run_load(port: int, bodies: list[bytes], rate: float, duration_s: float, max_requests: int, *,
             seed: int = 0, config: str = "") -> LoadResult:
    """Send Poisson arrivals at ``rate``/s to ``127.0.0.1:port`` for ``duration_s`` (or ``max_requests``)."""
    rng = np.random.default_rng(seed)
    result = LoadResult(config, rate)
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


def _compute_ms(model: torch.nn.Module, batch: int, size: int, device: torch.device, repeat: int = 5) -> float:
    """Median model time for one batch (the median: timings on a shared machine are noisy)."""
    model = model.to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        model(x)
        sync()
        for _ in range(repeat):
            t0 = time.perf_counter()
            model(x)
            sync()
            times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _capacity(options: ServeBenchOptions, model, bodies: list[bytes], workers: int, device: torch.device) -> dict:
    """Requests/s the device sustains with full batches, and what fastload's preprocessing sustains."""
    from fastload.load.transforms import EvalTransform
    from fastload.serve.models import SimulatedDevice

    size = options.image_size
    if isinstance(model, SimulatedDevice):
        full_ms = model.batch_ms(options.max_batch)
    else:
        full_ms = _compute_ms(model, options.max_batch, size, device)
    pre = EvalTransform(size, size + 32)
    t0 = time.perf_counter()
    for b in bodies:
        pre.from_bytes(b)
    pre_s = (time.perf_counter() - t0) / len(bodies)
    device = options.max_batch * 1e3 / full_ms
    preprocess = workers / pre_s
    return {"full_batch_ms": full_ms, "device_per_s": device, "preprocess_per_s": preprocess,
            "estimate_per_s": min(device, preprocess)}


def _serve_once(options: ServeBenchOptions, model, name: str, rate: float, bodies: list[bytes], workers: int,
                seed: int, device: torch.device) -> LoadResult:
    from fastload.load.transforms import EvalTransform
    from fastload.serve.batcher import DynamicBatcher
    from fastload.serve.http import FrontOptions, make_server, serve_forever

    kind, threads, wait = CONFIGS[name]
    size = options.image_size
    pre = PillowEval(size, size + 32) if kind == "pillow" else EvalTransform(size, size + 32)
    pre(bodies[0]) if kind == "pillow" else pre.from_bytes(bodies[0])  # imports and first-call costs: untimed
    batcher = DynamicBatcher(model, preprocess=pre, max_batch=options.max_batch, max_wait_ms=wait,
                             max_queue=options.max_queue, device=str(device),
                             workers=workers if threads == "all" else threads, name=name,
                             window_from="ready" if kind == "pillow" else "arrival").start()
    server = make_server(batcher, port=0, options=FrontOptions(request_timeout_s=60.0, max_connections=1024))
    thread = serve_forever(server)
    try:
        before = batcher.stats()
        res = run_load(server.server_address[1], bodies, rate, options.duration_s, options.max_requests,
                       seed=seed, config=name)
        after = batcher.stats()
        res.busy_s = after["busy_s"] - before["busy_s"]
        batches = after["batches"] - before["batches"]
        res.mean_batch_size = (after["completed"] - before["completed"]) / batches if batches else 0.0
    finally:
        server.shutdown()
        thread.join()
        server.close_all(2.0)
        batcher.stop()
    return res


_POINT_KEYS = ("throughput", "p50_ms", "p99_ms", "busy_fraction", "mean_batch_size")


def _median_point(runs: list[dict], label: str = "config", keys: tuple[str, ...] = _POINT_KEYS) -> dict:
    """One load point over its rounds: the median of each of ``keys`` with its range; counts summed."""
    out = {label: runs[0][label], "offered_rate": runs[0]["offered_rate"], "rounds": len(runs)}
    for key in keys:
        vals = [r[key] for r in runs]
        out[key] = float(np.median(vals))
        out[f"{key}_range"] = [float(min(vals)), float(max(vals))]
    for key in ("sent", "ok", "rejected", "errors"):
        out[key] = int(sum(r[key] for r in runs))
    return out


def bench_serve(options: ServeBenchOptions = ServeBenchOptions(), *, progress: bool = True) -> dict:
    """Run every (round, load, configuration) point against a fresh server; return every figure."""
    from fastload.measure.rounds import interleave
    from fastload.serve.models import build_model
    from fastload.system import available_cpus, resolve_device

    torch.manual_seed(options.seed)
    model = build_model(options.model, batch_ms=options.batch_ms if options.model == "simulated" else None)
    workers = options.workers or available_cpus()
    device = resolve_device(options.device, what="--device")
    bodies = _bodies(32, options.image_size + 32, options.seed)
    capacity = _capacity(options, model, bodies, workers, device)
    rates = list(options.rates) if options.rates else [f * capacity["estimate_per_s"] for f in options.loads]

    def measure(point: tuple[float, str], rnd: int) -> dict:
        rate, name = point
        if progress:
            print(f"round {rnd + 1}/{options.rounds}: {name:<12} at {rate:7.1f} requests/s for "
                  f"{options.duration_s:g}s ...", flush=True)
        return _serve_once(options, model, name, rate, bodies, workers, options.seed + rnd, device).summary()

    arms = interleave([(rate, name) for rate in rates for name in options.configs], options.rounds, measure)
    raw = {(name, rate): arms[(rate, name)].values for rate in rates for name in options.configs}
    points = [_median_point(raw[(name, rate)]) for rate in rates for name in options.configs]
    return {"options": asdict(options), "device": str(device), "workers": workers, "capacity": capacity,
            "rates": rates,
            "points": points, "runs": [r for runs in raw.values() for r in runs]}


def _rng(point: dict, key: str, fmt: str) -> str:
    lo, hi = point[f"{key}_range"]
    return format(point[key], fmt) if point["rounds"] == 1 else f"{point[key]:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def format_table(report: dict) -> str:
    o, cap = report["options"], report["capacity"]
    model = f"simulated device ({o['batch_ms']} ms per batch of n)" if o["model"] == "simulated" else o["model"]
    lines = [f"{model} on {report['device']}, max_batch {o['max_batch']}, {o['rounds']} interleaved round(s) x "
             f"{o['duration_s']:g}s per point, Poisson arrivals over loopback HTTP",
             f"capacity estimate: device {cap['device_per_s']:.0f}/s with full batches, fastload preprocessing "
             f"{cap['preprocess_per_s']:.0f}/s on {report['workers']} thread(s)",
             f"{'offered/s':>9}  {'config':<13}{'throughput/s':>22}{'vs before':>10}{'p50 ms':>20}{'p99 ms':>22}"
             f"{'busy':>6}{'batch':>7}{'rejected':>9}{'errors':>7}"]
    base = {p["offered_rate"]: p for p in report["points"] if p["config"] == "before"}
    for p in report["points"]:
        ref = base.get(p["offered_rate"])
        ratio = f"{p['throughput'] / ref['throughput']:.2f}x" if ref and ref["throughput"] else "-"
        lines.append(f"{p['offered_rate']:>9.0f}  {p['config']:<13}{_rng(p, 'throughput', '.1f'):>22}{ratio:>10}"
                     f"{_rng(p, 'p50_ms', '.1f'):>20}{_rng(p, 'p99_ms', '.1f'):>22}{p['busy_fraction']:>6.0%}"
                     f"{p['mean_batch_size']:>7.1f}{p['rejected']:>9}{p['errors']:>7}")
    lines.append("medians over rounds [min-max]; p50/p99 over answered requests; busy = model time / wall time; "
                 "rejected = 503 (queue full)")
    return "\n".join(lines)


def to_json(report: dict) -> str:
    return json.dumps(report, indent=1)
