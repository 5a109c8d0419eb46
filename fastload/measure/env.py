"""The one environment record written beside every result and printed by ``fastload doctor``.

Owns: which CPUs this process may use, the Python/OS, the versions of torch, CUDA and
every decoder or pipeline library a stage may use, and the GPU. Package names that vary
with the CUDA build (``nvidia-dali-cuda120`` / ``-cuda130``, ``nvidia-nvimgcodec-cu12`` /
``-cu13``) are found by prefix among the installed distributions, so a record never says
"not installed" for a build it did not think of.

Why in ``measure/``: ``report.py`` writes it beside every result; ``doctor.py``, ``profiling/``
and ``bench/`` read it from here.

Must not: print, or import DALI (versions come from package metadata).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

__all__ = ["environment", "package_version", "package_version_by_prefix"]


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_version_by_prefix(prefix: str) -> str | None:
    """``"name version"`` of the first installed distribution whose name starts with ``prefix``."""
    found = []
    for d in importlib.metadata.distributions():
        name = (d.metadata.get("Name") or "").lower()
        if name.startswith(prefix):
            found.append(f"{name} {d.version}")
    return sorted(found)[0] if found else None


def environment() -> dict[str, Any]:
    """CPUs, affinity, cgroup quota, versions and GPU of this process."""
    import torch

    from fastload.system import cpu_budget

    b = cpu_budget()
    v = package_version
    return {
        "python": platform.python_version(), "platform": platform.platform(), "processor": platform.machine(),
        "cpus": {"machine": b.os_cpus, "affinity": b.affinity_cpus, "cgroup_quota": b.cgroup_quota,
                 "usable": b.available},
        "torch": torch.__version__, "torchvision": v("torchvision"), "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "dali": package_version_by_prefix("nvidia-dali"),
        "nvimgcodec": package_version_by_prefix("nvidia-nvimgcodec"),
        "simplejpeg": v("simplejpeg"), "pillow": v("pillow"), "lmdb": v("lmdb"), "fastload": v("fastload"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"), "world_size": os.environ.get("WORLD_SIZE"),
    }
