"""``DynamicBatcher``: time-window batching for inference with the training preprocessing.

Owns: accepting requests (encoded image bytes), checking each image's declared pixels
against a serving budget from its header before decoding, preprocessing them in parallel
with the eval preset the training path uses, grouping them into batches (a batch leaves
as soon as it holds ``max_batch`` requests or its oldest request has waited
``max_wait_ms``; ``0`` is greedy: whatever arrived while the model was busy), running the
model (optionally in bf16/fp16), routing each output row back to its future, refusing
work when ``max_queue`` requests are waiting (``Overloaded``), deadlines (an expired or
cancelled request leaves the queue at once), warm-up, device placement, GPU decode for
big batches (counted, fallbacks logged), and per-request timings (``stats()``,
``trace()``, histograms for ``/metrics``).

Why a short window: one request at a time leaves the device idle between tiny batches;
a long fixed wait (50 ms is common) adds that much latency to every request at low load.
A batcher that sends whatever arrived while the model was busy already batches under
load (Triton's dynamic batcher works the same way); a window of a few milliseconds with
a cap on the batch adds batching at moderate load and costs at most the window.

Must not: know about HTTP (``http.py``) or about other replicas (``replicas.py``).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastload import exiting
from fastload.errors import DeadlineExceeded, DeviceFailure, Overloaded
from fastload.image import DEFAULT_RESIZE, DEFAULT_SIZE
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD, EvalTransform, normalize
from fastload.serve._futures import await_future
from fastload.serve.metrics import StageHistograms, trace_events
from fastload.serve.policy import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_MS, BatchPolicy, RequestTiming
from fastload.serve.preprocess import SERVE_MAX_PIXELS, DTYPES, check_request_pixels, decode_request, pick_device
from fastload.stats import percentiles

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming", "DTYPES", "SERVE_MAX_PIXELS"]

log = logging.getLogger("fastload.serve")

# how long the exit handler waits for the batch already in the model (a stuck model is then left to the
# interpreter, as before)
EXIT_JOIN_S = 10.0


@dataclass
class _Request:
    id: int
    data: bytes
    future: concurrent.futures.Future
    timing: RequestTiming
    deadline: float | None = None
    image: torch.Tensor | None = None
    state: str = "pre"  # pre (being preprocessed) → ready → batched → done; or dropped


@dataclass
class _Stats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    expired: int = 0
    batches: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    warmup_s: float = 0.0
    busy_s: float = 0.0
    started: float = 0.0
    gpu_decoded: int = 0
    cpu_decoded: int = 0
    gpu_decode_fallbacks: int = 0


class DynamicBatcher:
    """Batch requests in a short time window and run ``model`` on them.

    Args:
        model: an ``nn.Module`` (or callable) taking a float NCHW batch, returning a
            tensor whose first dimension is the batch.
        preprocess: bytes → uint8 CHW tensor; default ``EvalTransform()`` (``DEFAULT_SIZE``, ``DEFAULT_RESIZE``) — the
            evaluation preset training uses, so serving sees exactly the training tensors.
        max_batch: largest batch sent to the model.
        max_wait_ms: how long the oldest ready request may wait for others (0: greedy).
        max_queue: requests waiting (submitted, not yet sent to the model) before
            ``submit`` raises ``Overloaded``.
        device: ``"auto"`` (CUDA when usable, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:1"``.
        workers: preprocessing threads (decoders release the GIL).
        gpu_decode_min_batch: on CUDA, decode whole batches of at least this many JPEGs on
            the GPU (``torchvision.io.decode_jpeg(device="cuda")``); smaller batches and
            other formats decode on the CPU. None: always CPU.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the model's parameters and input.
        max_pixels: refuse images declaring more pixels in their header (before decoding).
        mean, std: normalisation (0..1 scale), applied on the device.
        history: how many finished requests ``stats()`` and ``trace()`` look back over.
        name: how logs and metrics name this batcher (a replica's name).
        window_from: ``"arrival"`` (default): a request's window starts when it was
            submitted, so ``max_wait_ms`` bounds the added latency; ``"ready"``: when its
            preprocessing ended, as in a server that decodes in the request thread and then
            queues for a batch (how ``bench serve`` models the seed's service).
    """

    def __init__(self, model: Callable[[torch.Tensor], torch.Tensor], *,
                 preprocess: Callable[[bytes], torch.Tensor] | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 max_wait_ms: float = DEFAULT_MAX_WAIT_MS, max_queue: int = DEFAULT_MAX_QUEUE, device: str = "auto",
                 workers: int = 2,
                 gpu_decode_min_batch: int | None = None, dtype: str = "fp32",
                 max_pixels: int = SERVE_MAX_PIXELS, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, history: int = 10_000, name: str | None = None,
                 window_from: str = "arrival") -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if dtype not in DTYPES:
            raise ValueError(f"Unknown value {dtype!r} for argument dtype. Valid values are {', '.join(DTYPES)}.")
        if max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {max_pixels}")
        self.model = model
        self.preprocess = preprocess or EvalTransform(DEFAULT_SIZE, DEFAULT_RESIZE)
        self.policy = BatchPolicy(max_batch, max_wait_ms / 1e3)
        self.max_queue = max_queue
        self.device = pick_device(device)
        self.name = name or str(self.device)
        if window_from not in ("arrival", "ready"):
            raise ValueError(f"Unknown value {window_from!r} for argument window_from. Valid values are 'arrival', "
                             "'ready'.")
        self._from_ready = window_from == "ready"
        self.gpu_decode_min_batch = gpu_decode_min_batch if self.device.type == "cuda" else None
        self.dtype = DTYPES[dtype]
        self.max_pixels = max_pixels
        self.mean, self.std = tuple(mean), tuple(std)
        self._workers = max(1, workers)
        self._pool = self._new_pool()
        self._pool_open = True  # False once stop() shut it down: start() makes a new one
        self._life = threading.Lock()  # start() and stop() one at a time (stop() from two threads, or at exit)
        self._stops = 0  # stop() calls so far: a start() whose warm-up saw one begin does not start
        self._cond = threading.Condition()
        self._ready: collections.deque[_Request] = collections.deque()
        self._inflight: dict[int, _Request] = {}  # submitted, future not yet resolved
        self._waiting = 0  # submitted and not yet sent to the model (nor dropped)
        self._ids = 0
        self._stats = _Stats()
        self.histograms = StageHistograms()
        self._done: collections.deque[RequestTiming] = collections.deque(maxlen=history)
        self._thread: threading.Thread | None = None
        self._stuck: threading.Thread | None = None  # a model thread stop() stopped waiting for
        self._accepting = False
        self._stopping = False
        self._warned_gpu_fallback = False
        self.ready = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- lifecycle ------------------------------------------------------------------------

    def _dummy_batch(self) -> torch.Tensor:
        size = getattr(self.preprocess, "size", DEFAULT_SIZE)
        return torch.zeros(self.policy.max_batch, 3, size, size, dtype=torch.uint8)

    def probe(self) -> float:
        """Run one full dummy batch through the model (warm-up, or a health re-probe); seconds taken.

        Raises:
            DeviceFailure: the model failed on it.
        """
        t0 = time.perf_counter()
        try:
            self._run_model(self._dummy_batch())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            raise DeviceFailure(f"{self.name}: the model failed on a probe batch: {type(exc).__name__}: {exc}") \
                from exc
        return time.perf_counter() - t0

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(self._workers, thread_name_prefix="fastload-pre")

    def start(self) -> DynamicBatcher:
        """Warm up with one full dummy batch (CUDA context, cudnn autotune), then accept work.

        A stopped batcher can be started again (its preprocessing threads are made anew).
        """
        with self._life:
            return self._start(self._stops)

    def _start(self, stops: int) -> DynamicBatcher:
        if self._thread is not None:
            return self
        if self._stuck is not None and self._stuck.is_alive():
            raise RuntimeError(f"{self.name}: the batcher's previous model thread is still inside the model (stop() "
                               "stopped waiting for it); starting another would run two batch loops.\nHINT: wait "
                               "for the model call to return, or make a new DynamicBatcher.")
        if not self._pool_open:  # stopped before: its executor is shut down and takes no new work
            self._pool, self._pool_open = self._new_pool(), True
        if isinstance(self.model, torch.nn.Module):
            self.model = self.model.to(self.device, self.dtype).eval()
        self._stats.warmup_s = self.probe()
        if self._stops != stops:  # stop() was called during the warm-up (and may have given up waiting for it)
            log.info("DynamicBatcher %s: stopped during its warm-up; not started", self.name)
            return self
        self._stats.started = time.perf_counter()
        self._accepting, self._stopping = True, False
        self._thread = threading.Thread(target=self._loop, name=f"fastload-batcher-{self.name}", daemon=True)
        self._thread.start()
        # a script that ends without stop(): CPython ends daemon threads with pthread_exit while it finalises,
        # and the batcher's thread, caught inside the model or a torch op, unwinds through C++ frames and
        # aborts the process ("terminate called without an active exception", exit status 134; 6 of 6 runs
        # of a CPU model with work queued). At exit the batcher stops first: the requests still waiting for
        # the model are cancelled, the batch in it finishes (waited for at most EXIT_JOIN_S). Preprocessing
        # already queued runs before that: concurrent.futures joins its threads before atexit handlers run
        atexit.register(self._stop_at_exit)
        self.ready.set()
        log.info("DynamicBatcher %s ready after %.2fs warm-up", self.name, self._stats.warmup_s)
        return self

    def stop(self, *, drain: bool = True, timeout: float | None = 30.0) -> None:
        """Stop accepting work; finish what was accepted (``drain``) or cancel it.

        Safe to call more than once and from several threads at once: a second call waits for
        the first (or for a ``start()`` still warming up, which then does not start) and then
        stops what is left. ``timeout`` bounds the whole call (the wait for that call, for the
        accepted work to drain, for the model thread): when the first runs out, the call logs and
        returns, leaving the stop to the call in progress.
        """
        with self._cond:
            self._stops += 1
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        if not self._life.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            log.warning("DynamicBatcher %s: another start() or stop() still runs after %ss; leaving the stop to it",
                        self.name, timeout)
            return
        try:
            self._stop(drain, deadline)
        finally:
            self._life.release()

    def _stop(self, drain: bool, deadline: float | None) -> None:
        """``stop()`` holding the lifecycle lock; every wait ends by ``deadline`` (monotonic; None: none)."""
        with self._cond:
            self._accepting = False
            self.ready.clear()
            if not drain:
                self._ready.clear()
                self._waiting = 0
                for req in list(self._inflight.values()):
                    req.state = "dropped"
                    req.future.cancel()
                self._inflight.clear()
        if drain:
            with self._cond:
                while self._waiting and (deadline is None or time.monotonic() < deadline):
                    self._cond.wait(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._stuck = self._thread if self._thread.is_alive() else None
            self._thread = None
            atexit.unregister(self._stop_at_exit)
        self._pool_open = False
        self._pool.shutdown(wait=drain, cancel_futures=not drain)

    def _stop_at_exit(self) -> None:
        # within the exit budget shared with fastload's other exit handlers (a script that ends with several
        # batchers stuck in their models waits EXIT_BUDGET_S in all, not EXIT_JOIN_S each)
        self.stop(drain=False, timeout=exiting.wait_left(EXIT_JOIN_S))

    def __enter__(self) -> DynamicBatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- submitting -----------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Requests accepted and not yet answered (what least-loaded routing compares)."""
        return len(self._inflight)

    def submit(self, data: bytes, *, timeout: float | None = None) -> concurrent.futures.Future:
        """Queue one encoded image; the future resolves to the model's output row (CPU tensor).

        ``timeout``: seconds from now after which the request is dropped from the queue
        (the future fails with ``DeadlineExceeded``) if it has not reached the model.
        Cancelling the future also drops it at once and frees its place in the queue.

        Raises:
            Overloaded: ``max_queue`` requests are already waiting.
            RuntimeError: the batcher is not running.
        """
        with self._cond:
            if not self._accepting:
                raise RuntimeError("the batcher is not accepting work (call start(), or it was stopped)")
            if self._waiting >= self.max_queue:
                self._stats.rejected += 1
                raise Overloaded(f"{self._waiting} requests are waiting (max_queue={self.max_queue}); retry later")
            self._waiting += 1
            self._ids += 1
            self._stats.submitted += 1
            rid = self._ids
            now = time.perf_counter()
            req = _Request(rid, bytes(data), concurrent.futures.Future(), RequestTiming(rid, now),
                           deadline=None if timeout is None else now + timeout)
            self._inflight[rid] = req
        req.future.add_done_callback(lambda f, req=req: self._on_done(req, f))
        if self.gpu_decode_min_batch is not None:
            self._enqueue(req)  # decoded at batch time, on the GPU when the batch is big enough
        else:
            self._pool.submit(self._preprocess, req)
        return req.future

    async def submit_async(self, data: bytes, *, timeout: float | None = None) -> torch.Tensor:
        """``await`` the output row for one encoded image from an event loop (``submit`` never blocks it).

        Past ``timeout`` the request leaves the queue and ``DeadlineExceeded`` is raised;
        cancelling the awaiting task (a client gone) cancels the request too. Raises as
        ``submit`` and its future do.
        """
        return await await_future(self.submit(data, timeout=timeout), timeout)

    def _on_done(self, req: _Request, future: concurrent.futures.Future) -> None:
        if not future.cancelled():
            return
        with self._cond:  # cancelled by the caller (its deadline): leave the queue now
            self._inflight.pop(req.id, None)
            if req.state in ("pre", "ready"):
                if req.state == "ready":
                    try:
                        self._ready.remove(req)
                    except ValueError:
                        pass
                req.state = "dropped"
                self._waiting -= 1
                self._stats.expired += 1
                self._cond.notify_all()

    def _drop_expired(self, req: _Request, now: float) -> bool:
        """Under the lock: a request past its deadline leaves the queue with ``DeadlineExceeded``."""
        if req.deadline is None or now < req.deadline or req.state not in ("pre", "ready"):
            return False
        req.state = "dropped"
        self._waiting -= 1
        self._stats.expired += 1
        self._inflight.pop(req.id, None)
        exc = DeadlineExceeded(f"request {req.id} waited {(now - req.timing.queued) * 1e3:.0f} ms, past its "
                               "deadline, before reaching the model")
        try:  # resolved off the lock: a caller's done-callback may take its own locks
            self._pool.submit(self._set, req.future, None, exc)
        except RuntimeError:  # the pool is shutting down
            self._set(req.future, None, exc)
        return True

    @staticmethod
    def _set(future: concurrent.futures.Future, result: Any, exc: BaseException | None) -> None:
        try:
            if exc is None:
                future.set_result(result)
            else:
                future.set_exception(exc)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile
            pass

    def _preprocess(self, req: _Request) -> None:
        if req.state == "dropped":
            return
        req.timing.preprocess_start = time.perf_counter()
        try:
            req.image = self._decode(req.data)
        except Exception as exc:
            req.timing.preprocess_end = time.perf_counter()
            with self._cond:
                if req.state == "dropped":
                    return
                req.state = "done"
                self._waiting -= 1
                self._cond.notify_all()
            self._fail(req, exc)
            return
        req.timing.preprocess_end = time.perf_counter()
        self._enqueue(req)

    def _decode(self, data: bytes) -> torch.Tensor:
        image = decode_request(self.preprocess, data, self.max_pixels)
        with self._cond:
            self._stats.cpu_decoded += 1
        return image

    def _enqueue(self, req: _Request) -> None:
        with self._cond:
            if req.state == "dropped":
                return
            req.state = "ready"
            self._ready.append(req)
            self._cond.notify_all()

    def _resolve(self, req: _Request, result: Any = None, exc: BaseException | None = None) -> None:
        req.timing.returned = time.perf_counter()
        req.timing.ok = exc is None
        req.state = "done"
        with self._cond:
            self._inflight.pop(req.id, None)
            if exc is None:
                self._stats.completed += 1
            else:
                self._stats.failed += 1
        self._done.append(req.timing)
        if exc is None:
            self.histograms.observe_request(req.timing)
        self._set(req.future, result, exc)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._resolve(req, exc=exc)

    # ---- batching and compute ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping and not self._ready:
                        return
                    now = time.perf_counter()
                    if any(r.deadline is not None for r in self._ready):
                        for r in [r for r in self._ready if self._drop_expired(r, now)]:
                            self._ready.remove(r)
                    n, wait = self.policy.decide(now, [(r.timing.preprocess_end or r.timing.queued)
                                                       if self._from_ready else r.timing.queued for r in self._ready])
                    if n:
                        batch = [self._ready.popleft() for _ in range(n)]
                        for r in batch:
                            r.state = "batched"
                        self._waiting -= n
                        break
                    self._cond.wait(None if wait == float("inf") else min(wait, 0.05))
            self._run_batch(batch)
            with self._cond:
                self._cond.notify_all()

    def _run_batch(self, batch: list[_Request]) -> None:
        now = time.perf_counter()
        for r in batch:
            r.timing.batched = now
            r.timing.batch_size = len(batch)
        if self.gpu_decode_min_batch is not None:
            batch = self._decode_batch(batch)
            if not batch:
                return
        start = time.perf_counter()
        try:
            out = self._run_model(torch.stack([r.image for r in batch]))
        except Exception as exc:  # the device failed: fail this batch (a router retries it), keep serving
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()  # give the failed batch's memory back before the next one
            log.error("%s: the model failed on a batch of %d: %s: %s", self.name, len(batch), type(exc).__name__,
                      exc)
            failure = DeviceFailure(f"{self.name}: the model failed on a batch of {len(batch)}: "
                                    f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            for r in batch:
                self._fail(r, failure)
            return
        end = time.perf_counter()
        self._stats.batches += 1
        self._stats.busy_s += end - start
        self._stats.batch_sizes[len(batch)] += 1
        self.histograms.batch_size.observe(len(batch))
        for k, r in enumerate(batch):
            r.timing.compute_start, r.timing.compute_end = start, end
            r.image = None
            self._resolve(r, out[k])

    def _decode_batch(self, batch: list[_Request]) -> list[_Request]:
        """Decode at batch time: on the GPU for big all-JPEG batches, else on the CPU pool."""
        from fastload.serve.gpu_decode import gpu_eval_batch

        t0 = time.perf_counter()
        jpeg = all(r.data[:3] == b"\xff\xd8\xff" for r in batch)
        if jpeg and len(batch) >= self.gpu_decode_min_batch:
            try:
                for r in batch:
                    check_request_pixels(r.data, self.max_pixels)
                images = gpu_eval_batch([r.data for r in batch], self.preprocess, self.device)
            except Exception as exc:
                self._stats.gpu_decode_fallbacks += 1
                if not self._warned_gpu_fallback:
                    self._warned_gpu_fallback = True
                    log.warning("%s: GPU decode failed for a batch of %d (%s: %s); decoding on the CPU instead "
                                "(logged once; counted in stats()['gpu_decode_fallbacks'])", self.name,
                                len(batch), type(exc).__name__, exc)
            else:
                for r, im in zip(batch, images):
                    r.image = im
                    r.timing.preprocess_start, r.timing.preprocess_end = t0, time.perf_counter()
                self._stats.gpu_decoded += len(batch)
                return batch
        futures = [self._pool.submit(self._decode_into, r) for r in batch]
        good = []
        for r, f in zip(batch, futures):
            exc = f.exception()
            if exc is None:
                good.append(r)
            else:
                self._fail(r, exc)
        return good

    def _decode_into(self, r: _Request) -> None:
        r.timing.preprocess_start = time.perf_counter()
        r.image = self._decode(r.data)
        r.timing.preprocess_end = time.perf_counter()

    @torch.inference_mode()
    def _run_model(self, images: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            if images.device.type == "cpu":
                images = images.pin_memory()
            # GPU-decoded images were written on the current stream: the side stream must wait for them
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                x = normalize(images.to(self.device, non_blocking=True), self.mean, self.std).to(self.dtype)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            out = self.model(x)
            return out.float().cpu()
        return self.model(normalize(images, self.mean, self.std).to(self.dtype)).float()

    # ---- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and latency summaries (ms) over the last ``history`` requests."""
        done = [t for t in self._done if t.ok and t.returned]

        def pct(seconds: list[float]) -> dict[str, float]:
            return {k: v * 1e3 for k, v in percentiles(seconds).items()}

        s = self._stats
        sizes = s.batch_sizes
        uptime = time.perf_counter() - s.started if s.started else 0.0
        return {
            "name": self.name, "device": str(self.device), "ready": self.ready.is_set(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_batch": self.policy.max_batch, "max_wait_ms": self.policy.max_wait_s * 1e3,
            "max_queue": self.max_queue, "max_pixels": self.max_pixels, "waiting": self._waiting,
            "in_flight": self.load,
            "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "rejected": s.rejected,
            "expired": s.expired, "batches": s.batches, "warmup_s": s.warmup_s,
            "busy_s": s.busy_s, "uptime_s": uptime, "device_busy_fraction": s.busy_s / uptime if uptime else 0.0,
            "gpu_decoded": s.gpu_decoded, "cpu_decoded": s.cpu_decoded,
            "gpu_decode_fallbacks": s.gpu_decode_fallbacks,
            "mean_batch_size": (sum(k * v for k, v in sizes.items()) / s.batches) if s.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(sizes.items())},
            "latency_ms": pct([t.returned - t.queued for t in done]),
            "queue_wait_ms": pct([t.batched - t.queued for t in done]),
            "preprocess_ms": pct([t.preprocess_end - t.preprocess_start for t in done]),
            "compute_ms": pct([t.compute_end - t.compute_start for t in done]),
        }

    def trace(self) -> dict[str, Any]:
        """Chrome trace (Perfetto) of the recent requests: queued, preprocess, waiting for a batch, compute."""
        return trace_events(list(self._done), f"fastload DynamicBatcher {self.name}")
