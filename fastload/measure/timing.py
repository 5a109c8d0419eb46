"""``StepTimer``: where each training step's time goes, on the host and on the GPU timeline.

Owns: per-step records (host time blocked on the loader, host→device copy, compute), the
GPU idle gap measured with CUDA events, warm-up exclusion, percentiles, and the summary
(``StageResult``). NVML sampling lives here too (``NvmlSampler``), and the two helpers the
per-image benchmarks share: ``one_torch_thread()`` (torch's intra-op pool at one thread, as
in a loader worker) and ``preset_ms_per_image`` (a preset's ``from_bytes`` over a list).

Host clocks measure the host. On CUDA the host runs ahead of the GPU, so "the host waited
for data" does not mean "the GPU waited": the GPU idle gap is taken on the GPU's own
timeline, between the event recorded after step i's work and the event recorded before
step i+1's (``torch.cuda.Event(enable_timing=True)``), which is exactly the time the GPU
had nothing of this loop to do. Without CUDA there is no GPU timeline: idle is the part
of each step's wall time outside compute, labelled ``idle_source = "host-clock"``.

Must not: run the model (``train.py``) or print.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fastload.stats import percentiles  # re-exported: it lives at the edge, shared with serve/

__all__ = ["StepRecord", "StageResult", "StepTimer", "NvmlSampler", "percentiles", "summarize_records",
           "one_torch_thread", "preset_ms_per_image"]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op thread count at 1 inside the block (what a DataLoader worker runs with),
    put back afterwards, so per-image timings measure one core."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def preset_ms_per_image(transform: Any, blobs: Sequence[bytes], seed: int) -> float:
    """Milliseconds per image of ``transform.from_bytes`` over ``blobs``, crops drawn from one
    generator seeded with ``seed`` (the same crops for every list timed with the same seed)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    for b in blobs:
        transform.from_bytes(b, g)
    return (time.perf_counter() - t0) * 1e3 / len(blobs)


@dataclass
class StepRecord:
    """One measured step. Times in seconds; ``t0`` is relative to the first measured step."""

    step: int
    t0: float
    data_wait: float
    copy: float
    compute: float
    total: float
    gpu_busy: float | None = None
    gpu_idle: float | None = None
    images: int = 0


