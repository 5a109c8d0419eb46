"""The verdict and the ranked recommendations of a profile, from a small model of the loader fitted
to the measurement; each recommendation with its predicted images/s ratio and its code change.

The gain model. Per step of the training loop: T the measured step time, ``bound`` the
input-bound share (host data wait without CUDA; GPU idle overlapping the wait on CUDA),
so a perfect loader gives a step of ``c = T * (1 - bound)`` and no change can beat
``1 / (1 - bound)``. One batch costs ``t_b = images * seconds per sample`` of loading,
``t_cpu = t_b * cpu share`` of it on a CPU. The step itself keeps ``k`` CPUs busy
(``step_cores``: the training process's CPU time over the step's own part, from ``next()``
returning to the next call, divided by its wall time: on a CPU device the model's compute, on a
GPU the host side that launches kernels). With ``P`` CPUs for this process and ``N`` workers
the predicted step is the ``t`` where

    t = max(c, t_b / N, (c * k + t_cpu) / P, c * k / max(1, P - ceil(min(N, t_cpu / t))))

i.e. no faster than the step, than N workers deliver, than the CPUs can do both; and a
multi-threaded step (``k > 1``) slows down when busy workers take CPUs it was using: an
OpenMP region runs at the pace of its slowest thread, so a CPU a worker takes even in part is
lost to the step. In the main process (``N = 0``) the step is ``c + t_b``. Every worker count
from 0 up to the plan's (more where samples mostly block on I/O) is predicted; the
recommendation is the plan's count ("auto") when it is within 2% of the best, else the fewest
workers within 2% of the best, and only when it gains 5%; when no count gains and the step
keeps most of a CPU busy the verdict is "CPU-bound training". The measured T stands for the
current worker count. A change that removes a measured part of the sample time (read, decode,
the float transforms) shrinks ``t_b`` and ``t_cpu`` by that part. Gains are capped at the
perfect-loader bound; a change predicted to gain under 2% is not offered. The figures and the
assumptions behind them (the CPUs available are the affinity/quota count, other users' load is
not subtracted) are in docs/profile-advice.md.

Must not: run anything, import torch.
"""

from __future__ import annotations

import math
from typing import Any

from fastload.profiling._snippet import loader_snippet, store_snippet, uint8_snippet

INPUT_BOUND = 0.10  #: below this input-bound share faster loading cannot buy more than ~11%
PARTS = {"read": "opening files (PIL Image.open)", "decode": "image decode in PIL (load/convert)",
         "transform": "torchvision transforms", "other": "the dataset's own code outside PIL and transforms"}


def predict_step(n: int, *, c: float, tb: float, tcpu: float, cpus: int, step_cores: float = 0.0) -> float:
    """Predicted seconds per step with ``n`` loader workers (see the module doc's model).

    Args:
        n: worker processes (0: loading inside the training process, before each step).
        c: the step's own wall time (a perfect loader's step).
        tb: one batch's loading time on one CPU; tcpu: the part of it spent on a CPU.
        cpus: CPUs this training process may use.
        step_cores: CPUs the step itself keeps busy (its CPU time / its wall time).
    """
    if n == 0:
        return c + tb
    c_cpu = c * step_cores
    floor = max(c, tb / n, (c_cpu + tcpu) / cpus)

    def f(t: float) -> float:
        # a multi-threaded step (OpenMP) runs at the pace of its slowest thread: every core a busy worker
        # takes, even in part, is lost to it; the step keeps max(1, cpus - those cores) of its threads' pace
        load = min(n, tcpu / t)
        free = max(1, cpus - math.ceil(load - 0.05))
        return max(floor, c * max(1.0, step_cores / free))

    lo, hi = floor, max(floor, f(floor)) + 1e-12
    for _ in range(60):  # f falls as t grows: t = f(t) has one root between floor and f(floor)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > mid else (lo, mid)
    return hi


