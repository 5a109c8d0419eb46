"""The request contract both HTTP fronts follow (``http.py``, ``asgi.py``): each answer as a status and a body.

Owns: ``FrontOptions`` (which front, and the limits both apply); ``Reply`` (status, JSON or
text body, extra headers, whether the connection closes after it); strict framing from
the request headers (``framing``: ``Content-Length`` one non-negative decimal, a missing
one on POST is 411, ``Transfer-Encoding`` refused); the routes (``Routes.get``,
``Routes.before_body``, ``Routes.check_body``); the prediction (``Routes.predict`` blocks
on the request's future, ``Routes.predict_async`` awaits ``submit_async``) with one mapping
of outcomes to statuses (200 top-k; 400 undecodable or over the pixel budget; 503 +
``Retry-After`` overloaded, device failed or not running; 504 past the request deadline;
500 otherwise); the top-k answer; the draining flag; the count of responses by status.

Must not: read or write sockets, know which server runs it, or preprocess and batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import torch

from fastload.errors import CorruptSampleError, DeadlineExceeded, DeviceFailure, Overloaded
from fastload.serve._futures import await_future
from fastload.serve.metrics import Metric, render_prometheus, serving_metrics

__all__ = ["FrontOptions", "Reply", "Routes", "framing", "route_path", "FRONTS", "ALLOWED", "MAX_BODY_BYTES",
           "MAX_HEADERS", "MAX_HEADER_LINE", "MAX_HEAD_BYTES", "METRICS_TYPE"]

FRONTS = ("stdlib", "asgi")
MAX_BODY_BYTES = 64 << 20
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_OK_TYPES = ("image/", "application/octet-stream")
_DECIMAL = re.compile(r"[0-9]{1,18}")
# a request's head: at most MAX_HEADERS fields of MAX_HEADER_LINE bytes each (http.server's own limits, from
# http.client: 431 over them), and (asgi, where httptools buffers an unfinished field) MAX_HEAD_BYTES in all
MAX_HEADERS = 100
MAX_HEADER_LINE = 65536
MAX_HEAD_BYTES = 1 << 20
GET_ROUTES = ("/healthz", "/stats", "/metrics", "/trace")
ALLOWED = {"/predict": "POST", **{p: "GET, HEAD" for p in GET_ROUTES}}  # each route's methods (the Allow header)


@dataclass(frozen=True, kw_only=True)
class FrontOptions:
    """Which HTTP front serves, and its limits (seconds, bytes, counts); ``http.py``'s docstring says what each does.

    ``server``: ``"stdlib"`` (``http.py``) or ``"asgi"`` (``asgi.py``: uvicorn + starlette,
    the ``serve`` extra). ``asgi.py``'s docstring says which limits uvicorn cannot apply.
    """

    server: str = "stdlib"
    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    request_timeout_s: float = 30.0
    max_connections: int = 256
    linger_s: float = 2.0
    k: int = 5

    def __post_init__(self) -> None:
        if self.server not in FRONTS:
            raise ValueError(f"Unknown value {self.server!r} for argument server. Valid values are "
                             f"{', '.join(FRONTS)}.")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "request_timeout_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_connections", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Reply:
    """One response: ``status``, a JSON (dict) or text body, extra headers; ``close``: close the connection after it."""

    status: int
    body: dict[str, Any] | str
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False
    ctype: str = "application/json"

    def encoded(self) -> bytes:
        return (json.dumps(self.body) if isinstance(self.body, dict) else self.body).encode()


def _busy(message: str, retry_after: int = 1, *, close: bool = False) -> Reply:
    return Reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": message}, {"Retry-After": str(retry_after)}, close)


def framing(transfer_encoding: str | None, content_lengths: list[str], *, body_allowed: bool) -> int | Reply:
    """The body length a request's headers declare, or the error ``Reply`` (closing) for bad framing."""
    if transfer_encoding is not None:
        te = transfer_encoding.strip().lower()
        if te == "chunked":
            return Reply(HTTPStatus.LENGTH_REQUIRED, {"error": "chunked request bodies are not accepted: send the "
                                                               "image with a Content-Length header"}, close=True)
        return Reply(HTTPStatus.BAD_REQUEST, {"error": f"unsupported Transfer-Encoding {te!r}; send the image with "
                                                       "a Content-Length header"}, close=True)
    if not content_lengths:
        if body_allowed:
            return Reply(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length required: POST the image bytes with "
                                                               "a Content-Length header"}, close=True)
        return 0
    if len({v.strip() for v in content_lengths}) != 1 or not _DECIMAL.fullmatch(content_lengths[0].strip()):
        shown = ", ".join(repr(v) for v in content_lengths)
        return Reply(HTTPStatus.BAD_REQUEST, {"error": f"Content-Length must be one non-negative decimal integer, "
                                                       f"got {shown}"}, close=True)
    return int(content_lengths[0])