@dataclass
class StageResult:
    """What one stage measured. Fractions are of the measured wall time (warm-up excluded).

    Attributes:
        images_per_s, steps_per_s: throughput over the measured steps.
        data_wait_fraction: host time blocked on the loader / wall time.
        copy_fraction, compute_fraction: the same for the copy and the step's compute.
        gpu_idle_fraction: on CUDA, GPU idle gaps / GPU timeline span (CUDA events); without
            CUDA, 1 - compute / wall time (``idle_source == "host-clock"``).
        percentiles_ms: p50/p90/p99/mean of each per-step time, in milliseconds.
        nvml: mean GPU utilisation and memory sampled by NVML, when available.
        records: the per-step records.
    """

    name: str
    device: str
    batch_size: int
    steps: int
    warmup: int
    images_per_s: float
    steps_per_s: float
    data_wait_fraction: float
    copy_fraction: float
    compute_fraction: float
    gpu_idle_fraction: float
    idle_source: str
    percentiles_ms: dict[str, dict[str, float]]
    nvml: dict[str, float] | None = None
    records: list[StepRecord] = field(default_factory=list, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self, *, with_records: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_records:
            d.pop("records")
        return d


class StepTimer:
    """Collects ``StepRecord``s. Call ``begin()``, ``got_batch()``, ``copied()``, ``computed(n)`` per step.

    On CUDA, ``copied()`` records a start event and ``computed()`` an end event on the
    current stream; ``finish()`` synchronises once and turns the events into busy and idle
    times. At most ``max_in_flight`` steps are queued ahead of the GPU (the timer waits on
    the end event of the step that many steps back), as a loop that logs ``loss.item()``
    with a short lag would.
    """

    def __init__(self, device: str = "cpu", *, warmup: int = 0, max_in_flight: int = 2) -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.warmup = warmup
        self.max_in_flight = max_in_flight
        self._rows: list[list[float]] = []
        self._events: list[tuple[Any, Any]] = []
        self._step = 0
        self._origin: float | None = None

    def begin(self) -> None:
        self._t = [time.perf_counter()]

    def got_batch(self) -> None:
        self._t.append(time.perf_counter())

    def copied(self) -> None:
        self._t.append(time.perf_counter())
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._start_event = start

    def computed(self, images: int) -> None:
        if self.cuda:
            import torch

            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start_event, end))
            if len(self._events) > self.max_in_flight:
                self._events[-1 - self.max_in_flight][1].synchronize()
        t3 = time.perf_counter()
        t0, t1, t2 = self._t
        if self._step == self.warmup:
            self._origin = t0
        self._rows.append([self._step, t0, t1 - t0, t2 - t1, t3 - t2, t3 - t0, images])
        self._step += 1

    def finish(self) -> list[StepRecord]:
        """The measured records (warm-up dropped), with GPU busy/idle filled in on CUDA."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
        origin = self._origin or 0.0
        records = []
        for k, (step, t0, wait, copy, compute, total, n) in enumerate(self._rows):
            if step < self.warmup:
                continue
            rec = StepRecord(int(step), t0 - origin, wait, copy, compute, total, images=int(n))
            if self.cuda:
                start, end = self._events[k]
                rec.gpu_busy = start.elapsed_time(end) / 1e3
                if k > 0:  # gap on the GPU timeline between the previous step's end and this start
                    rec.gpu_idle = max(0.0, self._events[k - 1][1].elapsed_time(start) / 1e3)
            records.append(rec)
        return records

    def summarize(self, name: str, batch_size: int, *, nvml: dict[str, float] | None = None) -> StageResult:
        records = self.finish()
        if not records:
            raise ValueError(f"stage {name!r}: no measured steps (steps must be > 0 after {self.warmup} warm-up)")
        return summarize_records(records, name=name, device=str(self.device), batch_size=batch_size,
                                 warmup=self.warmup, nvml=nvml)


def summarize_records(records: list[StepRecord], *, name: str, device: str, batch_size: int, warmup: int,
                      nvml: dict[str, float] | None = None) -> StageResult:
    """The ``StageResult`` of measured ``records`` (one run, or the rounds of a stage pooled).

    GPU idle comes from the CUDA-event fields when the records have them, else from host clocks.
    """
    if not records:
        raise ValueError(f"stage {name!r}: no measured steps")
    cuda = any(r.gpu_busy is not None for r in records)
    wall = sum(r.total for r in records)
    images = sum(r.images for r in records)
    if cuda:
        gaps = sum(r.gpu_idle or 0.0 for r in records)
        span = sum(r.gpu_busy or 0.0 for r in records) + gaps
        idle = gaps / span if span > 0 else 0.0
        source = "cuda-events"
    else:
        idle = 1.0 - sum(r.compute for r in records) / wall
        source = "host-clock"
    pct = {key: {k: v * 1e3 for k, v in percentiles([getattr(r, key) for r in records]).items()}
           for key in ("data_wait", "copy", "compute", "total")}
    if cuda:
        pct["gpu_busy"] = {k: v * 1e3 for k, v in percentiles([r.gpu_busy or 0.0 for r in records]).items()}
        pct["gpu_idle"] = {k: v * 1e3 for k, v in percentiles([r.gpu_idle or 0.0 for r in records]).items()}
    return StageResult(
        name=name, device=device, batch_size=batch_size, steps=len(records), warmup=warmup,
        images_per_s=images / wall, steps_per_s=len(records) / wall,
        data_wait_fraction=sum(r.data_wait for r in records) / wall,
        copy_fraction=sum(r.copy for r in records) / wall,
        compute_fraction=sum(r.compute for r in records) / wall,
        gpu_idle_fraction=max(0.0, min(1.0, idle)), idle_source=source,
        percentiles_ms=pct, nvml=nvml, records=records)


class NvmlSampler:
    """Samples GPU utilisation and memory with NVML (what ``nvidia-smi dmon`` shows) in a thread.

    ``result()`` is None when NVML is not installed or no GPU answers.
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.05) -> None:
        self.index, self.interval = device_index, interval_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None

    def __enter__(self) -> NvmlSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception:
            return self
        self._thread = threading.Thread(target=self._run, name="fastload-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(self.interval):
            try:
                util = pynvml.nvmlDeviceGetUtilizationRates(self._handle)
                mem = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
                self._samples.append((float(util.gpu), mem.used / 1e9))
            except Exception:
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            try:
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:
                pass

    def result(self) -> dict[str, float] | None:
        if not self._samples:
            return None
        util, mem = zip(*self._samples)
        return {"gpu_util_mean_percent": float(np.mean(util)), "memory_used_gb_mean": float(np.mean(mem)),
                "samples": len(self._samples)}
