"""How many DataLoader workers, and how many intra-op threads for the main process.

Owns: ``auto_num_workers()`` and ``worker_plan()`` (the same number with every input and
the rule, for ``fastload doctor``), and the main-process thread budget.

The rule, per training process:

* CPUs this process may use: ``os.sched_getaffinity`` further limited by the cgroup CPU
  quota (``fastload.system``).
* Divided among the processes on this node: ``LOCAL_WORLD_SIZE`` (set by ``torchrun``),
  else the number of visible GPUs (one process per GPU is the norm), at least 1.
* With 1 CPU per process: 0 workers (loading in the main process; a worker would only
  add inter-process copies).
* On a GPU host (a GPU visible, or ``LOCAL_WORLD_SIZE`` set beside one), every process
  with 2 or more CPUs keeps one CPU of headroom for the training process: launching a
  model's kernels holds the GIL and a core for several ms per step (~8 ms for a ResNet-50
  step, ``tools/launch_cost.py``), besides the optimizer, collation and pinning; a worker
  on that core slows every step it shares it with.
* Without a GPU, with 2-3 CPUs: one worker per CPU (no headroom: the rule assumes the step
  leaves the CPUs to the loader while it waits on a device elsewhere, as the recipes'
  simulated device does; a model computing on these CPUs competes with the workers, and
  ``fastload profile`` says so). With 4 or more: all but one.

``WorkerPlan.assumption`` says which of these the count assumed, and ``auto_num_workers()``
logs it (logger ``fastload.load.workers``, INFO).

Thread budget: DataLoader workers already run with one intra-op thread each (torch sets
it). The main process keeps ``max(1, cpus_per_process - workers)`` intra-op threads, so
main + workers never ask for more CPUs than the process has: on an oversubscribed 2-core
machine every small op after a sleep pays ~15 ms waiting for OpenMP threads to be
scheduled.

/dev/shm preflight (``shm_plan``): worker processes hand each batch's tensors to the main
process through shared memory, which on Linux lives in the ``/dev/shm`` tmpfs; up to
``num_workers × prefetch_factor`` batches are there at once. When that does not fit, the
worker that touches a page past the end gets SIGBUS and the user sees a bare "Bus error"
(Docker's default ``/dev/shm`` is 64 MB). torch's ``file_system`` sharing strategy is no
way out: it also creates its segments with ``shm_open``, i.e. in ``/dev/shm``, so it would
change how segments are named, not how much room they have. So ``fastload.DataLoader``
raises ``SharedMemoryError`` with the fixes instead (``docker run --shm-size``,
``backend="threads"``, fewer workers or a smaller ``prefetch_factor``).

Must not: start processes or touch CUDA beyond counting devices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from fastload.errors import SharedMemoryError
from fastload.system import CpuBudget, cpu_budget

__all__ = ["WorkerPlan", "worker_plan", "auto_num_workers", "main_thread_budget", "ShmPlan", "shm_plan",
           "shm_space", "check_shm"]

SHM_PATH = "/dev/shm"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlan:
    """Every input of the worker-count rule, and its result."""

    cpus: CpuBudget
    local_processes: int
    local_source: str
    visible_gpus: int
    cpus_per_process: int
    workers: int
    main_threads: int
    rule: str
    headroom: int = 0  # CPUs per process left to the training process
    assumption: str = ""  # what the count assumed about the training process

    def explain(self) -> str:
        return "\n".join([
            f"CPUs usable by this process: {self.cpus.explain()}",
            f"processes on this node: {self.local_processes} ({self.local_source})",
            f"CPUs per process: {self.cpus_per_process}",
            f"DataLoader workers per process: {self.workers} ({self.rule})",
            f"assumed: {self.assumption}",
            f"main-process intra-op threads: {self.main_threads} (= max(1, CPUs per process - workers))",
        ])


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def worker_plan(*, env: Mapping[str, str] | None = None, budget: CpuBudget | None = None,
                visible_gpus: int | None = None) -> WorkerPlan:
    """The worker count for one training process, with its reasoning.

    Args:
        env: environment to read ``LOCAL_WORLD_SIZE`` from (default ``os.environ``).
        budget: the CPU budget (default: measured for this process).
        visible_gpus: GPUs this process sees (default: ``torch.cuda.device_count()``).
    """
    env = os.environ if env is None else env
    budget = budget or cpu_budget()
    gpus = _visible_gpus() if visible_gpus is None else visible_gpus
    if env.get("LOCAL_WORLD_SIZE", "").strip().isdigit() and int(env["LOCAL_WORLD_SIZE"]) > 0:
        procs, source = int(env["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    elif gpus > 0:
        procs, source = gpus, "one per visible GPU"
    else:
        procs, source = 1, "no LOCAL_WORLD_SIZE and no GPU: one process"
    per = max(1, budget.available // procs)
    if per == 1:
        workers, rule = 0, "1 CPU: load in the main process"
        assumption = "one CPU: the training process and the loading share it"
    elif gpus > 0:
        workers, rule = per - 1, "GPU host: one worker per CPU, minus one for the training process"
        assumption = ("a GPU trains: the training process needs a CPU of its own for kernel launches (they hold "
                      "the GIL and a core, ~8 ms per ResNet-50 step), the optimizer, collation and pinning")
    elif per <= 3:
        workers, rule = per, "2-3 CPUs, no GPU: one worker per CPU"
        assumption = ("no GPU visible: the step leaves these CPUs to the loader while it waits on a device "
                      "elsewhere; if the model computes on these CPUs, fewer workers may be faster "
                      "(fastload profile measures it)")
    else:
        workers, rule = per - 1, "4+ CPUs: one worker per CPU, minus one for the training process"
        assumption = "the training process needs about one CPU of its own"
    return WorkerPlan(budget, procs, source, gpus, per, workers, max(1, per - workers), rule,
                      headroom=per - workers, assumption=assumption)


def auto_num_workers() -> int:
    """DataLoader workers for this process: ``worker_plan().workers`` (see the module doc).

    Logs the count and what it assumed (logger ``fastload.load.workers``, INFO).
    """
    plan = worker_plan()
    log.info("num_workers='auto' -> %d (%s; %d CPU(s) per process, %d left to the training process). "
             "Assumed: %s.", plan.workers, plan.rule, plan.cpus_per_process, plan.headroom, plan.assumption)
    return plan.workers


def main_thread_budget(num_workers: int) -> int:
    """Intra-op threads for the main process when ``num_workers`` workers share its CPUs."""
    plan = worker_plan()
    return max(1, plan.cpus_per_process - num_workers)


def shm_space(path: str = SHM_PATH) -> tuple[int, int] | None:
    """``(total, free)`` bytes of the filesystem at ``path``, or None where it does not exist."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class ShmPlan:
    """What DataLoader workers would keep in ``/dev/shm``, and whether it fits.

    ``total_bytes``/``free_bytes`` are None where there is no ``/dev/shm`` (then ``ok``).
    """

    path: str
    total_bytes: int | None
    free_bytes: int | None
    num_workers: int
    prefetch_factor: int
    batch_bytes: int
    needed_bytes: int
    ok: bool

    def explain(self) -> str:
        need = (f"{self.num_workers} workers x prefetch_factor {self.prefetch_factor} x "
                f"{self.batch_bytes / 1e6:.1f} MB per batch = {self.needed_bytes / 1e6:.0f} MB")
        if self.free_bytes is None:
            return f"{self.path}: not present; workers need {need}"
        return (f"{self.path}: {self.total_bytes / 1e6:.0f} MB, {self.free_bytes / 1e6:.0f} MB free; workers need "
                f"{need}: " + ("OK" if self.ok else "TOO SMALL (Bus error ahead): docker run --shm-size=<N>g, "
                                                    "or DataLoader(backend='threads'), or fewer workers"))


