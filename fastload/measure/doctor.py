"""``fastload doctor``: what this machine offers a data pipeline, and what fastload will pick.

Owns: gathering CPUs (affinity, cgroup quota), GPUs, local world size, the worker plan,
the pinned-memory budget and the environment record (``env.py``, the same one written
beside every result) into one report, and printing it. Reads only; changes nothing.

Why in ``measure/``: the machine facts are the context of every measurement (the same
record as ``env.py``, which ``report.py`` writes beside every result); ``profiling/`` quotes
them from above. Must not: import ``profiling/`` or ``bench/``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from fastload.image import DEFAULT_SIZE
from fastload.measure.env import environment, package_version

__all__ = ["doctor_report", "format_doctor", "package_version", "PINNED_FRACTION"]

#: Pinned (page-locked) memory cannot be swapped or reclaimed; past about a quarter of RAM
#: the rest of the system (page cache for the dataset included) starts to suffer.
PINNED_FRACTION = 0.25


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def doctor_report(*, batch_size: int = 256, image_size: int = DEFAULT_SIZE, prefetch_factor: int = 2) -> dict[str, Any]:
    """Everything ``fastload doctor`` prints, as a dict (``--json`` writes it as is)."""
    import torch

    from fastload.image.fast import fallback_counts, jpeg_backend
    from fastload.load.workers import shm_plan, worker_plan
    from fastload.system import dali_available

    plan = worker_plan()
    env = environment()
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": p.name, "memory_gb": round(p.total_memory / 1e9, 1),
                         "capability": f"{p.major}.{p.minor}"})
    ram = _ram_bytes()
    batch_bytes = batch_size * 3 * image_size * image_size  # a uint8 batch
    in_flight = max(1, plan.workers) * prefetch_factor + 2  # worker queues + pin thread + prefetcher
    pinned = batch_bytes * in_flight
    budget = int(ram * PINNED_FRACTION)
    return {
        "cpus": asdict(plan.cpus),
        "local_processes": plan.local_processes,
        "local_processes_source": plan.local_source,
        "local_world_size_env": os.environ.get("LOCAL_WORLD_SIZE"),
        "gpus": gpus,
        "workers": {"recommended": plan.workers, "cpus_per_process": plan.cpus_per_process,
                    "main_threads": plan.main_threads, "rule": plan.rule, "explain": plan.explain()},
        "pinned_memory": {"ram_bytes": ram, "budget_bytes": budget, "batch_bytes": batch_bytes,
                          "batches_in_flight": in_flight, "needed_bytes": pinned, "ok": pinned <= budget,
                          "batch_size": batch_size, "image_size": image_size, "prefetch_factor": prefetch_factor},
        "environment": env,
        "dali_available": dali_available(),
        "jpeg_region_decoder": jpeg_backend(),
        # /dev/shm: what worker processes keep there (uint8 preset batches; ToTensor floats are 4x)
        "shm": asdict(shm_plan(plan.workers, prefetch_factor, batch_bytes + 8 * batch_size)),
        "region_decode_fallbacks": fallback_counts(),
    }


def format_doctor(r: dict[str, Any]) -> str:
    from fastload.load.workers import ShmPlan

    gb = 1e9
    pm = r["pinned_memory"]
    lines = ["CPU",
             *("  " + line for line in r["workers"]["explain"].splitlines()),
             "GPU"]
    if r["gpus"]:
        lines += [f"  cuda:{g['index']} {g['name']} ({g['memory_gb']} GB, sm {g['capability']})" for g in r["gpus"]]
    else:
        lines.append("  none visible: loaders run on the CPU, DALI in CPU mode, recipes simulate the GPU step")
    lines += [
        f"  LOCAL_WORLD_SIZE: {r['local_world_size_env'] or 'unset'}",
        "Recommended",
        f"  DataLoader(num_workers={r['workers']['recommended']}) per process  (num_workers='auto' picks this)",
        f"  pinned memory: {'on' if r['gpus'] else 'off (no GPU)'}",
        "Pinned-memory budget",
        f"  RAM {pm['ram_bytes'] / gb:.1f} GB; budget {PINNED_FRACTION:.0%} = {pm['budget_bytes'] / gb:.1f} GB",
        f"  batch {pm['batch_size']} x {pm['image_size']}px uint8 = {pm['batch_bytes'] / 1e6:.1f} MB x "
        f"{pm['batches_in_flight']} in flight (workers x prefetch_factor {pm['prefetch_factor']} + 2) = "
        f"{pm['needed_bytes'] / 1e6:.0f} MB: " + ("OK" if pm["ok"] else
                                                   "OVER BUDGET: lower prefetch_factor, workers or batch size"),
        "/dev/shm (DataLoader worker processes pass batches through it)",
        "  " + ShmPlan(**r["shm"]).explain(),
        "  (float32 batches from ToTensor() need 4x that; DataLoader(backend='threads') needs none)",
        "Software",
    ]
    v = r["environment"]
    lines += [f"  python {v['python']} on {v['platform']}",
              f"  torch {v['torch']} (CUDA {v['cuda'] or 'none'}), torchvision {v['torchvision']}",
              f"  DALI: {v['dali'] or 'not installed (pip install fastload[dali])'}",
              f"  JPEG: simplejpeg {v['simplejpeg']}, region decode: {r['jpeg_region_decoder']}"
              + (" (fastload's compiled decoder, on the system's libjpeg-turbo)"
                 if r["jpeg_region_decoder"] == "libjpeg-turbo" else f" ({v['nvimgcodec']})" if v["nvimgcodec"] else
                 " (for crop-only decoding: reinstall fastload where gcc and libjpeg-dev are installed, or "
                 "pip install 'fastload[fast]')"),
              f"  pillow {v['pillow']}, lmdb {v['lmdb']}"]
    return "\n".join(lines)
