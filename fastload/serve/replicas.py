"""``Router``: one front for several ``DynamicBatcher`` replicas (one per device), with run-time fallback.

Owns: starting the replicas (each warms up before it takes traffic; the router is ready
as soon as one is), least-loaded routing (the replica with the fewest accepted,
unanswered requests), and what happens when a device fails: a batch whose model call
raised (CUDA error, out of memory) comes back as ``DeviceFailure``; each of its requests is
retried once, on the least-loaded other healthy replica or else on the CPU ``fallback``
replica, or fails with ``DeviceFailure`` (HTTP 503) when there is none. The failing
replica is marked unhealthy, takes no traffic, and is re-probed with a warm-up batch every
``probe_interval_s`` until the probe passes. While no device replica is healthy, new
requests go to the fallback (``/healthz`` still says not ready, so a load balancer can
prefer healthier instances).

Same interface as ``DynamicBatcher`` for the fronts (``submit``, ``submit_async``, ``ready``, ``stats``,
``trace``, ``stop``), so ``http.py`` serves either.

Must not: know about HTTP, or batch by itself (each replica batches its own requests).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from fastload import exiting
from fastload.errors import DeviceFailure, Overloaded
from fastload.serve._futures import await_future
from fastload.serve.batcher import EXIT_JOIN_S, DynamicBatcher

__all__ = ["Router"]

log = logging.getLogger("fastload.serve")


class _Ready:
    """``threading.Event``-like view: set while at least one replica is ready and healthy."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def is_set(self) -> bool:
        return bool(self._router.healthy())


