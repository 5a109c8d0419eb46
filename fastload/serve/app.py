"""``run_server(ServeOptions(...))``: what ``fastload serve`` does, as one library call.

Owns: building the model and one ``DynamicBatcher`` per device (``devices``) or several on
the CPU (``replicas``), a CPU fallback replica beside CUDA ones, the ``Router`` and the
HTTP front (``front.server``: the standard library's, ``http.py``, or uvicorn's,
``asgi.py``); the lifecycle: listen first (``/healthz`` answers 503 during warm-up), warm
every replica up, serve, and on SIGTERM or SIGINT drain reliably.

Draining: the signal handler only sets an event (it never raises into whatever the main
thread is doing, which is how a ``KeyboardInterrupt`` raised inside a lock wait left the
server ignoring SIGTERM). The main thread then: stops taking new requests (503 +
``Retry-After`` + ``Connection: close`` to new requests and new connections; an idle
keep-alive connection gets 503 for a request within ``linger_s``, then a lingering close),
waits up to ``drain_timeout_s`` for the accepted requests to be answered, stops the
batchers, and only then stops the accept loop, answers 503 to the connections still in the
listen backlog and closes the listener at once (a connection left in a closing listener's
backlog is reset by the kernel). It joins every thread and returns. A second signal skips
the wait.

Must not: parse command lines or print (``cli.py`` passes ``say`` for messages).
"""

from __future__ import annotations

import copy
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.errors import ServeError
from fastload.image import DEFAULT_RESIZE, DEFAULT_SIZE
from fastload.serve.policy import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_MS
from fastload.serve.preprocess import SERVE_MAX_PIXELS, DTYPES
from fastload.serve.routes import FrontOptions

__all__ = ["ServeOptions", "run_server", "build_router"]

