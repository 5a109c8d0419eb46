"""GPU busy and idle from a Kineto (``torch.profiler``) Chrome trace of a window of steps.

Owns: the interval arithmetic. Busy = the union of every CUDA kernel, memcpy and memset
interval (Kineto's ``kernel``, ``gpu_memcpy``, ``gpu_memset`` categories); the window
runs from the first ``fastload.data_wait`` annotation to ``fastload.window_end`` (both
recorded on the host by ``_probe.py``, on the same clock as the GPU activity in the
trace); idle = window - busy; input-bound idle = idle that overlaps a
``fastload.data_wait`` annotation (the host was blocked in ``next()`` on the loader).

Must not: run the profiler (``_probe.py``) or import torch.
"""

from __future__ import annotations

from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping ``(start, end)`` intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def complement(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    gaps, cursor = [], lo
    for s, e in union(clip(intervals, lo, hi)):
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < hi:
        gaps.append((cursor, hi))
    return gaps


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def gpu_timeline(trace: dict[str, Any]) -> dict[str, Any]:
    """Busy / idle / input-bound idle of the profiled window, from ``prof.export_chrome_trace`` JSON."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_CATEGORIES]
    waits = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if e.get("name") == "fastload.data_wait" and e.get("cat") != "gpu_user_annotation"]
    ends = [float(e["ts"]) for e in events if e.get("name") == "fastload.window_end"
            and e.get("cat") != "gpu_user_annotation"]
    if not waits:
        return {"skipped": "no fastload.data_wait annotation in the Kineto trace"}
    lo = min(s for s, _ in waits)
    hi = max(ends) if ends else max(e for _, e in waits)
    window = hi - lo
    if window <= 0:
        return {"skipped": "empty Kineto window"}
    busy = union(clip(gpu, lo, hi))
    idle = complement(busy, lo, hi)
    input_idle = intersect(idle, clip(waits, lo, hi))
    memcpy = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") == "gpu_memcpy"
              and "HtoD" in str(e.get("name", ""))]
    steps = len(waits)
    return {
        "window_ms": window / 1e3, "steps": steps, "gpu_events": len(gpu),
        "gpu_busy_fraction": length(busy) / window,
        "gpu_idle_fraction": length(idle) / window,
        "input_bound_idle_fraction": length(input_idle) / window,
        "htod_copy_fraction": length(union(clip(memcpy, lo, hi))) / window,
    }