def change_to_verify(s: dict[str, Any]) -> dict[str, Any] | None:
    """What ``--verify-fix`` applies: the top recommendation fastload can apply from outside, else (nothing
    to apply, e.g. CPU-bound training) the worker count a user would try, with its predicted ratio."""
    for r in s["recommendations"]:
        if r.get("apply"):
            return {**r, "verify_why": "the top recommendation that can be applied from outside"}
    for p in s.get("predictions", []):
        if p.get("apply") and p["apply"].get("num_workers") != s["loader"]["num_workers"]:
            return {**p, "verify_why": "no recommendation to apply: checking the prediction that this worker "
                                       "count does not help"}
    return None


def _workers_value(n: int, plan_workers: int) -> Any:
    return "auto" if n == plan_workers and n > 0 else n


def recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """The verdict and the ranked ``{change, why, expected_gain, stage, code, apply}`` list for a summary.

    Also sets ``s["predictions"]``: the predicted images/s ratio of every worker count tried.
    """
    wait, idle, bound = s["data_wait_fraction"], s["gpu_idle_fraction"], s["input_bound_idle_fraction"]
    cuda = s["idle_source"] in ("cuda", "cuda-events")
    where = (f"the GPU was idle {idle:.0%} of measured time, {bound * 100:.0f} points of it while the training loop "
             "waited for the DataLoader" if cuda else
             f"the training loop waited for data {wait:.0%} of measured time (host clocks"
             + ("; no CUDA timeline: the GPU is idle at least while the step waits)" if has_gpu else
                "; no GPU: the step computes on the same CPUs as the loading)"))
    recs: list[dict[str, Any]] = []
    s["predictions"] = []
    loader = s["loader"]
    created = loader.get("created_at")
    if bound < INPUT_BOUND:
        host_idle = idle - bound if cuda else 0.0
        if host_idle >= 0.15:
            recs.append({"change": "remove host sync points in the step (loss.item(), .cpu(), printing every step); "
                         "then CUDA graphs or torch.compile for launch overhead", "stage": None,
                         "why": f"the GPU was idle {host_idle:.0%} of the time while the host was NOT waiting for data",
                         "expected_gain": 1.0 / (1.0 - host_idle)})
        recs.append({"change": "none on the loading side", "stage": None, "expected_gain": 1.0 / (1.0 - bound),
                     "why": f"compute-bound: faster loading will not help: only {bound:.0%} of the step was spent "
                            "waiting for data"})
        kind = "host-bound" if host_idle >= 0.15 else "compute-bound"
        return f"{kind}: {where}; faster loading will not help", recs

    samples = s["samples"]
    T = 1.0 / s["steps_per_s"]
    cap = 1.0 / max(1e-9, 1.0 - bound)
    c = T * (1.0 - bound)
    w_now, cpus = loader["num_workers"], loader["cpus_per_process"]
    step_cpu = s.get("step_cpu")
    # CPUs the step wants (CPU time + waiting for a CPU), at most this process's: the run-queue part is what
    # other processes (or our own workers) took from it; unknown (an older probe): taken to use no CPU
    cores = 0.0
    if step_cpu:
        cores = min(float(cpus), step_cpu["wanted_cores"] if step_cpu.get("wanted_cores") is not None
                    else step_cpu["cores"])
    details = []
    cpu_bound_verdict = None
    if samples:
        tb = s["images_per_step"] * samples["per_sample_ms"] / 1e3
        share = samples["cpu_share"]
        tcpu = tb * share
        parts = samples["parts"]
        top = max(parts, key=parts.get)
        details.append(f"{parts[top]:.0%} of each sample's time is {PARTS[top]}")
        if step_cpu:
            details.append(f"the step itself wants {cores:.1f} of {cpus} CPUs"
                           + (" (its host side: Python, kernel launches)" if has_gpu else
                              " (the model's compute on the CPU)"))

        def step_time(n: int, tb_new: float = tb, tcpu_new: float = tcpu) -> float:
            return predict_step(n, c=c, tb=tb_new, tcpu=tcpu_new, cpus=cpus, step_cores=cores)

        def gain(tb_new: float, tcpu_new: float, candidates: tuple[int, ...]) -> float:
            return min(cap, T / min(step_time(n, tb_new, tcpu_new) for n in candidates))

        saturated = w_now > 0 and tcpu / cpus >= 0.9 * c
        util = loader["worker_cpu_util_mean"]
        if w_now and util is not None:
            details.insert(0, f"workers are {'CPU-saturated' if saturated else 'not CPU-bound'} "
                              f"({w_now} workers on {cpus} usable CPUs, {util:.0%} CPU each)")
        rq = samples.get("runqueue_share")
        starved = rq is not None and rq >= 0.25
        step_rq = (step_cpu or {}).get("runqueue_share") or 0.0
        # other processes take the CPUs a CPU-heavy step wants: what workers would do there is not predictable
        # (the scheduler shares by thread; on the team's loaded 2-CPU machine they measured 0.73-1.04x)
        contended = (starved or step_rq >= 0.25) and cores >= 0.75
        if starved or step_rq >= 0.25:
            details.append(f"{'samples' if starved else 'the step'} waited for a CPU "
                           f"{rq if starved else step_rq:.0%} of the time: the machine is oversubscribed, and the "
                           "predictions, which take the CPUs as this process's, are rough here (check with "
                           "--verify-fix)")
        io_bound = not starved and samples.get("blocked_share", 1.0 - share) >= 0.5
        # workers beyond the plan only where samples mostly block (I/O, sleep): they overlap the waiting
        top_n = min(4 * cpus, max(plan_workers, math.ceil(tb / c - 1e-9))) if io_bound else plan_workers
        # the measured step is the reference for the current worker count (the model would only add its error)
        ratio = {n: (1.0 if n == w_now else min(cap, T / step_time(n))) for n in range(0, max(top_n, w_now) + 1)}
        s["predictions"] = [{"change": f"num_workers={_workers_value(n, plan_workers)!r}".replace("'", '"'),
                             "apply": {"num_workers": n}, "expected_gain": g, "stage": "workers"}
                            for n, g in sorted(ratio.items(), key=lambda kv: kv[0] != plan_workers)
                            if n != w_now]  # the plan's count first: the one a user would try
        # within 2% of the best: the plan's count ("auto", which leaves its headroom), else the fewest (more
        # would only take CPUs from the step)
        best_gain = max(ratio.values())
        near = [n for n, g in ratio.items() if g >= best_gain / 1.02]
        best = plan_workers if plan_workers in near else min(near)
        if contended and best > w_now:
            cpu_bound_verdict = (
                f"CPU-contended training: loading, compute and other processes share {cpus} CPUs (the step wants "
                f"{cores:.1f}, its threads waited for a CPU {step_rq:.0%} of the time); more workers cannot be "
                f"promised a gain (the model, which takes the CPUs as this process's, says {ratio[best]:.2f}x "
                f"for num_workers={best}: check with --verify-fix)")
        elif best != w_now and ratio[best] >= 1.05:
            value = _workers_value(best, plan_workers)
            change = f'num_workers="auto" (-> {best})' if value == "auto" else f"num_workers={best}"
            if best < w_now:
                why = (f"the step wants {cores:.1f} of {cpus} CPUs; {w_now} workers take CPUs it needs: "
                       f"{best} predicted faster")
            elif w_now == 0:
                why = (f"the loader runs in the training process: each step waits for {s['images_per_step']:.0f} "
                       f"samples of {samples['per_sample_ms']:.1f} ms")
            else:
                why = (f"{w_now} workers deliver a batch every {tb / w_now * 1e3:.0f} ms; the step needs one every "
                       f"{c * 1e3:.0f} ms")
            if io_bound and best > cpus:
                why += (f"; samples spend {samples.get('blocked_share', 1 - share):.0%} of their time blocked "
                        f"(I/O, sleep), so workers beyond the {cpus} CPUs overlap the waiting")
            recs.append({"change": change, "stage": "workers", "why": why, "expected_gain": ratio[best],
                         "apply": {"num_workers": best},
                         "code": _code(created, {"num_workers": value})})
        elif cores >= 0.75 and best_gain < 1.05:
            tried = max(w_now + 1, plan_workers)
            cpu_bound_verdict = (
                f"CPU-bound training: loading and compute share {cpus} CPUs (the step wants {cores:.1f}, "
                f"loading needs {tcpu / T:.1f}); more workers cannot help "
                f"(num_workers={tried}: predicted {ratio.get(tried, min(cap, T / step_time(tried))):.2f}x)")
        n_after = (w_now, best)
        if parts["read"] >= 0.15:
            recs.append({"change": "fastload convert DIR store.lmdb, then LMDBImageDataset(store.lmdb)",
                         "stage": "lmdb",
                         "why": f"{parts['read']:.0%} of sample time is opening and reading small files",
                         "expected_gain": gain(tb * (1 - parts["read"]), tcpu * (1 - parts["read"]), n_after),
                         "code": store_snippet(created)})
        floats = samples["float_transform_share"]
        if floats >= 0.10:
            recs.append({"change": "train_transform + collate_uint8 + DevicePrefetcher (uint8 to the device, "
                                   "normalise there)", "stage": "fast",
                         "why": f"{floats:.0%} of sample time is ToTensor/Normalize (float conversion on the CPU, "
                                "4x the bytes through worker queues)"
                                + ("" if has_gpu else "; without a GPU the normalising moves to the step's CPUs"),
                         "expected_gain": gain(tb * (1 - floats), tcpu * (1 - floats), n_after)
                         if has_gpu else 1.0, "code": uint8_snippet(created)})
        if has_gpu and saturated and parts["decode"] >= 0.25:
            cut = parts["decode"] + floats
            recs.append({"change": 'DALILoader(device="gpu") (nvJPEG decode on the GPU)', "stage": "dali-gpu",
                         "why": f"the CPUs are saturated and {parts['decode']:.0%} of sample time is JPEG decode",
                         "expected_gain": gain(tb * (1 - cut), tcpu * (1 - cut), n_after),
                         "code": "from fastload.dali import DALILoader\n"
                                 "loader = DALILoader(\"store.lmdb\", batch_size=..., device=\"gpu\")"})
    if has_gpu and loader["pinned"] is False and s.get("kineto") and s["kineto"].get("htod_copy_fraction"):
        h = s["kineto"]["htod_copy_fraction"]
        recs.append({"change": "pin_memory=True (and .to(device, non_blocking=True))", "stage": "workers",
                     "why": f"host-to-device copies from pageable memory took {h:.0%} of the window",
                     "expected_gain": min(cap, 1.0 / (1.0 - h)), "apply": {"pin_memory": True},
                     "code": _code(created, {"pin_memory": True})})
    recs = [r for r in recs if r["expected_gain"] >= 1.02]  # a change predicted to gain nothing is no advice
    if cpu_bound_verdict:
        recs.append({"change": "none on the loading side: make the step cheaper (smaller model or batch, "
                               "torch.compile), or train on a GPU", "stage": None, "expected_gain": 1.0,
                     "why": cpu_bound_verdict.split(": ", 1)[1]})
    elif not recs:
        recs.append({"change": "A/B the loading stages on your data: fastload recipe run", "stage": None,
                     "why": "input-bound, but no single part of the sample time stands out",
                     "expected_gain": cap})
    recs.sort(key=lambda r: -r["expected_gain"])
    if cpu_bound_verdict:
        return "; ".join([cpu_bound_verdict, where, *details]), recs
    verdict = "input-bound: " + "; ".join([where, *details])
    return verdict, recs


def _code(created: str | None, changes: dict[str, Any]) -> str:
    """The loader line with ``changes``; where it cannot be read, the keyword to add (with the import)."""
    text = loader_snippet(created, changes)
    if text is not None:
        return text
    kw = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in changes.items())
    head = "from fastload import DataLoader\n" if changes.get("num_workers") == "auto" else ""
    return f"{head}loader = DataLoader(dataset, ..., {kw})"