class Router:
    """Route requests to the least-loaded healthy replica; retry a failed device's batch once elsewhere.

    Args:
        replicas: the batchers that take traffic (one per device, or several on the CPU).
        fallback: a CPU batcher used only to retry requests whose device failed.
        probe_interval_s: how often an unhealthy replica is probed with a warm-up batch.
    """

    def __init__(self, replicas: Sequence[DynamicBatcher], *, fallback: DynamicBatcher | None = None,
                 probe_interval_s: float = 5.0) -> None:
        if not replicas:
            raise ValueError("a Router needs at least one replica")
        if probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be > 0, got {probe_interval_s}")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must differ, got {names}")
        self.replicas = list(replicas)
        self.fallback = fallback
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self._unhealthy: set[str] = set()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.retried = 0
        self.device_failures = 0
        self.ready = _Ready(self)

    @property
    def device(self) -> str:
        return ",".join(r.name for r in self.replicas)

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> Router:
        """Warm every replica up (in parallel); each takes traffic as soon as its own warm-up ends.

        ``wait=False`` returns at once (``ready.is_set()`` turns true with the first replica).
        """
        starters = [threading.Thread(target=self._start_one, args=(b,), name=f"fastload-warmup-{b.name}",
                                     daemon=True) for b in self._every()]
        # a script that ends without stop() while a warm-up or a re-probe runs the model: CPython ends daemon
        # threads with pthread_exit while it finalises, and one returning from a torch call then unwinds through
        # C++ frames and aborts the process (exit status 134, 4 of 4 runs of a replica re-probed at exit). At
        # exit the router stops first: no new probe starts, the ones running finish (EXIT_JOIN_S in all)
        atexit.unregister(self._stop_at_exit)  # a stop() that left a probe running kept it registered: once
        atexit.register(self._stop_at_exit)
        with self._lock:  # started under the lock: a stop() joins only threads that run
            self._stopping.clear()  # a stopped router can be started again
            self._threads = [t for t in self._threads if t.is_alive()] + starters
            for t in starters:
                t.start()
        if wait:
            for t in starters:
                t.join()
        return self

    def _every(self) -> list[DynamicBatcher]:
        return self.replicas + ([self.fallback] if self.fallback is not None else [])

    def _start_one(self, b: DynamicBatcher) -> None:
        try:
            b.start()
        except Exception as exc:
            log.error("replica %s failed its warm-up (%s: %s); it takes no traffic and is re-probed",
                      b.name, type(exc).__name__, exc)
            self._mark_unhealthy(b, started=False)
            return
        if self._stopping.is_set():  # stop() ran while this replica warmed up: it must not stay started
            b.stop(drain=False)

    def stop(self, *, drain: bool = True, timeout: float | None = 30.0) -> None:
        """Stop every replica (``drain``: finish what they accepted) and the warm-ups and re-probes."""
        with self._lock:
            self._stopping.set()
        for b in self._every():
            b.stop(drain=drain, timeout=timeout)
        self._join_threads(timeout)
        with self._lock:
            if not any(t.is_alive() for t in self._threads):  # else the exit handler still has one to wait for
                atexit.unregister(self._stop_at_exit)

    def _join_threads(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _stop_at_exit(self) -> None:
        with self._lock:
            self._stopping.set()  # no probe starts from here on
        self._join_threads(exiting.wait_left(EXIT_JOIN_S))  # the probes inside the model return first
        for b in self._every():  # within the exit budget shared with fastload's other exit handlers
            b.stop(drain=False, timeout=exiting.wait_left(EXIT_JOIN_S))

    def healthy(self) -> list[DynamicBatcher]:
        with self._lock:
            return [r for r in self.replicas if r.ready.is_set() and r.name not in self._unhealthy]

    def _mark_unhealthy(self, b: DynamicBatcher, *, started: bool = True) -> None:
        with self._lock:
            if b.name in self._unhealthy:
                return
            self._unhealthy.add(b.name)
        log.warning("replica %s marked unhealthy; re-probing every %gs", b.name, self.probe_interval_s)
        t = threading.Thread(target=self._reprobe, args=(b, started), name=f"fastload-probe-{b.name}", daemon=True)
        with self._lock:
            if self._stopping.is_set():
                return
            self._threads.append(t)
            t.start()

    def _reprobe(self, b: DynamicBatcher, started: bool) -> None:
        while not self._stopping.wait(self.probe_interval_s):
            try:
                if started:
                    b.probe()
                else:
                    b.start()
            except Exception as exc:
                log.info("replica %s still failing its probe: %s", b.name, exc)
                continue
            if not started and self._stopping.is_set():  # started while the router stopped: stop it again
                b.stop(drain=False)
                return
            with self._lock:
                self._unhealthy.discard(b.name)
            log.warning("replica %s passed its probe; taking traffic again", b.name)
            return

    # ---- routing --------------------------------------------------------------------------

    def _pick(self, exclude: str | None = None) -> list[DynamicBatcher]:
        return sorted((r for r in self.healthy() if r.name != exclude), key=lambda r: r.load)

    def submit(self, data: bytes, *, timeout: float | None = None) -> concurrent.futures.Future:
        """Queue one encoded image on the least-loaded healthy replica (see ``DynamicBatcher.submit``).

        Raises:
            Overloaded: every healthy replica's queue is full.
            DeviceFailure: no replica is healthy.
        """
        candidates = self._pick()
        if not candidates and self.fallback is not None and self.fallback.ready.is_set():
            candidates = [self.fallback]  # every device is down: the CPU fallback serves (slower) meanwhile
        if not candidates:
            raise DeviceFailure("no healthy replica: every device failed or is still warming up; retry later")
        outer: concurrent.futures.Future = concurrent.futures.Future()
        deadline = None if timeout is None else time.perf_counter() + timeout
        last: Exception | None = None
        for replica in candidates:
            try:
                inner = replica.submit(data, timeout=timeout)
            except (Overloaded, RuntimeError) as exc:  # full, or stopped meanwhile: try the next one
                last = exc
                continue
            holder = [inner]
            outer.add_done_callback(lambda f, holder=holder: f.cancelled() and holder[0].cancel())
            inner.add_done_callback(lambda f, r=replica, holder=holder: self._chain(f, outer, r, data, deadline,
                                                                                     holder, retried=False))
            return outer
        raise last if isinstance(last, Overloaded) else Overloaded(f"no replica accepted the request: {last}")

    async def submit_async(self, data: bytes, *, timeout: float | None = None) -> Any:
        """``await`` the output for one encoded image (see ``DynamicBatcher.submit_async``), with the same routing."""
        return await await_future(self.submit(data, timeout=timeout), timeout)

    def _chain(self, inner: concurrent.futures.Future, outer: concurrent.futures.Future, replica: DynamicBatcher,
               data: bytes, deadline: float | None, holder: list, *, retried: bool) -> None:
        if outer.done():
            return
        if inner.cancelled():
            outer.cancel()
            return
        exc = inner.exception()
        if isinstance(exc, DeviceFailure) and not retried:
            with self._lock:
                self.device_failures += 1
            self._mark_unhealthy(replica)
            alternatives = self._pick(exclude=replica.name)
            if not alternatives and self.fallback is not None and self.fallback.ready.is_set():
                alternatives = [self.fallback]
            remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
            for alt in alternatives:
                try:
                    retry = alt.submit(data, timeout=remaining)
                except (Overloaded, RuntimeError):
                    continue
                with self._lock:
                    self.retried += 1
                holder[0] = retry
                retry.add_done_callback(lambda f, r=alt: self._chain(f, outer, r, data, deadline, holder,
                                                                     retried=True))
                return
            exc = DeviceFailure(f"{exc}; no other healthy replica to retry on")
        self._copy(inner, outer, exc)

    @staticmethod
    def _copy(inner: concurrent.futures.Future, outer: concurrent.futures.Future, exc: BaseException | None) -> None:
        try:
            if exc is None:
                outer.set_result(inner.result())
            else:
                outer.set_exception(exc)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    # ---- reporting ------------------------------------------------------------------------

    def unhealthy(self) -> list[str]:
        """Names of the replicas marked unhealthy (re-probed until they answer again)."""
        with self._lock:
            return sorted(self._unhealthy)

    def stats(self) -> dict[str, Any]:
        """Totals over the replicas, and each replica's own ``stats()``."""
        per = [r.stats() for r in self.replicas]
        keys = ("submitted", "completed", "failed", "rejected", "expired", "batches", "waiting", "in_flight",
                "gpu_decoded", "cpu_decoded", "gpu_decode_fallbacks")
        total = {k: sum(s[k] for s in per) for k in keys}
        return {"device": self.device, "ready": self.ready.is_set(), **total, "retried": self.retried,
                "device_failures": self.device_failures, "unhealthy": self.unhealthy(),
                "replicas": per, "fallback": self.fallback.stats() if self.fallback is not None else None}

    def trace(self) -> dict[str, Any]:
        """Every replica's Chrome trace, one process per replica."""
        events: list[dict[str, Any]] = []
        for pid, r in enumerate(self.replicas, start=1):
            for e in r.trace()["traceEvents"]:
                events.append({**e, "pid": pid})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def batchers(self) -> list[DynamicBatcher]:
        """Every batcher behind this router (the fallback last), for ``/metrics``."""
        return self.replicas + ([self.fallback] if self.fallback is not None else [])