log = logging.getLogger("fastload.serve")


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """Everything ``fastload serve`` takes. See ``fastload serve --help`` for each option."""

    model: str
    num_classes: int = 1000
    weights: Path | None = None
    batch_ms: str | None = None  # the simulated device's "A+B*n"
    classes: tuple[str, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = DEFAULT_MAX_BATCH
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    max_queue: int = DEFAULT_MAX_QUEUE
    devices: tuple[str, ...] = ("auto",)
    replicas: int = 1
    cpu_fallback: bool = True
    workers: int | None = None
    size: int = DEFAULT_SIZE
    resize: int = DEFAULT_RESIZE
    gpu_decode_min_batch: int | None = None
    dtype: str = "fp32"
    max_pixels: int = SERVE_MAX_PIXELS
    probe_interval_s: float = 5.0
    drain_timeout_s: float = 25.0
    front: FrontOptions = field(default_factory=FrontOptions)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ServeError(f"Unknown value {self.dtype!r} for --dtype. Valid values are {', '.join(DTYPES)}.")
        if not self.devices:
            raise ServeError("--devices needs at least one device, e.g. 'cuda:0,cuda:1' or 'cpu'")
        if self.replicas < 1:
            raise ServeError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replicas > 1 and (len(self.devices) > 1 or self.devices[0] not in ("cpu", "auto")):
            raise ServeError("--replicas N runs N replicas on the CPU; for CUDA give one device per replica with "
                             "--devices cuda:0,cuda:1")
        if not 1 <= self.size <= self.resize:
            raise ServeError(f"need 1 <= --size <= --resize, got size={self.size}, resize={self.resize}")
        for name in ("max_batch", "max_queue", "max_pixels", "num_classes"):
            if getattr(self, name) < 1:
                raise ServeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_wait_ms < 0 or self.drain_timeout_s < 0 or self.probe_interval_s <= 0:
            raise ServeError("max_wait_ms and drain_timeout_s must be >= 0 and probe_interval_s > 0")


def _devices(options: ServeOptions) -> list[str]:
    from fastload.system import resolve_device

    try:
        resolved = [str(resolve_device(d, what="--devices")) for d in options.devices]
    except (ValueError, RuntimeError) as exc:
        raise ServeError(str(exc)) from exc
    if len(set(resolved)) != len(resolved):
        raise ServeError(f"--devices names a device twice: {', '.join(options.devices)}")
    if resolved == ["cpu"] and options.replicas > 1:
        return [f"cpu:{i}" for i in range(options.replicas)]
    return resolved


def build_router(options: ServeOptions):
    """The model, one batcher per device (plus a CPU fallback beside CUDA ones) and their ``Router``."""
    from fastload.load.transforms import EvalTransform
    from fastload.serve.batcher import DynamicBatcher
    from fastload.serve.models import build_model
    from fastload.serve.replicas import Router
    from fastload.system import available_cpus

    model = build_model(options.model, num_classes=options.num_classes, weights=options.weights,
                        batch_ms=options.batch_ms)
    names = _devices(options)
    workers = options.workers or available_cpus()
    per = max(1, workers // len(names))

    def batcher(name: str, m, device: str, dtype: str) -> DynamicBatcher:
        return DynamicBatcher(m, preprocess=EvalTransform(options.size, options.resize),
                              max_batch=options.max_batch, max_wait_ms=options.max_wait_ms,
                              max_queue=options.max_queue, device=device, workers=per,
                              gpu_decode_min_batch=options.gpu_decode_min_batch, dtype=dtype,
                              max_pixels=options.max_pixels, name=name)

    try:
        replicas = [batcher(n, model if i == 0 else copy.deepcopy(model),
                            "cpu" if n.startswith("cpu") else n, options.dtype) for i, n in enumerate(names)]
        fallback = None
        if options.cpu_fallback and any(n.startswith("cuda") for n in names):
            fallback = batcher("cpu-fallback", copy.deepcopy(model).cpu(), "cpu", "fp32")
    except (ValueError, RuntimeError) as exc:  # an unusable device, a bad option
        raise ServeError(f"cannot serve on {', '.join(names)}: {exc}") from exc
    return Router(replicas, fallback=fallback, probe_interval_s=options.probe_interval_s)


def run_server(options: ServeOptions, *, say: Callable[[str], None] = log.info,
               stop: threading.Event | None = None) -> dict[str, Any]:
    """Serve until SIGTERM / SIGINT (or ``stop`` is set), then drain; returns the final ``/stats``.

    Signal handlers are installed only when called from the main thread.

    Raises:
        ServeError: the options cannot be served (unknown model, bad weights or devices).
    """
    if options.front.server == "asgi":
        from fastload.serve.asgi import make_server, require, serve_forever

        require()  # a missing extra fails before the model is built
    else:
        from fastload.serve.http import make_server, serve_forever
    router = build_router(options)
    stop = stop or threading.Event()
    signals = {"count": 0}

    def on_signal(signum, frame) -> None:  # only set flags: never raise into the interrupted code
        signals["count"] += 1
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        server = make_server(router, options.host, options.port, classes=list(options.classes or []) or None,
                             options=options.front)
    except OSError as exc:
        raise ServeError(f"cannot listen on {options.host}:{options.port}: {exc}\n"
                         "HINT: another process holds the port; pick another with --port") from exc
    thread = serve_forever(server)
    host, port = server.server_address[:2]
    say(f"listening on http://{host}:{port} ({options.front.server} front; warming up...)")
    try:
        warm = threading.Thread(target=router.start, name="fastload-warmup", daemon=True)
        warm.start()
        announced = False
        while not stop.wait(0.2):
            if not announced and not warm.is_alive():
                announced = True
                ready = [b.name for b in router.healthy()]
                say(f"ready on {', '.join(ready) or 'no device (every warm-up failed; re-probing)'}: POST image "
                    "bytes to /predict; SIGTERM or Ctrl-C drains and stops")
        say("stopping: finishing accepted requests, answering new ones 503")
        server.begin_drain()
        if signals["count"] < 2 and not server.wait_idle(options.drain_timeout_s):
            say(f"drain timeout ({options.drain_timeout_s:g}s) passed with requests still in flight")
        warm.join(options.drain_timeout_s)
        router.stop(drain=signals["count"] < 2, timeout=options.drain_timeout_s)
        # the listener keeps answering new connections 503 until here, then closes right after its backlog
        server.shutdown()
        thread.join()
        refused = server.refuse_backlog()
        if refused:
            log.info("answered 503 to %d connections still in the listen backlog", refused)
        final = {**router.stats(), "http": server.http_stats()}
        server.close_all(options.front.linger_s + 1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say(f"stopped: {final['completed']} requests answered, {final['failed']} failed")
    return final
