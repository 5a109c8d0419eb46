"""When a batch leaves (``BatchPolicy``) and when each stage of a request happened (``RequestTiming``).

Pure values: the policy is a function of the clock and the arrival times, so it is tested
with a fake clock.

Must not: hold locks, threads or tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The batching defaults, written once: ``ServeOptions``, ``DynamicBatcher``, ``fastload serve``
#: and ``fastload bench serve`` all take them from here.
DEFAULT_MAX_BATCH = 32
DEFAULT_MAX_WAIT_MS = 8.0
DEFAULT_MAX_QUEUE = 256

__all__ = ["BatchPolicy", "RequestTiming"]


@dataclass(frozen=True)
class BatchPolicy:
    """When does a batch leave? Pure, so it can be tested with a fake clock.

    ``decide(now, arrivals)`` with the arrival times of the ready requests (oldest first)
    returns ``(n, 0)`` to send the first ``n`` now, or ``(0, seconds)`` to wait that long.
    """

    max_batch: int
    max_wait_s: float

    def decide(self, now: float, arrivals: Sequence[float]) -> tuple[int, float]:
        if not arrivals:
            return 0, float("inf")
        if len(arrivals) >= self.max_batch:
            return self.max_batch, 0.0
        due = arrivals[0] + self.max_wait_s
        if now >= due:
            return len(arrivals), 0.0
        return 0, due - now


@dataclass
class RequestTiming:
    """When each stage of one request happened (``time.perf_counter`` seconds)."""

    id: int
    queued: float
    preprocess_start: float = 0.0
    preprocess_end: float = 0.0
    batched: float = 0.0
    compute_start: float = 0.0
    compute_end: float = 0.0
    returned: float = 0.0
    batch_size: int = 0
    ok: bool = True