def route_path(target: str) -> str:
    """The path a request target names: a query string (``/healthz?probe=1``) does not choose the route."""
    return target.split("?", 1)[0].split("#", 1)[0]


class Routes:
    """What each route answers for ``target`` (a ``DynamicBatcher`` or a ``Router``), whichever front asks.

    ``options`` is the front's ``FrontOptions`` (``max_body_bytes``, ``request_timeout_s``,
    ``body_timeout_s``, ``k``); ``classes`` names the model's outputs in answers.
    """

    def __init__(self, target: Any, options: Any, classes: list[str] | None = None) -> None:
        self.target, self.options, self.classes = target, options, classes
        self.draining = False
        self._lock = threading.Lock()
        self._status: collections.Counter = collections.Counter()

    # ---- counting -------------------------------------------------------------------------

    def count(self, status: int) -> None:
        with self._lock:
            self._status[int(status)] += 1

    def responses(self) -> dict[str, int]:
        with self._lock:
            return {str(k): v for k, v in sorted(self._status.items())}

    # ---- routes ---------------------------------------------------------------------------

    def get(self, path: str, http_stats: Any, method: str = "GET") -> Reply:
        """``GET path`` (or ``HEAD``); ``http_stats`` gives the front's own counters (for /stats, /metrics)."""
        t = self.target
        path = route_path(path)
        if path == "/healthz":
            ready = t.ready.is_set() and not self.draining
            return Reply(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                         {"ready": ready, "draining": self.draining, "device": str(t.device)})
        if path == "/stats":
            return Reply(HTTPStatus.OK, {**t.stats(), "http": http_stats()})
        if path == "/metrics":
            return Reply(HTTPStatus.OK, render_prometheus(self.metrics(http_stats())), ctype=METRICS_TYPE)
        if path == "/trace":
            return Reply(HTTPStatus.OK, t.trace())
        return self.other(method, path, 0)

    def metrics(self, http: dict[str, Any]) -> list[Metric]:
        return serving_metrics(self.target, http)

    def other(self, method: str, path: str, length: int) -> Reply:
        """Any other method or path: 405 + ``Allow`` on a route, else 404.

        A request with a body closes the connection (its body is never parsed).
        """
        allowed = ALLOWED.get(route_path(path))
        if allowed is not None:
            return Reply(HTTPStatus.METHOD_NOT_ALLOWED,
                         {"error": f"{method} is not allowed on {route_path(path)}; use {allowed}"},
                         {"Allow": allowed}, close=bool(length))
        return Reply(HTTPStatus.NOT_FOUND, {"error": f"no route {method} {path}; POST image bytes to /predict, "
                                                     "GET /healthz, /stats, /metrics or /trace"}, close=bool(length))

    def over_cap(self) -> Reply:
        """503 + ``Retry-After`` for a request over ``max_connections`` (the connection then closes)."""
        return _busy(f"{self.options.max_connections} connections are open (max_connections); retry later",
                     close=True)

    def before_body(self, path: str, length: int) -> Reply | None:
        """``POST path`` with a body of ``length`` bytes: the answer due before reading the body, if any."""
        if route_path(path) != "/predict":
            return self.other("POST", path, length)
        if length > self.options.max_body_bytes:
            return Reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": self.too_large(length)}, close=True)
        if self.draining:
            return _busy("the server is shutting down; retry on another instance", close=True)
        return None

    def too_large(self, length: int) -> str:
        return (f"body of {length} bytes is over the {self.options.max_body_bytes} byte limit; "
                "send a smaller (downscaled) image")

    def body_timeout(self) -> Reply:
        return Reply(HTTPStatus.REQUEST_TIMEOUT,
                     {"error": f"the body did not arrive within {self.options.body_timeout_s:g}s"}, close=True)

    @staticmethod
    def check_body(content_type: str | None, body: bytes) -> Reply | None:
        """400 for a wrong content type or an empty body; None when the body may be predicted on."""
        ctype = (content_type or "").split(";")[0].strip().lower()
        if not ctype.startswith(_OK_TYPES):
            return Reply(HTTPStatus.BAD_REQUEST, {"error": f"wrong content type {ctype or '(none)'!r}: send the "
                                                           "image bytes as image/jpeg, image/png or "
                                                           "application/octet-stream"})
        if not body:
            return Reply(HTTPStatus.BAD_REQUEST, {"error": "empty body: POST the encoded image bytes"})
        return None

    # ---- prediction -----------------------------------------------------------------------

    def predict(self, body: bytes) -> Reply:
        """Submit ``body`` and block this thread until the answer or the request deadline."""
        timeout = self.options.request_timeout_s
        try:
            future = self.target.submit(body, timeout=timeout)
        except Exception as exc:
            return self.failure(exc, submitting=True)
        try:
            out = future.result(timeout=timeout)
        except Exception as exc:
            if isinstance(exc, concurrent.futures.TimeoutError) and not isinstance(exc, DeadlineExceeded):
                future.cancel()  # leaves the queue now; its slot is free for others
                exc = DeadlineExceeded(f"no answer within the {timeout:g}s request deadline; the request was dropped")
            return self.failure(exc)
        return Reply(HTTPStatus.OK, {"top_k": self.top_k(out)})

    async def predict_async(self, body: bytes) -> Reply:
        """Submit ``body`` and await the answer (``submit_async``) up to the request deadline."""
        timeout = self.options.request_timeout_s
        try:  # submit_async's two halves, so that a refusal to take the request is told from a failure
            future = self.target.submit(body, timeout=timeout)
        except Exception as exc:
            return self.failure(exc, submitting=True)
        try:
            out = await await_future(future, timeout)
        except Exception as exc:
            return self.failure(exc)
        return Reply(HTTPStatus.OK, {"top_k": self.top_k(out)})

    @staticmethod
    def failure(exc: BaseException, *, submitting: bool = False) -> Reply:
        """The answer for a request that got no output (``submitting``: ``submit`` itself refused it)."""
        if isinstance(exc, (Overloaded, DeviceFailure)):
            return _busy(str(exc))
        if isinstance(exc, DeadlineExceeded):
            return Reply(HTTPStatus.GATEWAY_TIMEOUT, {"error": str(exc)})
        if isinstance(exc, CorruptSampleError):
            return Reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        if submitting and isinstance(exc, RuntimeError):  # not started, or stopping: come back later
            return _busy(str(exc), 5)
        return Reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"})

    def top_k(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        probs = torch.softmax(logits.float().flatten(), 0)
        k = min(self.options.k, probs.numel())
        values, idx = probs.topk(k)
        return [{"index": int(i), "class": self.classes[int(i)] if self.classes else str(int(i)),
                 "score": float(v)} for v, i in zip(values, idx)]