def shm_plan(num_workers: int, prefetch_factor: int, batch_bytes: int, *, path: str = SHM_PATH) -> ShmPlan:
    """Whether ``num_workers × prefetch_factor`` batches of ``batch_bytes`` fit in ``path``'s free space."""
    for name, v in (("num_workers", num_workers), ("prefetch_factor", prefetch_factor), ("batch_bytes", batch_bytes)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    space = shm_space(path)
    need = num_workers * prefetch_factor * batch_bytes
    total, free = space if space is not None else (None, None)
    return ShmPlan(path, total, free, num_workers, prefetch_factor, batch_bytes, need,
                   free is None or need <= free)


def check_shm(num_workers: int, prefetch_factor: int, batch_bytes: int, *, path: str = SHM_PATH) -> ShmPlan:
    """``shm_plan``, raising when it does not fit (what ``fastload.DataLoader`` runs before workers start).

    Raises:
        SharedMemoryError: the batches in flight need more than ``path`` has free.
    """
    plan = shm_plan(num_workers, prefetch_factor, batch_bytes, path=path)
    if not plan.ok:
        raise SharedMemoryError(
            f"{plan.explain()}.\nDataLoader worker processes pass batches through {path}; with this much "
            "free they would die with 'Bus error'.\nHINT: give the container more shared memory "
            "(docker run --shm-size=8g, or in Kubernetes an emptyDir with medium: Memory mounted at "
            f"{path}); or use fastload.DataLoader(..., backend='threads'), which needs no {path}; or lower "
            "num_workers / prefetch_factor / batch_size.")
    return plan
