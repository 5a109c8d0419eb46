"""What this process has: the CPUs it may really use (affinity mask, cgroup CPU quota),
which device ``"auto"`` means, and whether DALI is installed.

An edge module like ``errors.py``: ``pack/`` (conversion workers), ``load/``
(``auto_num_workers``, DALI), ``measure/`` and ``serve/`` all need these answers, and each
is written once, here.

``os.cpu_count()`` reports the machine's CPUs; a process pinned by ``taskset``, Slurm or
Kubernetes may use fewer (``os.sched_getaffinity``), and a container may be throttled to
a fraction of them by a CFS quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``). Spawning more workers than that only adds context switches.

Must not: import torch at module level (``resolve_device`` imports it when called).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuBudget", "cpu_budget", "available_cpus", "cgroup_cpu_quota", "resolve_device", "dali_available",
           "DALI_INSTALL_HINT"]

DALI_INSTALL_HINT = ("pip install 'fastload[dali]'   (nvidia-dali-cuda130, matching torch's CUDA 13 build; "
                     "CPU mode works without a GPU)")


def dali_available() -> bool:
    """Whether NVIDIA DALI is importable here (checked without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    except (ImportError, ValueError):
        return False


def resolve_device(name=None, *, what: str = "device"):
    """``"auto"``/None → cuda when a CUDA device is usable, else cpu; ``"cuda"`` without one is an error.

    Accepts a ``torch.device`` or a string such as ``"cpu"``, ``"cuda"``, ``"cuda:1"``.

    Raises:
        ValueError: CUDA was asked for and none is available (names ``what``).
    """
    import torch

    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} is {str(device)!r} but no CUDA device is available here; use 'auto' or 'cpu'.")
    return device


@dataclass(frozen=True)
class CpuBudget:
    """The inputs and the result of the CPU count rule."""

    os_cpus: int
    affinity_cpus: int
    cgroup_quota: float | None  # CPUs' worth of time per period; None = unlimited
    cgroup_source: str | None
    available: int

    def explain(self) -> str:
        quota = "none" if self.cgroup_quota is None else f"{self.cgroup_quota:g} CPUs ({self.cgroup_source})"
        return (f"{self.available} usable = min(affinity {self.affinity_cpus}, "
                f"ceil(cgroup quota {quota})); the machine has {self.os_cpus}")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(fs_root: Path, proc_cgroup: str | None) -> tuple[float, str] | None:
    rel = "/"
    for line in (proc_cgroup or "").splitlines():
        if line.startswith("0::"):
            rel = line[3:] or "/"
    best: tuple[float, str] | None = None
    d = fs_root / rel.lstrip("/")
    while True:  # a limit on any ancestor applies too; the tightest wins
        text = _read(d / "cpu.max")
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max":
                cpus = int(quota) / int(period or 100000)
                if best is None or cpus < best[0]:
                    best = (cpus, str(d / "cpu.max"))
        if d == fs_root or d.parent == d or fs_root not in d.parents:
            break
        d = d.parent
    return best


def _v1_quota(fs_root: Path) -> tuple[float, str] | None:
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota, period = _read(fs_root / sub / "cpu.cfs_quota_us"), _read(fs_root / sub / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0 and int(period) > 0:
            return int(quota) / int(period), str(fs_root / sub / "cpu.cfs_quota_us")
    return None


def cgroup_cpu_quota(fs_root: str | os.PathLike[str] = "/sys/fs/cgroup",
                     proc_cgroup: str | None = None) -> tuple[float, str] | None:
    """The CFS quota in CPUs and the file it came from, or None when there is none.

    Args:
        fs_root: where the cgroup filesystem is mounted (tests point it at a fake tree).
        proc_cgroup: contents of ``/proc/self/cgroup``; read from there when None.
    """
    root = Path(fs_root)
    if proc_cgroup is None:
        proc_cgroup = _read(Path("/proc/self/cgroup"))
    return _v2_quota(root, proc_cgroup) or _v1_quota(root)


def cpu_budget(fs_root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | None = None,
               affinity: set[int] | None = None) -> CpuBudget:
    """CPUs this process may use: affinity, further limited by a cgroup CPU quota."""
    os_cpus = os.cpu_count() or 1
    if affinity is None:
        try:
            affinity = os.sched_getaffinity(0)
        except AttributeError:  # macOS, Windows
            affinity = set(range(os_cpus))
    n_aff = max(1, len(affinity))
    quota = cgroup_cpu_quota(fs_root, proc_cgroup)
    available = n_aff if quota is None else max(1, min(n_aff, math.ceil(quota[0] - 1e-9)))
    return CpuBudget(os_cpus, n_aff, None if quota is None else quota[0],
                     None if quota is None else quota[1], available)


def available_cpus() -> int:
    """``cpu_budget().available``."""
    return cpu_budget().available
