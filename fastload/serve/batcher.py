"""``DynamicBatcher``: time-window batching for inference with the training preprocessing.

Owns: accepting requests (encoded image bytes), preprocessing them in parallel with the
same ``load/decode.py`` + eval preset the training path uses, grouping them into batches
(a batch leaves as soon as it holds ``max_batch`` requests or its oldest request has
waited ``max_wait_ms``), running the model, routing each output row back to its future,
refusing work when ``max_queue`` requests are waiting (``Overloaded``), warm-up,
CPU/CUDA placement, and per-request timings (``stats()``, ``trace()``).

Why a short window: one request at a time leaves the device idle between tiny batches;
a long fixed wait (50 ms is common) adds that much latency to every request at low load.
A window of a few milliseconds with a cap on the batch gets most of the batching gain at
high load and costs at most the window at low load.

Must not: know about HTTP (``http.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fastload.errors import CorruptSampleError, Overloaded
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD, EvalTransform, normalize

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming"]

log = logging.getLogger("fastload.serve")


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


@dataclass
class _Request:
    id: int
    data: bytes
    future: concurrent.futures.Future
    timing: RequestTiming
    image: torch.Tensor | None = None


@dataclass
class _Stats:
    submitted: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    batches: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)
    warmup_s: float = 0.0


class DynamicBatcher:
    """Batch requests in a short time window and run ``model`` on them.

    Args:
        model: an ``nn.Module`` (or callable) taking a float NCHW batch, returning a
            tensor whose first dimension is the batch.
        preprocess: bytes → uint8 CHW tensor; default ``EvalTransform(224, 256)`` — the
            evaluation preset training uses, so serving sees exactly the training tensors.
        max_batch: largest batch sent to the model.
        max_wait_ms: how long the oldest ready request may wait for others.
        max_queue: requests waiting (submitted, not yet sent to the model) before
            ``submit`` raises ``Overloaded``.
        device: ``"auto"`` (CUDA when available and usable, else CPU), ``"cpu"``, ``"cuda"``.
        workers: preprocessing threads (decoders release the GIL).
        gpu_decode_min_batch: on CUDA, decode whole batches of at least this many JPEGs on
            the GPU (``torchvision.io.decode_jpeg(device="cuda")``); smaller batches and
            other formats decode on the CPU. None: always CPU.
        mean, std: normalisation (0..1 scale), applied on the device.
        history: how many finished requests ``stats()`` and ``trace()`` look back over.
    """

    def __init__(self, model: Callable[[torch.Tensor], torch.Tensor], *,
                 preprocess: Callable[[bytes], torch.Tensor] | None = None, max_batch: int = 32,
                 max_wait_ms: float = 8.0, max_queue: int = 256, device: str = "auto", workers: int = 2,
                 gpu_decode_min_batch: int | None = None, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, history: int = 10_000) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"Unknown value {device!r} for argument device. Valid values are 'auto', 'cpu', 'cuda'.")
        self.model = model
        self.preprocess = preprocess or EvalTransform(224, 256)
        self.policy = BatchPolicy(max_batch, max_wait_ms / 1e3)
        self.max_queue = max_queue
        self.device = self._pick_device(device)
        self.gpu_decode_min_batch = gpu_decode_min_batch if self.device.type == "cuda" else None
        self.mean, self.std = tuple(mean), tuple(std)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix="fastload-pre")
        self._cond = threading.Condition()
        self._ready: collections.deque[_Request] = collections.deque()
        self._inflight: dict[int, _Request] = {}  # submitted, future not yet resolved
        self._waiting = 0  # submitted and not yet sent to the model
        self._ids = 0
        self._stats = _Stats()
        self._done: collections.deque[RequestTiming] = collections.deque(maxlen=history)
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._stopping = False
        self.ready = threading.Event()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- lifecycle ------------------------------------------------------------------------

    @staticmethod
    def _pick_device(name: str) -> torch.device:
        if name == "cpu":
            return torch.device("cpu")
        usable = False
        if torch.cuda.is_available():
            try:
                torch.zeros(1, device="cuda").add_(1)
                usable = True
            except Exception as exc:  # visible but unusable (driver mismatch, busy, out of memory)
                log.warning("CUDA is visible but unusable (%s); serving on the CPU", exc)
        if name == "cuda" and not usable:
            raise RuntimeError("device='cuda' but no usable CUDA device; use device='auto' or 'cpu'.")
        dev = torch.device("cuda" if usable else "cpu")
        log.info("DynamicBatcher serving on %s", dev)
        return dev

    def _dummy_batch(self) -> torch.Tensor:
        size = getattr(self.preprocess, "size", 224)
        return torch.zeros(self.policy.max_batch, 3, size, size, dtype=torch.uint8)

    def start(self) -> DynamicBatcher:
        """Warm up with one full dummy batch (CUDA context, cudnn autotune), then accept work."""
        if self._thread is not None:
            return self
        if isinstance(self.model, torch.nn.Module):
            self.model = self.model.to(self.device).eval()
        t0 = time.perf_counter()
        self._run_model(self._dummy_batch())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._stats.warmup_s = time.perf_counter() - t0
        self._accepting, self._stopping = True, False
        self._thread = threading.Thread(target=self._loop, name="fastload-batcher", daemon=True)
        self._thread.start()
        self.ready.set()
        log.info("DynamicBatcher ready after %.2fs warm-up", self._stats.warmup_s)
        return self

    def stop(self, *, drain: bool = True, timeout: float | None = 30.0) -> None:
        """Stop accepting work; finish what was accepted (``drain``) or cancel it."""
        with self._cond:
            self._accepting = False
            self.ready.clear()
            if not drain:
                self._ready.clear()
                self._waiting = 0
                for req in list(self._inflight.values()):
                    req.future.cancel()
                self._inflight.clear()
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cond:
                while self._waiting and (deadline is None or time.monotonic() < deadline):
                    self._cond.wait(0.05)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._pool.shutdown(wait=drain, cancel_futures=not drain)

    def __enter__(self) -> DynamicBatcher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- submitting -----------------------------------------------------------------------

    def submit(self, data: bytes) -> concurrent.futures.Future:
        """Queue one encoded image; the future resolves to the model's output row (CPU tensor).

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
        req = _Request(rid, bytes(data), concurrent.futures.Future(), RequestTiming(rid, time.perf_counter()))
        with self._cond:
            self._inflight[rid] = req
        if self.gpu_decode_min_batch is not None:
            self._enqueue(req)  # decoded at batch time, on the GPU when the batch is big enough
        else:
            self._pool.submit(self._preprocess, req)
        return req.future

    async def submit_async(self, data: bytes) -> torch.Tensor:
        """``await`` the model output for one encoded image (asyncio wrapper of ``submit``)."""
        import asyncio

        return await asyncio.wrap_future(self.submit(data))

    def _preprocess(self, req: _Request) -> None:
        req.timing.preprocess_start = time.perf_counter()
        try:
            req.image = self._decode(req.data)
        except Exception as exc:
            req.timing.preprocess_end = time.perf_counter()
            self._fail(req, exc)
            with self._cond:
                self._waiting -= 1
                self._cond.notify_all()
            return
        req.timing.preprocess_end = time.perf_counter()
        self._enqueue(req)

    def _decode(self, data: bytes) -> torch.Tensor:
        from_bytes = getattr(self.preprocess, "from_bytes", None)
        try:
            return from_bytes(data) if from_bytes is not None else self.preprocess(data)
        except Exception as exc:
            from fastload.image.policy import BadImage

            reason = str(exc) if isinstance(exc, BadImage) else f"{type(exc).__name__}: {exc}"
            raise CorruptSampleError(f"cannot decode the request body as an image: {reason}") from exc

    def _enqueue(self, req: _Request) -> None:
        with self._cond:
            self._ready.append(req)
            self._cond.notify_all()

    def _resolve(self, req: _Request, result: Any = None, exc: BaseException | None = None) -> None:
        req.timing.returned = time.perf_counter()
        req.timing.ok = exc is None
        with self._cond:
            self._inflight.pop(req.id, None)
            if exc is None:
                self._stats.completed += 1
            else:
                self._stats.failed += 1
        self._done.append(req.timing)
        if req.future.done():  # cancelled by stop(drain=False)
            return
        if exc is None:
            req.future.set_result(result)
        else:
            req.future.set_exception(exc)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self._resolve(req, exc=exc)

    # ---- batching and compute ------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopping and not self._ready:
                        return
                    n, wait = self.policy.decide(time.perf_counter(), [r.timing.queued for r in self._ready])
                    if n:
                        batch = [self._ready.popleft() for _ in range(n)]
                        self._waiting -= n
                        break
                    self._cond.wait(None if wait == float("inf") else wait)
            self._run_batch(batch)
            with self._cond:
                self._cond.notify_all()

    def _run_batch(self, batch: list[_Request]) -> None:
        now = time.perf_counter()
        for r in batch:
            r.timing.batched = now
            r.timing.batch_size = len(batch)
        try:
            if self.gpu_decode_min_batch is not None:
                batch = self._decode_batch(batch)
                if not batch:
                    return
            images = torch.stack([r.image for r in batch])
            start = time.perf_counter()
            out = self._run_model(images)
            end = time.perf_counter()
        except Exception as exc:  # the model failed: fail this batch, keep serving
            log.exception("model failed on a batch of %d", len(batch))
            for r in batch:
                self._fail(r, exc)
            return
        self._stats.batches += 1
        self._stats.batch_sizes[len(batch)] += 1
        for k, r in enumerate(batch):
            r.timing.compute_start, r.timing.compute_end = start, end
            self._resolve(r, out[k])

    def _decode_batch(self, batch: list[_Request]) -> list[_Request]:
        """Decode at batch time: on the GPU for big all-JPEG batches, else on the CPU pool."""
        from fastload.serve.gpu_decode import gpu_eval_batch

        t0 = time.perf_counter()
        jpeg = all(r.data[:3] == b"\xff\xd8\xff" for r in batch)
        if jpeg and len(batch) >= self.gpu_decode_min_batch:
            try:
                images = gpu_eval_batch([r.data for r in batch], self.preprocess, self.device)
                for r, im in zip(batch, images):
                    r.image = im
                    r.timing.preprocess_start, r.timing.preprocess_end = t0, time.perf_counter()
                return batch
            except Exception:
                log.debug("GPU decode failed for a batch; decoding it on the CPU to find the bad image")
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
            with torch.cuda.stream(self._stream):
                x = normalize(images.to(self.device, non_blocking=True), self.mean, self.std)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            out = self.model(x)
            return out.float().cpu()
        return self.model(normalize(images, self.mean, self.std)).float()

    # ---- reporting ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters and latency histograms (ms) over the last ``history`` requests."""
        from fastload.measure.timing import percentiles

        done = [t for t in self._done if t.ok and t.returned]

        def pct(seconds: list[float]) -> dict[str, float]:
            return {k: v * 1e3 for k, v in percentiles(seconds).items()}

        s = self._stats
        sizes = s.batch_sizes
        return {
            "device": str(self.device), "ready": self.ready.is_set(),
            "max_batch": self.policy.max_batch, "max_wait_ms": self.policy.max_wait_s * 1e3,
            "max_queue": self.max_queue, "waiting": self._waiting,
            "submitted": s.submitted, "completed": s.completed, "failed": s.failed, "rejected": s.rejected,
            "batches": s.batches, "warmup_s": s.warmup_s,
            "mean_batch_size": (sum(k * v for k, v in sizes.items()) / s.batches) if s.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(sizes.items())},
            "latency_ms": pct([t.returned - t.queued for t in done]),
            "queue_wait_ms": pct([t.batched - t.queued for t in done]),
            "preprocess_ms": pct([t.preprocess_end - t.preprocess_start for t in done]),
            "compute_ms": pct([t.compute_end - t.compute_start for t in done]),
        }

    def trace(self) -> dict[str, Any]:
        """Chrome trace (Perfetto) of the recent requests: queued, preprocess, waiting for a batch, compute."""
        done = list(self._done)
        if not done:
            return {"traceEvents": []}
        origin = min(t.queued for t in done)
        events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1,
                                         "args": {"name": "fastload DynamicBatcher"}}]
        seen_batches = set()
        for t in done:
            spans = [("queued", t.queued, t.preprocess_start or t.batched),
                     ("preprocess", t.preprocess_start, t.preprocess_end),
                     ("wait for batch", t.preprocess_end or t.queued, t.batched),
                     ("compute", t.compute_start, t.compute_end)]
            for name, a, b in spans:
                if a and b and b >= a:
                    events.append({"name": name, "ph": "X", "pid": 1, "tid": 1000 + t.id % 100_000,
                                   "ts": (a - origin) * 1e6, "dur": (b - a) * 1e6,
                                   "args": {"request": t.id, "batch_size": t.batch_size, "ok": t.ok}})
            if t.compute_start and t.compute_start not in seen_batches:
                seen_batches.add(t.compute_start)
                events.append({"name": f"batch of {t.batch_size}", "ph": "X", "pid": 1, "tid": 1,
                               "ts": (t.compute_start - origin) * 1e6,
                               "dur": (t.compute_end - t.compute_start) * 1e6})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
