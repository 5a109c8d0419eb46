"""What the serving path reports: histograms, the Prometheus text format, and Chrome traces.

Owns: ``Histogram`` (fixed buckets, cumulative as Prometheus wants them, thread-safe),
``StageHistograms`` (one per request stage: queued, preprocess, batch assembly, compute,
total; and the batch size), ``render_prometheus()`` (the text exposition format 0.0.4)
and ``trace_events()`` (the Chrome / Perfetto trace of recent requests).

Why the exposition format is written here and not with ``prometheus_client``: it is a
plain line format (``# HELP``, ``# TYPE``, ``name{label="v"} value``; histograms as
cumulative ``_bucket{le=...}`` plus ``_sum`` and ``_count``) and writing it takes fewer
lines than adapting ``prometheus_client``'s global registry to per-server batchers, with
no new runtime dependency. The tests parse our output with ``prometheus_client``'s own
parser (``text_string_to_metric_families``), so a format mistake fails there.

Must not: know about HTTP or batching decisions; it only counts and formats.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["Histogram", "StageHistograms", "Metric", "render_prometheus", "serving_metrics", "trace_events",
           "LATENCY_BUCKETS_S", "STAGES"]

# seconds; from well under a millisecond (a tiny model on a GPU) to past typical deadlines
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STAGES = ("queued", "preprocess", "batch_assembly", "compute", "total")


class Histogram:
    """Counts of observations per bucket (upper bounds ``bounds``, plus +Inf), their sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError(f"histogram bounds must be a non-empty increasing sequence, got {bounds!r}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.bounds, value)] += 1
            self._sum += value

    def snapshot(self) -> tuple[list[tuple[float, int]], float, int]:
        """``([(upper bound, cumulative count), ..., (inf, total)], sum, count)``."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, c in zip((*self.bounds, math.inf), counts):
            running += c
            cumulative.append((bound, running))
        return cumulative, total, running


class StageHistograms:
    """One latency histogram per request stage, and one of batch sizes."""

    def __init__(self) -> None:
        self.stages = {s: Histogram(LATENCY_BUCKETS_S) for s in STAGES}
        self.batch_size = Histogram(BATCH_BUCKETS)

    def observe_request(self, timing: Any) -> None:
        """Record one finished request (a ``RequestTiming``)."""
        t = timing
        pre_start = t.preprocess_start or t.batched
        spans = {"queued": pre_start - t.queued,
                 "preprocess": (t.preprocess_end - t.preprocess_start) if t.preprocess_start else 0.0,
                 "batch_assembly": t.batched - (t.preprocess_end or t.queued),
                 "compute": t.compute_end - t.compute_start,
                 "total": t.returned - t.queued}
        for name, seconds in spans.items():
            self.stages[name].observe(max(0.0, seconds))


class Metric:
    """One metric family for ``render_prometheus``: a name, a type, help, and its samples.

    ``samples`` holds ``(labels, value)`` for counters and gauges, ``(labels, Histogram)``
    for histograms.
    """

    def __init__(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], Any]]) -> None:
        if kind == "counter" and not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total (Prometheus naming), got {name!r}")
        if kind not in ("counter", "gauge", "histogram"):
            raise ValueError(f"Unknown value {kind!r} for argument kind. Valid values are counter, gauge, histogram.")
        self.name, self.kind, self.help, self.samples = name, kind, help_text, list(samples)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


def render_prometheus(metrics: Iterable[Metric]) -> str:
    """The Prometheus text exposition format (version 0.0.4) for ``metrics``."""
    lines: list[str] = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        for labels, value in m.samples:
            if m.kind == "histogram":
                buckets, total, count = value.snapshot()
                for bound, c in buckets:
                    lines.append(f"{m.name}_bucket{_labels({**labels, 'le': _num(bound)})} {c}")
                lines.append(f"{m.name}_sum{_labels(labels)} {_num(total)}")
                lines.append(f"{m.name}_count{_labels(labels)} {count}")
            else:
                lines.append(f"{m.name}{_labels(labels)} {_num(value)}")
    return "\n".join(lines) + "\n"


def trace_events(done: Sequence[Any], process_name: str = "fastload DynamicBatcher") -> dict[str, Any]:
    """Chrome trace (Perfetto) of finished requests: queued, preprocess, waiting for a batch, compute."""
    if not done:
        return {"traceEvents": []}
    origin = min(t.queued for t in done)
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": process_name}}]
    seen_batches = set()
    for t in done:
        spans = [("queued", t.queued, t.preprocess_start or t.batched),
                 ("preprocess", t.preprocess_start, t.preprocess_end),
                 ("wait for batch", t.preprocess_end or t.queued, t.batched),
                 ("compute", t.compute_start, t.compute_end)]
        for name, a, b in spans:
            if a and b and b >= a:
                events.append({"name": name, "ph": "X", "pid": 1, "tid": 1000 + t.id % 100_000,
                               "ts": (a - origin) * 1e6, "dur": (b - a) * 1e6,
                               "args": {"request": t.id, "batch_size": t.batch_size, "ok": t.ok}})
        if t.compute_start and t.compute_start not in seen_batches:
            seen_batches.add(t.compute_start)
            events.append({"name": f"batch of {t.batch_size}", "ph": "X", "pid": 1, "tid": 1,
                           "ts": (t.compute_start - origin) * 1e6, "dur": (t.compute_end - t.compute_start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def serving_metrics(target: Any, http: dict[str, Any]) -> list[Metric]:
    """The ``/metrics`` families for ``target`` (a ``DynamicBatcher`` or a ``Router``) and the front's counters."""
    batchers = target.batchers() if hasattr(target, "batchers") else [target]
    st = [(b, b.stats()) for b in batchers]
    unhealthy = set(target.unhealthy()) if hasattr(target, "unhealthy") else set()
    lab = [({"replica": b.name}, s) for b, s in st]
    return [
        Metric("fastload_http_responses_total", "counter", "HTTP responses sent, by status code.",
               [({"status": k}, v) for k, v in http["responses"].items()]),
        Metric("fastload_http_connections", "gauge", "Open HTTP connections.", [({}, http["connections"])]),
        Metric("fastload_http_refused_connections_total", "counter",
               "Connections answered 503 by the accept loop.",
               [({}, http["refused_connections"])]),
        Metric("fastload_queue_depth", "gauge", "Requests accepted and not yet sent to the model.",
               [(lb, s["waiting"]) for lb, s in lab]),
        Metric("fastload_in_flight", "gauge", "Requests accepted and not yet answered.",
               [(lb, s["in_flight"]) for lb, s in lab]),
        Metric("fastload_requests_rejected_total", "counter", "Requests refused because the queue was full.",
               [(lb, s["rejected"]) for lb, s in lab]),
        Metric("fastload_requests_expired_total", "counter",
               "Requests dropped from the queue past their deadline.",
               [(lb, s["expired"]) for lb, s in lab]),
        Metric("fastload_batch_size", "histogram", "Requests per model batch.",
               [({"replica": b.name}, b.histograms.batch_size) for b, _ in st]),
        Metric("fastload_stage_seconds", "histogram",
               "Per-request time in each stage: queued, preprocess, batch_assembly, compute, total.",
               [({"replica": b.name, "stage": name}, h) for b, _ in st for name, h in b.histograms.stages.items()]),
        Metric("fastload_device_busy_fraction", "gauge", "Model compute time / time since warm-up.",
               [(lb, s["device_busy_fraction"]) for lb, s in lab]),
        Metric("fastload_decodes_total", "counter",
               "Images decoded, by where (gpu: nvJPEG batches, cpu: the pool).",
               [({**lb, "where": w}, s[f"{w}_decoded"]) for lb, s in lab for w in ("gpu", "cpu")]),
        Metric("fastload_gpu_decode_fallbacks_total", "counter", "GPU-decode batches that fell back to the CPU.",
               [(lb, s["gpu_decode_fallbacks"]) for lb, s in lab]),
        Metric("fastload_replica_ready", "gauge", "1 while the replica is warmed up and healthy.",
               [(lb, int(s["ready"] and b.name not in unhealthy)) for (b, s), (lb, _) in zip(st, lab)]),
    ]
