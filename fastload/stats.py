"""Summary statistics shared by ``measure/`` and ``serve/``: an edge module, like ``system.py``.

Owns: ``percentiles()``, the one p50/p90/p99/mean summary every report prints.

Must not: import anything from fastload's rooms (both ``measure/`` and ``serve/`` stand on it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["percentiles"]


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and mean of ``values`` (all 0.0 when there are none)."""
    if not len(values):
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}
