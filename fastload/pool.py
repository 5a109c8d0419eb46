"""A process pool where a crashing task loses only itself.

An edge module like ``system.py``: conversion (``pack/``) and verification (``store/``)
both run native decoders on untrusted bytes, and ``store/`` sits below ``pack/``.

``concurrent.futures.ProcessPoolExecutor`` breaks as a whole when one worker dies (a
segfault in a native decoder on a malformed file does happen), failing every pending
task. Here each worker has its own pipe and works through its tasks in the order it got
them, so when its process dies the parent knows exactly which task was running: that one
is reported as failed, the ones queued behind it go to other workers, and a fresh worker
takes its place.

Workers are started with ``spawn`` (no LMDB handle or torch thread pool is inherited)
and ignore SIGINT, so Ctrl-C reaches only the parent, which then stops them.

Must not: know what the tasks are.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

from fastload.errors import ConvertError

_DEPTH = 2  # tasks queued per worker: one running, one ready


class TaskError(str):
    """The reason a task raised (``"Type: message"``, a ``str`` so callers can report it as one), and
    ``io``: whether it was an I/O failure (an ``OSError``, or an error that says so with ``io_failure``),
    i.e. the input could not be read now, not that it is bad. Callers fail the work on those rather
    than record the input as skipped (a retry may succeed)."""

    io: bool

    def __new__(cls, text: str, io: bool = False) -> TaskError:
        obj = super().__new__(cls, text)
        obj.io = io
        return obj

    def __reduce__(self):
        return (TaskError, (str(self), self.io))

    @classmethod
    def of(cls, exc: BaseException) -> TaskError:
        io = isinstance(exc, OSError) or bool(getattr(exc, "io_failure", False))
        return cls(f"{type(exc).__name__}: {exc}", io)


def _worker_main(conn, handler: str, init: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    module, _, name = handler.partition(":")
    fn = getattr(importlib.import_module(module), name)
    conn.send((-1, True, None))  # ready: a death from here on is a task's fault
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        seq, payload = msg
        try:
            result = (seq, True, fn(payload, init))
        except Exception as exc:  # reported per task; the worker carries on
            result = (seq, False, TaskError.of(exc))
        try:
            conn.send(result)
        except (BrokenPipeError, OSError):
            return


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class _Worker:
    def __init__(self, ctx, handler: str, init: Any) -> None:
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, handler, init), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self.inflight: deque[int] = deque()
        self.ready = False

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def imap_isolated(handler: str, init: Any, payloads: Sequence[Any], workers: int, *,
                  window: int | None = None) -> Iterator[tuple[int, bool, Any]]:
    """Run ``handler(payload, init)`` over ``payloads`` in worker processes.

    Args:
        handler: ``"module:function"``, imported in each worker.
        init: a picklable second argument for every call.
        payloads: the tasks.
        workers: number of processes.
        window: how far past the oldest unfinished task work may run ahead (bounds memory).

    Yields:
        ``(index, ok, result_or_reason)`` in ``payloads`` order. A task that raised yields
        ``ok=False`` and a ``TaskError`` (its ``io`` says an I/O failure); a task whose worker
        died yields ``ok=False`` and a plain ``str`` reason.

    Raises:
        ConvertError: workers die before doing any work (a broken installation).
    """
    n = len(payloads)
    if n == 0:
        return
    workers = max(1, min(workers, n))
    window = window or max(64, workers * 16)
    ctx = mp.get_context("spawn")
    pool = [_Worker(ctx, handler, init) for _ in range(workers)]
    results: dict[int, tuple[bool, Any]] = {}
    redo: deque[int] = deque()
    next_new = 0
    next_out = 0
    startup_deaths = 0  # workers that died before they could take work
    try:
        while next_out < n:
            for w in pool:
                while len(w.inflight) < _DEPTH:
                    if redo:
                        seq = redo.popleft()
                    elif next_new < n and next_new < next_out + window:
                        seq = next_new
                        next_new += 1
                    else:
                        break
                    w.conn.send((seq, payloads[seq]))
                    w.inflight.append(seq)
            busy = [w for w in pool if w.inflight]
            signalled = wait([w.conn for w in busy] + [w.proc.sentinel for w in busy])
            for i, w in enumerate(pool):
                if w.conn in signalled:
                    try:
                        while w.conn.poll():
                            seq, ok, value = w.conn.recv()
                            if seq == -1:
                                w.ready = True
                                continue
                            w.inflight.popleft()
                            results[seq] = (ok, value)
                    except (EOFError, OSError):
                        pass  # died mid-send; the sentinel branch below handles it
                if w.proc.sentinel in signalled or not w.proc.is_alive():
                    w.proc.join()
                    if not w.proc.is_alive():
                        if w.inflight and w.ready:
                            culprit = w.inflight.popleft()
                            results[culprit] = (False, "decoding crashed the worker process "
                                                       f"({_describe_exit(w.proc.exitcode)})")
                        redo.extendleft(reversed(w.inflight))
                        if not w.ready:
                            startup_deaths += 1
                            if startup_deaths > 3 * workers:
                                raise ConvertError(
                                    f"conversion workers keep dying before finishing any file "
                                    f"({_describe_exit(w.proc.exitcode)}); is the installation broken?"
                                )
                        w.conn.close()
                        pool[i] = _Worker(ctx, handler, init)
            while next_out in results:
                ok, value = results.pop(next_out)
                yield next_out, ok, value
                next_out += 1
    finally:
        for w in pool:
            w.stop()
