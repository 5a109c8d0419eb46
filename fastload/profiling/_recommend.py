"""The verdict and the ranked recommendations of a profile, from a small model of the loader fitted
to the measurement; each recommendation with its predicted images/s ratio and its code change.

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
the workers' CPU load over ``P``) gets its figure as an upper bound ("up to"), not a prediction. In the main process (``N = 0``) the step is ``c + t_b``. Every worker count
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

The uint8 presets as ``--verify-fix`` applies them (alone, at today's worker count: ``s["uint8_presets"]``)
have two predictions, one per place the normalising can run: on the CUDA device, where it is taken as
free (``t_b`` and ``t_cpu`` lose the ToTensor/Normalize share); or, without CUDA in the training
process, in that process after each batch arrives: the float share of a batch, ``t_b × share``, is
taken to cost the same there and is added to the step's own time ``c`` (one CPU busy), while the
samples lose it. Both are ratios of the model's steps at today's worker count (new over today's), so
its error at today's point cancels: with 0 workers the main-process variant is the same work in the
same process, 1.0x. The verify output prints the one for where the rerun normalised
(``verify_prediction``).

Must not: run anything, import torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastload.profiling._snippet import loader_snippet, store_snippet, uint8_snippet

INPUT_BOUND = 0.10  #: below this input-bound share faster loading cannot buy more than ~11%
PARTS = {"read": "opening files (PIL Image.open) or reading the store", "decode": "image decode (PIL, simplejpeg)",
         "transform": "transforms (torchvision's, fastload's presets)",
         "download": "waiting for shard downloads of the remote store",
         "other": "the dataset's own code outside reads, decodes and transforms"}
FASTLOAD_DATASETS = ("fastload.load.dataset.LMDBImageDataset",)  #: already read from a store: no convert advice
STORE_DOMINANT = 0.5  #: decode + transforms at least this share of sample time: the store and presets come first
STORAGE_BOUND = 0.30  #: download wait at least this share of sample time, and its largest part: storage-bound
#: the training loader's dataset classes --verify-fix can swap the uint8 presets into (``_uint8.py`` checks the rest)
FOLDER_DATASETS = ("torchvision.datasets.folder.ImageFolder", "torchvision.datasets.folder.DatasetFolder",
                   "torch.utils.data.dataset.Subset")
UINT8_CHANGE = "train_transform + collate_uint8 + DevicePrefetcher (uint8 to the device, normalise there)"
UINT8_ASSUMPTION = ("normalised in the training process after each batch (no CUDA there): taken to cost what "
                    "ToTensor/Normalize measured per sample, now in the step; fastload's own decode and crop are "
                    "taken to cost what torchvision's did")


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


def change_to_verify(s: dict[str, Any], only: str | None = None) -> dict[str, Any] | None:
    """What ``--verify-fix`` applies: the top recommendation fastload can apply from outside, else (nothing
    to apply, e.g. CPU-bound training) the worker count a user would try, with its predicted ratio.

    ``only`` (``--verify-change``): the top recommendation that changes that alone (``num_workers``, ``pin_memory``,
    ``uint8_presets``; not the store's, which also sets the workers), else its prediction (a worker count, or the
    uint8 presets on their own).
    """
    for r in s["recommendations"]:  # with ``only``: a recommendation that changes that alone (not the store's)
        if r.get("apply") and (only is None or set(r["apply"]) == {only}):
            return {**r, "verify_why": "the top recommendation that can be applied from outside" if only is None
                    else f"the top recommendation that changes {only}"}
    if only == "uint8_presets" and s.get("uint8_presets"):
        u = s["uint8_presets"]
        return {"change": UINT8_CHANGE, "stage": "fast", "apply": {"uint8_presets": True}, "verify_gain": u,
                "expected_gain": u["device"] if u["device"] is not None else u["main process"],
                "verify_why": "asked for (--verify-change) though not recommended: checking its prediction",
                **({"bound": True} if s["loader"].get("backend") == "threads" else {})}  # no thread model: a bound
    if only not in (None, "num_workers"):
        return None
    recs = s["recommendations"]
    no_gain = only is None and recs and recs[0].get("stage") is None and recs[0]["expected_gain"] <= 1.0
    for p in s.get("predictions", []):
        if "num_workers" in p.get("apply", {}) and p["apply"]["num_workers"] != s["loader"]["num_workers"]:
            # one prediction per run: the recommendation's "no gain", not the model's figure it would not promise
            if no_gain and p["expected_gain"] > 1.0:
                p = {k: v for k, v in p.items() if k != "bound"}
                p.update(expected_gain=recs[0]["expected_gain"], advice=True)
            return {**p, "verify_why": "no recommendation to apply: checking the prediction that this worker "
                                       "count does not help" if only is None else
                                       "asked for (--verify-change) though not recommended: checking its prediction"}
    return None


def verify_prediction(pick: dict[str, Any], applied: dict[str, Any]) -> tuple[float | None, str | None]:
    """The predicted ratio for what the rerun applied, and the assumption behind it (None: the usual model).

    The uint8 presets have two: normalised on the CUDA device, or in the training process (no CUDA there).
    """
    variants, done = pick.get("verify_gain"), applied.get("uint8_presets")
    if not variants or not isinstance(done, dict):
        return pick["expected_gain"], None
    if pick.get("stage") == "store":  # the preset timed on the user's own files, not taken from torchvision's
        measured = "the preset's CPU time per sample measured on the files themselves (fastload profile's process)"
        return (variants["main process"], measured + "; normalised in the training process (no CUDA there)") \
            if done.get("normalise") == "main process" else (variants["device"] or pick["expected_gain"], measured)
    if done.get("normalise") == "main process":
        return variants["main process"], UINT8_ASSUMPTION
    return variants["device"], f"normalised on {done.get('normalise')}: the float conversion is taken as free there"


def _workers_value(n: int, plan_workers: int) -> Any:
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


FOREIGN_CPUS = 0.25  #: other processes took at least this many of the CPUs during the run: a shared machine
CONTENDED_RQ = 0.25  #: samples or the step waited for a CPU at least this share of their time


def recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """The verdict and the ranked ``{change, why, expected_gain, stage, code, apply}`` list for a summary.

    Also sets ``s["predictions"]``: the predicted images/s ratio of every worker count tried.

    Where other processes took CPUs during the run (``s["machine_load"]``, measured by ``fastload profile``)
    and the samples or the step waited for a CPU, the advice is the one for the machine as the user's own
    (``own_machine``): the same profile under more or less load gives the same advice, and the verdict says
    what was measured, what other processes took, and what the run read under that load when it differs.
    """
    load = s.get("machine_load") or {}
    rq = max((s.get("samples") or {}).get("runqueue_share") or 0.0, (s.get("step_cpu") or {}).get(
        "runqueue_share") or 0.0)
    if (load.get("other_cpus") or 0.0) < FOREIGN_CPUS or rq < CONTENDED_RQ:
        return _recommend(s, plan_workers=plan_workers, has_gpu=has_gpu)
    loaded = {**s, "machine_load": None}
    loaded_verdict, loaded_recs = _recommend(loaded, plan_workers=plan_workers, has_gpu=has_gpu)
    quiet = own_machine(s)
    verdict, recs = _recommend(quiet, plan_workers=plan_workers, has_gpu=has_gpu)
    for key in ("predictions", "uint8_presets"):
        if key in quiet:
            s[key] = quiet[key]
    la = load.get("load_average")
    said = (f"shared machine: other processes took {load['other_cpus']:.1f} of the {load.get('cpus', '?')} CPUs "
            f"during the run" + (f" (load average {la:.1f})" if la is not None else "")
            + f", and this run's samples or step waited for a CPU up to {rq:.0%} of their time")
    if loaded_verdict.split(":", 1)[0] != verdict.split(":", 1)[0] or (
            loaded_recs[:1] and recs[:1] and loaded_recs[0]["change"] != recs[0]["change"]):
        said += (f"; the advice below is for the machine as your own (those waits removed); under this load the "
                 f"run read: {loaded_verdict.split(';', 1)[0]} (top: {loaded_recs[0]['change']})" if loaded_recs
                 else "")
    else:
        said += "; the advice is the same with those waits removed (the machine as your own)"
    for r in recs:
        r["why"] += "; for the machine as your own (other processes' load removed)"
    return f"{verdict.split(':', 1)[0]} ({said}):{verdict.split(':', 1)[1]}", recs


@dataclass(kw_only=True)
class Recommendation:
    """One ranked change: what to change (``change``), the loader stage it belongs to (``stage``; None: not
    the loader), why, and the predicted images/s ratio (``expected_gain``; ``bound``: an upper bound, not a
    prediction); the code change, what ``--verify-fix`` applies (``apply``) and its own prediction
    (``verify_gain``, ``verify_part``) where there are."""

    change: str
    stage: str | None
    why: str
    expected_gain: float
    code: str | None = None
    apply: dict[str, Any] | None = None
    bound: bool = False
    verify_gain: Any = None
    verify_part: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record profile.json and the report read: the optional keys only where they are set."""
        d: dict[str, Any] = {"change": self.change, "stage": self.stage, "why": self.why,
                             "expected_gain": self.expected_gain}
        for key in ("code", "apply", "verify_gain", "verify_part"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.bound:
            d["bound"] = True
        return d


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
        return n > 0 and self.cores >= 1.2 and self.cores + min(n, self.tcpu * self.ratio[n] / self.T) > self.cpus + 0.05


def _model(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> Model:
    """The model of an input-bound run; sets ``s["predictions"]`` (every worker count tried)."""
    wait, idle, bound = s["data_wait_fraction"], s["gpu_idle_fraction"], s["input_bound_idle_fraction"]
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
    s["predictions"] = [{"change": f"num_workers={_workers_value(n, plan_workers)!r}".replace("'", '"'),
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


# ---- the rules: one function each, in the order their advice is listed before ranking (a tie keeps it) ----

def rule_workers(m: Model) -> list[Recommendation]:
    """More (or fewer) DataLoader workers, when the model predicts at least 5% for the best count."""
    if not m.samples or (m.contended and (m.best > m.w_now or m.best_gain < 1.05)):
        return []
    best, w_now, s = m.best, m.w_now, m.s
    if best == w_now or m.ratio[best] < 1.05:
        return []
    value = _workers_value(best, m.plan_workers)
    change = f'num_workers="auto" (-> {best})' if value == "auto" else f"num_workers={best}"
    if best < w_now:
        why = (f"the step wants {m.cores:.1f} of {m.cpus} CPUs; {w_now} workers take CPUs it needs: "
               f"{best} predicted faster")
    elif w_now == 0:
        why = (f"the loader runs in the training process: each step waits for {s['images_per_step']:.0f} "
               f"samples of {m.samples['per_sample_ms']:.1f} ms")
    else:
        why = (f"{w_now} workers deliver a batch every {m.tb / w_now * 1e3:.0f} ms; the step needs one every "
               f"{m.c * 1e3:.0f} ms")
    if m.io_bound and best > m.cpus:
        why += (f"; samples spend {m.samples.get('blocked_share', 1 - m.share):.0%} of their time blocked "
                f"(I/O, sleep), so workers beyond the {m.cpus} CPUs overlap the waiting")
    if m.shares_step_cpus(best):
        why += (f"; an upper bound: the step's {m.cores:.1f} threads would share CPUs with busy workers, and "
                "a multi-threaded step then waits for its threads at every parallel region (check with "
                f"--verify-fix); torch.set_num_threads({max(1, m.cpus - best)}) in the script keeps the step "
                "off the workers' CPUs")
    return [Recommendation(change=change, stage="workers", why=why, expected_gain=m.ratio[best],
                           apply={"num_workers": best}, bound=m.shares_step_cpus(best),
                           code=_code(m.created, {"num_workers": value}))]


def rule_storage(m: Model) -> list[Recommendation]:
    """A store in object storage whose samples mostly wait for shard downloads: cache, prefetch, shard size."""
    if not storage_bound(m):
        return []
    warm = m.gain(m.tb * (1 - m.parts["download"]), m.tcpu, m.n_after)
    return [Recommendation(**r) for r in _storage_recs(m.s, warm)]


def _store_applies(m: Model) -> bool:
    folder = m.s["loader"].get("image_folder") or {}
    return bool(m.samples) and bool(folder.get("root")) and m.s["loader"].get("dataset") not in FASTLOAD_DATASETS \
        and m.parts.get("decode", 0.0) + m.parts.get("transform", 0.0) >= STORE_DOMINANT


def rule_store(m: Model) -> list[Recommendation]:
    """A torchvision ImageFolder whose decode and transforms dominate: the store + uint8 presets."""
    if not _store_applies(m):
        return []
    rec = _store_rec(m.s, m.s["loader"]["image_folder"], tb=m.tb, tcpu=m.tcpu, c=m.c, cores=m.cores, cpus=m.cpus,
                     w_now=m.w_now, plan_workers=m.plan_workers, cap=m.load_cap, has_gpu=m.has_gpu, cuda=m.cuda,
                     threads=m.threads)
    return [Recommendation(**rec)]


def rule_lmdb(m: Model) -> list[Recommendation]:
    """Small files opened and read per sample (and no store advice already): convert to a store."""
    if not m.samples or m.parts["read"] < 0.15 or m.s["loader"].get("dataset") in FASTLOAD_DATASETS \
            or _store_applies(m):
        return []
    read = m.parts["read"]
    return [Recommendation(change="fastload convert DIR store.lmdb, then LMDBImageDataset(store.lmdb)", stage="lmdb",
                           why=f"{read:.0%} of sample time is opening and reading small files",
                           expected_gain=m.gain(m.tb * (1 - read), m.tcpu * (1 - read), m.n_after),
                           code=store_snippet(m.created))]


def _uint8_variants(m: Model) -> None:
    """``s["uint8_presets"]``: the uint8 presets alone at today's worker count, as --verify-fix applies them:
    normalised on the device (free there), or, without CUDA in the process, in the training process after
    each batch, taken to cost what ToTensor/Normalize cost in the samples (UINT8_ASSUMPTION), relative to the
    model's own step at today's count, so that its error there cancels: the same work moved within one
    process is 1.0x, not the model's error."""
    floats, tb, tcpu, w_now = m.floats, m.tb, m.tcpu, m.w_now
    tb_u8, tcpu_u8 = tb * (1 - floats), tcpu * (1 - floats)
    moved = tb * floats
    host = device = None
    if m.threads:
        device = m.gain(tb_u8, tcpu_u8, (w_now,)) if m.has_gpu else None  # a bound only (no thread model)
    else:
        now = m.step_time(w_now)
        t_host = predict_step(w_now, c=m.c + moved, tb=tb_u8, tcpu=tcpu_u8, cpus=m.cpus,
                              step_cores=(m.c * m.cores + moved) / (m.c + moved))
        host = min(m.load_cap, m.cpu_cap(tb_u8), now / t_host)
        if m.has_gpu:
            device = min(m.load_cap, m.cpu_cap(tb_u8), now / m.step_time(w_now, tb_u8, tcpu_u8))
    m.s["uint8_presets"] = {"float_transform_share": floats, "main process": host, "device": device}


def rule_uint8(m: Model) -> list[Recommendation]:
    """ToTensor/Normalize on the CPU: the uint8 presets, normalised on the device."""
    if not m.samples:
        return []
    floats = m.floats
    if floats > 0:
        _uint8_variants(m)
    if floats < 0.10:
        return []
    s, has_gpu = m.s, m.has_gpu
    rec = Recommendation(change=UINT8_CHANGE, stage="fast",
                         why=f"{floats:.0%} of sample time is ToTensor/Normalize (float conversion on the CPU, "
                             "4x the bytes through worker queues)"
                             + ("" if has_gpu else "; without a GPU the normalising moves to the step's CPUs"),
                         expected_gain=1.0, code=uint8_snippet(m.created))
    # one prediction per run: the figure is the presets alone at today's worker count (what --verify-fix
    # applies), normalised on the device where there is one, else in the training process; where the
    # rerun would normalise elsewhere (a GPU this script does not use) that figure is said here too
    u = s.get("uint8_presets") or {}
    variant = u.get("device") if has_gpu else u.get("main process")
    rec.expected_gain = variant if variant is not None else m.gain(
        m.tb * (1 - floats), m.tcpu * (1 - floats), m.n_after) if has_gpu else 1.0
    if has_gpu and not m.cuda and u.get("main process") is not None:
        rec.verify_part = "normalising in the training process (this script used no CUDA)"
        rec.why += (f"; --verify-fix normalises in the training process, as this script uses no CUDA: "
                    f"predicted {u['main process']:.2f}x for that")
    if s["loader"].get("dataset") in FOLDER_DATASETS:  # --verify-fix can swap it in (_uint8.py)
        rec.apply, rec.verify_gain = {"uint8_presets": True}, s["uint8_presets"]
    return [rec]


def rule_dali_gpu(m: Model) -> list[Recommendation]:
    """Saturated CPUs decoding JPEGs, with a GPU: decode on the GPU."""
    if not (m.samples and m.has_gpu and m.saturated and m.parts["decode"] >= 0.25):
        return []
    cut = m.parts["decode"] + m.floats
    return [Recommendation(change='DALILoader(device="gpu") (nvJPEG decode on the GPU)', stage="dali-gpu",
                           why=f"the CPUs are saturated and {m.parts['decode']:.0%} of sample time is JPEG decode",
                           expected_gain=m.gain(m.tb * (1 - cut), m.tcpu * (1 - cut), m.n_after),
                           code="from fastload.dali import DALILoader\n"
                                "loader = DALILoader(\"store.lmdb\", batch_size=..., device=\"gpu\")")]


def rule_pin_memory(m: Model) -> list[Recommendation]:
    """Host-to-device copies from pageable memory in the GPU timeline: pinned batches."""
    s = m.s
    if not (m.has_gpu and s["loader"]["pinned"] is False and s.get("kineto") and s["kineto"].get("htod_copy_fraction")):
        return []
    h = s["kineto"]["htod_copy_fraction"]
    return [Recommendation(change="pin_memory=True (and .to(device, non_blocking=True))", stage="workers",
                           why=f"host-to-device copies from pageable memory took {h:.0%} of the window",
                           expected_gain=min(m.cap, 1.0 / (1.0 - h)), apply={"pin_memory": True},
                           code=_code(m.created, {"pin_memory": True}))]


#: Every rule of an input-bound run, in listing order: a new recommendation is one function here and one test.
RULES: list[Callable[[Model], list[Recommendation]]] = [
    rule_workers, rule_storage, rule_store, rule_lmdb, rule_uint8, rule_dali_gpu, rule_pin_memory]


def _recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """``recommend`` on the summary as measured (no correction for other processes' load)."""
    wait, idle, bound = s["data_wait_fraction"], s["gpu_idle_fraction"], s["input_bound_idle_fraction"]
    cuda = s["idle_source"] in ("cuda", "cuda-events")
    where = (f"the GPU was idle {idle:.0%} of measured time, {bound * 100:.0f} points of it while the training loop "
             "waited for the DataLoader" if cuda else
             f"the training loop waited for data {wait:.0%} of measured time (host clocks"
             + ("; no CUDA timeline: the GPU is idle at least while the step waits)" if has_gpu else
                "; no GPU: the step computes on the same CPUs as the loading)"))
    if bound < INPUT_BOUND:
        s["predictions"] = []
        recs: list[Recommendation] = []
        host_idle = idle - bound if cuda else 0.0
        if host_idle >= 0.15:
            recs.append(Recommendation(
                change="remove host sync points in the step (loss.item(), .cpu(), printing every step); "
                       "then CUDA graphs or torch.compile for launch overhead", stage=None,
                why=f"the GPU was idle {host_idle:.0%} of the time while the host was NOT waiting for data",
                expected_gain=1.0 / (1.0 - host_idle)))
        recs.append(Recommendation(change="none on the loading side", stage=None, expected_gain=1.0 / (1.0 - bound),
                                   why=f"compute-bound: faster loading will not help: only {bound:.0%} of the step "
                                       "was spent waiting for data"))
        kind = "host-bound" if host_idle >= 0.15 else "compute-bound"
        return f"{kind}: {where}; faster loading will not help", [r.to_dict() for r in recs]

    m = _model(s, plan_workers=plan_workers, has_gpu=has_gpu)
    recs = [r for rule in RULES for r in rule(m)]
    cpu_verdict = cpu_bound_verdict(m)
    storage_verdict = None
    if storage_bound(m):
        storage_verdict = (f"storage-bound: the loop waited for shard downloads "
                           f"{s.get('download_wait_fraction', bound * m.parts['download']):.0%} of the time")
        cpu_verdict = None  # the samples wait for the link: no CPU verdict (waiting takes no CPU) overrides that
    if m.threads:
        for r in recs:
            r.bound = True  # an upper bound, not a prediction (no thread model)
    recs = [r for r in recs if r.expected_gain >= 1.02]  # a change predicted to gain nothing is no advice
    if cpu_verdict:
        recs.append(Recommendation(change="none on the loading side: make the step cheaper (smaller model or batch, "
                                          "torch.compile), or train on a GPU", stage=None, expected_gain=1.0,
                                   why=cpu_verdict.split(": ", 1)[1]))
    elif not recs:
        recs.append(Recommendation(
            change="A/B the loading stages on your data: fastload recipe run", stage=None,
            why="input-bound, but no single part of the sample time stands out"
                + ("; the loading already uses every CPU this process has: only cheaper samples can "
                   "help" if m.cap < 1.02 else ""),
            expected_gain=m.cap, bound=True))
    recs.sort(key=lambda r: -r.expected_gain)
    # the store's lines include num_workers="auto": within 2% of the best (both at the same cap), it comes first
    store = next((r for r in recs if r.stage == "store"), None)
    if store is not None and store.expected_gain >= recs[0].expected_gain / 1.02:
        recs.remove(store)
        recs.insert(0, store)
    out = [r.to_dict() for r in recs]
    if storage_verdict:
        return "; ".join([storage_verdict, where, *m.details]), out
    if cpu_verdict:
        return "; ".join([cpu_verdict, where, *m.details]), out
    return "input-bound: " + "; ".join([where, *m.details]), out


def _store_rec(s: dict[str, Any], folder: dict[str, Any], *, tb: float, tcpu: float, c: float, cores: float,
               cpus: int, w_now: int, plan_workers: int, cap: float, has_gpu: bool, cuda: bool,
               threads: bool) -> dict[str, Any]:
    """The store + uint8 presets + fastload's DataLoader (the README's three lines) for a torchvision ImageFolder
    whose decode and transforms dominate the sample time (the model in docs/profile-advice.md#the-store).

    Predicted from two measurements: the profile's per-sample time of reading, decoding and transforming, and
    the preset's CPU time per sample on a few of the user's own files (``presets_measured``, timed by the
    profiler after the run) on the bytes ``fastload convert`` stores; the store's own read (an mmap'd LMDB
    record) is taken as free, and the preset's time waits for a CPU as the profile's samples did. The lines set
    ``num_workers="auto"``: predicted at the plan's worker count. Without CUDA in the training process the
    normalising moves into it (``DevicePrefetcher(loader, "cpu")``), taken at its measured cost per sample.
    ``--verify-fix`` cannot make the store (that is the ``convert``): it applies the presets to the files
    themselves with the same worker count (``_uint8.py``), whose prediction (``verify_gain``) keeps the files'
    read and times the preset on the files' own bytes. Without a measurement (the transform has no preset,
    or no file could be read) the figure is the perfect-loader bound.
    """
    from fastload.profiling._snippet import store_path_for, store_presets_snippet

    samples, parts = s["samples"], s["samples"]["parts"]
    images, per = s["images_per_step"], samples["per_sample_ms"]
    share, rq = samples["cpu_share"], samples.get("runqueue_share") or 0.0
    measured = s.get("presets_measured")
    n = plan_workers if plan_workers > 0 else w_now
    code = store_presets_snippet(folder["root"], folder.get("repr"), folder.get("mean"), folder.get("std"),
                                 s["loader"].get("created_at"), cuda=cuda)
    removed = parts.get("read", 0.0) + parts.get("decode", 0.0) + parts.get("transform", 0.0)
    store = store_path_for(folder["root"])
    head = (f"{parts.get('decode', 0.0) + parts.get('transform', 0.0):.0%} of each sample's time is decode and "
            f"transforms of {folder['root']}'s files (PIL, torchvision)")
    if not measured or threads:
        why = (head + "; the store keeps the images ready to decode, the uint8 presets decode only what the crop "
               "needs and leave the float conversion to the device. Not measured here ("
               + ("backend='threads': no thread model" if threads else folder.get("refused")
                  or "none of the dataset's files could be timed") + "): the figure is the perfect-loader bound")
        return {"change": f"pack into a fastload store (fastload convert {folder['root']} {store}) + uint8 presets "
                          "+ fastload.DataLoader", "stage": "store", "why": why, "expected_gain": cap, "bound": True,
                "code": code}
    wait_per_cpu = rq / share if share > 0 else 0.0  # the profile's samples waited this long for a CPU per CPU second

    T = 1.0 / s["steps_per_s"]

    def step_with(sample_ms: float, cut: float, moved_ms: float) -> float:
        """The ratio when the ``cut`` share of the sample time becomes ``sample_ms`` of preset CPU time (and
        ``moved_ms`` per sample of normalising joins the step)."""
        added = images * sample_ms * (1 + wait_per_cpu) / 1e3
        tb_new, tcpu_new = tb * (1 - cut) + added, tcpu * (1 - cut) + added
        moved = images * moved_ms / 1e3
        k = (c * cores + moved) / (c + moved) if moved else cores
        t = predict_step(n, c=c + moved, tb=tb_new, tcpu=tcpu_new, cpus=cpus, step_cores=k)
        return min(cap, T * cpus / max(1e-12, tcpu_new), T / t)

    norm = measured["normalise_ms"]
    full = {"device": step_with(measured["store_ms"], removed, 0.0) if has_gpu else None,
            "main process": step_with(measured["store_ms"], removed, norm)}
    files_kept = parts.get("decode", 0.0) + parts.get("transform", 0.0)  # the files are still opened and read
    files = {"device": step_with(measured["files_ms"], files_kept, 0.0) if has_gpu else None,
             "main process": step_with(measured["files_ms"], files_kept, norm)}
    where = "device" if cuda else "main process"
    gain, verify = full[where], files[where]
    auto = f'num_workers="auto" (-> {n})' if n == plan_workers and n > 0 else f"num_workers={n}"
    why = (head + f" ({per * removed:.1f} ms of {per:.1f} ms per sample); the preset measured "
           f"{measured['store_ms']:.1f} ms of CPU per sample on {measured['files']} of these images as the store "
           f"holds them" + ("" if cuda else f", and normalising in the training process {norm:.2f} ms per sample "
                            "(no CUDA there)") + f"; predicted with {auto}")
    # an upper bound, always: the store's own read is taken as free and nothing here can run the convert to check
    # it (on a 240-PNG folder under load the applied lines measured 0.44-0.64 of the figure; docs/profile-advice.md)
    rec = {"change": f"pack into a fastload store + uint8 presets + fastload.DataLoader (fastload convert "
                     f"{folder['root']} {store})", "stage": "store", "why": why, "expected_gain": gain, "code": code,
           "bound": True}
    rec["why"] += "; an upper bound: the store's own read is taken as free"
    if n > 0 and cores >= 1.2 and cores + min(n, tcpu / T) > cpus + 0.05:  # as shares_step_cpus in _recommend
        rec["why"] += (f", and the step's {cores:.1f} threads would share CPUs with busy workers "
                       f"(torch.set_num_threads({max(1, cpus - n)}) keeps the step off them)")
    if s["loader"].get("dataset") in FOLDER_DATASETS:
        rec.update(apply={"uint8_presets": True, **({"num_workers": n} if n != w_now else {})},
                   verify_gain=files, verify_part="the presets on your files" + (f" with {auto}" if n != w_now else "")
                   + ": --verify-fix cannot make the store (run the convert above)")
        rec["why"] += (f"; --verify-fix applies the presets to the files themselves"
                       + (f" with {auto}" if n != w_now else "") + f", predicted {verify:.2f}x (it cannot make the "
                       "store: that is the convert)")
    return rec


def _storage_recs(s: dict[str, Any], warm_gain: float) -> list[dict[str, Any]]:
    """What shortens the wait for shard downloads: a cache that holds the store (later epochs download
    nothing: the download part is gone), deeper prefetch (when the link has room), and the shard size."""
    cache = (s.get("samples") or {}).get("shard_cache") or {}
    rate = cache["bytes_downloaded"] / cache["download_s"] / 1e6 if cache.get("download_s") else None
    per = cache["bytes_downloaded"] / cache["downloads"] / 1e6 if cache.get("downloads") else None
    return [
        {"change": "cache_limit at least the store's size (on a local disk)", "stage": "storage",
         "expected_gain": warm_gain,
         "why": "from the second epoch on every shard is read from the node cache: no download wait (the first "
                "epoch still downloads every shard once)",
         "code": 'ds = LMDBImageDataset("s3://bucket/store/", cache_dir="/local/nvme/cache", cache_limit="<store size>")'},
        {"change": "prefetch deeper: fastload.ShardSampler(ds, window=8) as the DataLoader's sampler",
         "stage": "storage", "expected_gain": warm_gain,
         "why": "the next window's shards download while the current one is read; a bigger window starts them "
                "earlier (the cache must hold 2 windows per rank). It helps only while the link has room"
                + (f": downloads ran at {rate:.1f} MB/s per process" if rate else ""),
         "code": "loader = DataLoader(ds, batch_size=..., sampler=fastload.ShardSampler(ds, window=8), ...)"},
        {"change": "shard size: fewer, larger shards if each is small (per-request latency), smaller ones if the "
                   "first batch waits long", "stage": "storage", "expected_gain": warm_gain,
         "why": "a shard is fetched whole before any of its samples is read"
                + (f"; shards here average {per:.1f} MB" if per else ""),
         "code": "fastload convert DIR s3://bucket/store/ --shard-size 256MB"},
    ]


def _code(created: str | None, changes: dict[str, Any]) -> str:
    """The loader line with ``changes``; where it cannot be read, the keyword to add (with the import)."""
    text = loader_snippet(created, changes)
    if text is not None:
        return text
    kw = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in changes.items())
    head = "from fastload import DataLoader\n" if changes.get("num_workers") == "auto" else ""
    return f"{head}loader = DataLoader(dataset, ..., {kw})"
