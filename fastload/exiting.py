"""One deadline for everything fastload waits for while the interpreter exits.

Owns: ``EXIT_BUDGET_S`` and ``wait_left(cap)``, the seconds an exit handler may still wait.

Why: CPython ends the daemon threads still running at exit with ``pthread_exit`` while it
finalises, and a thread caught inside a torch or decoder call then unwinds through C++ frames
and aborts the process ("terminate called without an active exception", exit status 134). So
the thread loader's pools (``load/threads.py``), the serving batcher (``serve/batcher.py``) and
its router (``serve/replicas.py``) stop their threads in exit handlers first, each waiting a
while (its own cap) for a thread still inside a long call. Each waiting its own time, a script
that ended with several of them stuck would wait the sum; here they share one budget. The
first exit handler that asks starts the clock; later ones get what is left, and with nothing
left they stop their threads without waiting for them, or wait only the floor they ask for (the
thread loader's pools: half a second, for a thread in the middle of an ordinary sample). A
thread still stuck then is left to the interpreter, as before these handlers existed.

Must not: import anything of fastload's, or be called outside exit handlers (the clock, once
started, never restarts).
"""

from __future__ import annotations

import threading
import time

__all__ = ["EXIT_BUDGET_S", "wait_left"]

# all of fastload's exit handlers together wait at most this long (torch gives one worker process
# 5 s to exit before terminating it; a few stuck threads get twice that in all)
EXIT_BUDGET_S = 10.0

_lock = threading.Lock()
_deadline: float | None = None


def wait_left(cap: float, floor: float = 0.0) -> float:
    """Seconds an exit handler may wait now: ``cap``, or less when the shared budget has less left, but
    never less than ``floor`` (what a thread finishing ordinary work needs; past the budget).

    The first call starts the budget (``EXIT_BUDGET_S`` from now); call it only while exiting.
    """
    global _deadline
    now = time.monotonic()
    with _lock:
        if _deadline is None:
            _deadline = now + EXIT_BUDGET_S
        left = _deadline - now
    return max(floor, 0.0, min(cap, left))
