"""The gain model of a profile: a small model of the loader fitted to the measurement (``Model``,
``fit_model``), what it predicts for every worker count (``predict_step``), the run read as if the
machine were the user's own (``own_machine``), and the verdicts it reads off (``cpu_bound_verdict``,
``storage_bound``). The recommendations built on it: ``_recommend.py``.

The gain model. Per step of the training loop: T the measured step time, ``bound`` the
input-bound share (host data wait without CUDA; GPU idle overlapping the wait on CUDA),
so a perfect loader gives a step of ``c = T * (1 - bound)`` and no change can beat
``1 / (1 - bound)``. One batch costs ``t_b = images * seconds per sample`` of loading,
``t_cpu = t_b * (cpu share + run-queue share)`` of it on a CPU or waiting for one (only the
blocked part, I/O or sleep, overlaps across workers). The step itself keeps ``k`` CPUs busy
(``step_cores``: the training process's CPU time over the step's own part, from ``next()``
returning to the next call, divided by its wall time: on a CPU device the model's compute, on a
GPU the host side that launches kernels). With ``P`` CPUs for this process and ``N`` workers
the predicted step is the ``t`` where

    t = max(c, t_b / N, (c * k + t_cpu) / P, c * k / max(1, P - ceil(min(N, t_cpu / t))))

i.e. no faster than the step, than N workers deliver, than the CPUs can do both; and a
multi-threaded step (``k > 1``) slows down when busy workers take CPUs it was using: an
OpenMP region runs at the pace of its slowest thread, so a CPU a worker takes even in part is
lost to the step. That term is optimistic: beside busy workers such a step also waits for its threads at
every parallel region (a 17 ms 2-thread step ran 3x longer on a quiet 2-CPU machine), by an amount the
profile cannot see, so a worker count whose workers would share the step's CPUs (``k >= 1.2`` and ``k`` plus
the workers' CPU load over ``P``) gets its figure as an upper bound ("up to"), not a prediction. In
the main process (``N = 0``) the step is ``c + t_b``. Every worker count
from 0 up to the plan's (more where samples mostly block on I/O) is predicted; the
recommendation is the plan's count ("auto") when it is within 2% of the best, else the fewest
workers within 2% of the best, and only when it gains 5%; when no count gains and the step
keeps most of a CPU busy the verdict is "CPU-bound training". The measured T stands for the
current worker count. A change that removes a measured part of the sample time (read, decode,
the float transforms) shrinks ``t_b`` and ``t_cpu`` by that part. Gains are capped at the
perfect-loader bound
``1 / (1 - bound)``, at what the measured data wait allows ``1 / (1 - data_wait_fraction)``, and at
what the CPUs can load: ``P`` CPUs over the batch's measured CPU time, ``T * P / (t_b * cpu share)``; a
change predicted to gain under 2% is not offered. ``backend="threads"``: loader threads share the GIL
and this process's CPUs with the training loop, which the worker model (processes) does not describe;
no gain is predicted for a thread count, and the other changes carry only their upper bound
(``bound``). The figures and the assumptions behind them (the CPUs available are the affinity/quota
count, other users' load is not subtracted) are in docs/profile-advice.md.

Must not: run anything, import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PARTS = {"read": "opening files (PIL Image.open) or reading the store", "decode": "image decode (PIL, simplejpeg)",
         "transform": "transforms (torchvision's, fastload's presets)",
         "download": "waiting for shard downloads of the remote store",
         "other": "the dataset's own code outside reads, decodes and transforms"}
STORAGE_BOUND = 0.30  #: download wait at least this share of sample time, and its largest part: storage-bound
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


def workers_value(n: int, plan_workers: int) -> Any:
    return "auto" if n == plan_workers and n > 0 else n


def own_machine(s: dict[str, Any]) -> dict[str, Any]:
    """The summary as it would read with no other process on the CPUs: the samples' and the step's waits for a
    CPU removed (a sample's wall time loses its run-queue part; what is left keeps its CPU and blocked times;
    with 0 workers the step's data wait loses it too, so the gains are against the step on a quiet machine);
    the step's own part keeps the CPUs it wanted (``wanted_cores``: its CPU time plus its threads' wait for one)
    and its measured wall time (a step that got its CPUs would be no slower)."""
    q = {**s, "machine_load": None}
    sm = s.get("samples")
    rq = (sm or {}).get("runqueue_share") or 0.0
    if sm and 0 < rq < 1:
        q["samples"] = {**sm, "per_sample_ms": sm["per_sample_ms"] * (1 - rq), "runqueue_share": 0.0,
                        "cpu_share": min(1.0, sm["cpu_share"] / (1 - rq)),
                        **({"blocked_share": min(1.0, sm["blocked_share"] / (1 - rq))}
                           if sm.get("blocked_share") is not None else {})}
        if s["loader"]["num_workers"] == 0 and s["steps_per_s"]:
            # loading in the training process: its wait for a CPU was part of each step's data wait, so the step
            # on the machine as your own is shorter by it (and the gains are against that step, not the loaded one)
            T = 1.0 / s["steps_per_s"]
            waited = min(s["data_wait_fraction"] * T, s["images_per_step"] * sm["per_sample_ms"] * rq / 1e3)
            T_own = T - waited
            q["steps_per_s"] = 1.0 / T_own
            for key in ("data_wait_fraction", "input_bound_idle_fraction", "gpu_idle_fraction"):
                if key != "gpu_idle_fraction" or s["idle_source"] == "host-clock":
                    q[key] = max(0.0, s[key] * T - waited) / T_own
    if s.get("step_cpu"):
        q["step_cpu"] = {**s["step_cpu"], "runqueue_share": 0.0}
    return q


@dataclass(kw_only=True)
class Model:
    """What every rule reads: the measurement and the gain model fitted to it (the module docstring)."""

    s: dict[str, Any]
    has_gpu: bool
    cuda: bool
    plan_workers: int
    T: float
    c: float
    cap: float
    load_cap: float
    w_now: int
    cpus: int
    threads: bool
    cores: float
    created: str | None
    samples: dict[str, Any] | None = None
    tb: float = 0.0
    tcpu: float = 0.0
    share: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    top: str = ""
    ratio: dict[int, float] = field(default_factory=dict)
    best: int = 0
    best_gain: float = 1.0
    saturated: bool = False
    io_bound: bool = False
    contended: bool = False
    step_rq: float = 0.0
    floats: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def n_after(self) -> tuple[int, int]:
        return (self.w_now, self.best)

    def cpu_cap(self, tb_new: float) -> float:
        """Nor faster than this process's CPUs can do the loading's own CPU time (images/s <= CPUs / CPU
        seconds per image), after a change that leaves ``tb_new`` of the batch's loading time."""
        return self.T * self.cpus / (tb_new * self.share) if tb_new * self.share > 0 else math.inf

    def step_time(self, n: int, tb_new: float | None = None, tcpu_new: float | None = None) -> float:
        return predict_step(n, c=self.c, tb=self.tb if tb_new is None else tb_new,
                            tcpu=self.tcpu if tcpu_new is None else tcpu_new, cpus=self.cpus, step_cores=self.cores)

    def gain(self, tb_new: float, tcpu_new: float, candidates: tuple[int, ...]) -> float:
        bound_new = min(self.load_cap, self.cpu_cap(tb_new))
        if self.threads:  # no thread model (see below): only the bound that removing that part of the sample allows
            return min(bound_new, self.tb / max(1e-12, tb_new))
        return min(bound_new, self.T / min(self.step_time(n, tb_new, tcpu_new) for n in candidates))

    def shares_step_cpus(self, n: int) -> bool:
        """A multi-threaded step whose CPUs busy workers would share: its threads wait for each other at every
        parallel region while a worker holds one of their CPUs, which costs more than the pace-of-the-slowest
        term (measured on a quiet 2-CPU machine: a 17 ms 2-thread step ran 3x longer beside 2 busy workers, and
        2 workers gave 1.29x where the model said 1.73x; docs/profile-advice.md). How much more depends on how
        many parallel regions a step has, which the profile does not see: such a worker count's figure is an
        upper bound, not a prediction."""
        if n <= 0 or self.cores < 1.2:
            return False
        return self.cores + min(n, self.tcpu * self.ratio[n] / self.T) > self.cpus + 0.05  # + the workers' load


