"""How many DataLoader workers, and how many intra-op threads for the main process.

Owns: ``auto_num_workers()`` and ``worker_plan()`` (the same number with every input and
the rule, for ``fastload doctor``), and the main-process thread budget.

The rule, per training process:

* CPUs this process may use: ``os.sched_getaffinity`` further limited by the cgroup CPU
  quota (``fastload.system``).
* Divided among the processes on this node: ``LOCAL_WORLD_SIZE`` (set by ``torchrun``),
  else the number of visible GPUs (one process per GPU is the norm), at least 1.
* With 1 CPU per process: 0 workers (loading in the main process; a worker would only
  add inter-process copies). With 2-3: one worker per CPU: while the GPU computes, the
  training process mostly waits, and leaving one of two or three CPUs idle would throw
  away a third to half of the decode capacity. With 4 or more: all but one, which is left
  to the training process (kernel launches, the optimizer, collation, pinning).

Thread budget: DataLoader workers already run with one intra-op thread each (torch sets
it). The main process keeps ``max(1, cpus_per_process - workers)`` intra-op threads, so
main + workers never ask for more CPUs than the process has: on an oversubscribed 2-core
machine every small op after a sleep pays ~15 ms waiting for OpenMP threads to be
scheduled.

Must not: start processes or touch CUDA beyond counting devices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fastload.system import CpuBudget, cpu_budget

__all__ = ["WorkerPlan", "worker_plan", "auto_num_workers", "main_thread_budget"]


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

    def explain(self) -> str:
        return "\n".join([
            f"CPUs usable by this process: {self.cpus.explain()}",
            f"processes on this node: {self.local_processes} ({self.local_source})",
            f"CPUs per process: {self.cpus_per_process}",
            f"DataLoader workers per process: {self.workers} ({self.rule})",
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
    elif per <= 3:
        workers, rule = per, "2-3 CPUs: one worker per CPU, the main process mostly waits on the GPU"
    else:
        workers, rule = per - 1, "4+ CPUs: one worker per CPU, minus one for the training process"
    return WorkerPlan(budget, procs, source, gpus, per, workers, max(1, per - workers), rule)


def auto_num_workers() -> int:
    """DataLoader workers for this process: ``worker_plan().workers`` (see the module doc)."""
    return worker_plan().workers


def main_thread_budget(num_workers: int) -> int:
    """Intra-op threads for the main process when ``num_workers`` workers share its CPUs."""
    plan = worker_plan()
    return max(1, plan.cpus_per_process - num_workers)