def fit_model(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> Model:
    """The model of an input-bound run; sets ``s["predictions"]`` (every worker count tried)."""
    wait, bound = s["data_wait_fraction"], s["input_bound_idle_fraction"]
    loader = s["loader"]
    T = 1.0 / s["steps_per_s"]
    # no change to the loading can beat a loader that never makes the step wait: 1 / (1 - input-bound share),
    # and never more than the measured data wait allows
    cap = min(1.0 / max(1e-9, 1.0 - bound), 1.0 / max(1e-9, 1.0 - wait))
    step_cpu = s.get("step_cpu")
    cpus = loader["cpus_per_process"]
    # CPUs the step wants (CPU time + waiting for a CPU), at most this process's: the run-queue part is what
    # other processes (or our own workers) took from it; unknown (an older probe): taken to use no CPU
    cores = 0.0
    if step_cpu:
        cores = min(float(cpus), step_cpu["wanted_cores"] if step_cpu.get("wanted_cores") is not None
                    else step_cpu["cores"])
    m = Model(s=s, has_gpu=has_gpu, cuda=s["idle_source"] in ("cuda", "cuda-events"), plan_workers=plan_workers,
              T=T, c=T * (1.0 - bound), cap=cap, load_cap=cap, w_now=loader["num_workers"], cpus=cpus,
              threads=loader.get("backend") == "threads", cores=cores, created=loader.get("created_at"),
              samples=s["samples"])
    s["predictions"] = []
    samples = m.samples
    if not samples:
        return m
    m.tb = s["images_per_step"] * samples["per_sample_ms"] / 1e3
    m.share = share = samples["cpu_share"]
    # the CPU a batch wants: its CPU time plus its wait for a CPU (as for the step's ``wanted_cores``). A
    # sample that waited for a CPU does not run faster in a second worker on the same CPUs: counted as
    # free, that wait let 2 workers on 2 CPUs promise more than 2x (2.53x under Lightning, where the tiny
    # step left the contended check below unarmed); only the blocked part (I/O, sleep) overlaps
    m.tcpu = tcpu = m.tb * min(1.0, share + (samples.get("runqueue_share") or 0.0))
    m.cap = min(cap, m.cpu_cap(m.tb))  # load_cap stays the perfect-loader bound, for changes that move work off
    m.parts = parts = samples["parts"]
    m.top = top = max(parts, key=parts.get)
    m.details.append(f"{parts[top]:.0%} of each sample's time is {PARTS[top]}")
    if step_cpu:
        m.details.append(f"the step itself wants {cores:.1f} of {cpus} CPUs"
                         + (" (its host side: Python, kernel launches)" if has_gpu else
                            " (the model's compute on the CPU)"))
    w_now, c, threads = m.w_now, m.c, m.threads
    m.saturated = w_now > 0 and tcpu / cpus >= 0.9 * c
    if threads:
        # loader threads are not worker processes: they share the GIL with each other and with the training
        # loop (the Python-level part of a sample, e.g. transforms, runs one thread at a time; only C code that
        # releases the GIL, such as decode, overlaps) and this process's CPUs. The worker model would treat
        # them as processes and promise gains that cannot happen, so no thread-count gain is predicted.
        m.details.append(f"backend='threads': {w_now} loader threads share the GIL and this process's {cpus} CPUs "
                         "with the training loop; the worker model is for processes, so no gain is predicted for "
                         "a thread count (A/B it: fastload recipe run, or profile backend='processes')")
    util = loader["worker_cpu_util_mean"]
    if w_now and util is not None:
        m.details.insert(0, f"workers are {'CPU-saturated' if m.saturated else 'not CPU-bound'} "
                            f"({w_now} workers on {cpus} usable CPUs, {util:.0%} CPU each)")
    rq = samples.get("runqueue_share")
    starved = rq is not None and rq >= 0.25
    m.step_rq = step_rq = (step_cpu or {}).get("runqueue_share") or 0.0
    # other processes take the CPUs a CPU-heavy step wants: what workers would do there is not predictable
    # (the scheduler shares by thread; on the team's loaded 2-CPU machine they measured 0.73-1.04x)
    m.contended = (starved or step_rq >= 0.25) and cores >= 0.75 and not threads
    if starved or step_rq >= 0.25:
        m.details.append(f"{'samples' if starved else 'the step'} waited for a CPU "
                         f"{rq if starved else step_rq:.0%} of the time: the machine is oversubscribed, and the "
                         "predictions, which take the CPUs as this process's, are rough here (check with "
                         "--verify-fix)")
    m.io_bound = not starved and samples.get("blocked_share", 1.0 - share) >= 0.5
    # workers beyond the plan only where samples mostly block (I/O, sleep): they overlap the waiting
    top_n = min(4 * cpus, max(plan_workers, math.ceil(m.tb / c - 1e-9))) if m.io_bound else plan_workers
    # the measured step is the reference for the current worker count (the model would only add its error)
    m.ratio = ratio = ({w_now: 1.0} if threads else
                       {n: (1.0 if n == w_now else min(m.cap, T / m.step_time(n)))
                        for n in range(0, max(top_n, w_now) + 1)})
    s["predictions"] = [{"change": f"num_workers={workers_value(n, plan_workers)!r}".replace("'", '"'),
                         "apply": {"num_workers": n}, "expected_gain": g, "stage": "workers",
                         **({"bound": True} if m.shares_step_cpus(n) else {})}
                        for n, g in sorted(ratio.items(), key=lambda kv: kv[0] != plan_workers)
                        if n != w_now]  # the plan's count first: the one a user would try
    # within 2% of the best: the plan's count ("auto", which leaves its headroom), else the fewest (more
    # would only take CPUs from the step)
    m.best_gain = max(ratio.values())
    near = [n for n, g in ratio.items() if g >= m.best_gain / 1.02]
    m.best = plan_workers if plan_workers in near else min(near)
    m.floats = samples["float_transform_share"]
    return m


def cpu_bound_verdict(m: Model) -> str | None:
    """"CPU-contended" or "CPU-bound training" where more workers cannot be promised a gain, else None."""
    if not m.samples:
        return None
    best, w_now, ratio = m.best, m.w_now, m.ratio
    if m.contended and (best > w_now or m.best_gain < 1.05):
        shown = best if best > w_now else max(w_now + 1, m.plan_workers)
        return (f"CPU-contended training: loading, compute and other processes share {m.cpus} CPUs (the step wants "
                f"{m.cores:.1f}, its threads waited for a CPU {m.step_rq:.0%} of the time); more workers cannot be "
                f"promised a gain (the model, which takes the CPUs as this process's, says "
                f"{ratio.get(shown, min(m.cap, m.T / m.step_time(shown))):.2f}x for num_workers={shown}: check with "
                "--verify-fix)")
    if best != w_now and ratio[best] >= 1.05:
        return None
    if m.cores >= 0.75 and m.best_gain < 1.05 and not m.threads:
        tried = max(w_now + 1, m.plan_workers)
        return (f"CPU-bound training: loading and compute share {m.cpus} CPUs (the step wants {m.cores:.1f}, "
                f"loading needs {m.tcpu / m.T:.1f}); more workers cannot help "
                f"(num_workers={tried}: predicted {ratio.get(tried, min(m.cap, m.T / m.step_time(tried))):.2f}x)")
    return None


def storage_bound(m: Model) -> bool:
    return bool(m.samples) and m.parts.get("download", 0.0) >= STORAGE_BOUND and m.top == "download"
