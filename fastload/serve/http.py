"""The HTTP front for a ``DynamicBatcher`` or a ``Router`` of replicas, safe to put on a network.

Owns: ``POST /predict`` (image bytes in, JSON top-k out), ``GET /healthz`` (200 only while a
replica is warmed up and healthy), ``GET /stats`` (JSON), ``GET /metrics`` (Prometheus text),
``GET /trace`` (Chrome trace), the error mapping, and the defences a front needs:

- read deadlines: the request line and headers must arrive within ``header_timeout_s`` and
  the body within ``body_timeout_s`` of their start, however slowly the client dribbles
  (a per-``recv`` timeout alone lets a byte a second hold a connection forever);
- keep-alive connections idle for ``idle_timeout_s`` are closed;
- at most ``max_connections`` connections, one thread each; the next ones are answered
  503 + ``Retry-After`` at once by the accept loop (never an unbounded thread per
  connection); the in-flight cap is the batchers' ``max_queue`` (503 + ``Retry-After``);
- a request deadline (``request_timeout_s``): 504, and the request leaves the queue;
- strict framing: ``Content-Length`` must be one non-negative decimal number (else 400),
  a missing one on POST is 411, ``Transfer-Encoding`` (chunked or not) is refused with 411 /
  400 and the connection closed, so a body can never be read as the next request;
- the body limit: 413 answered from the headers, before the body is read;
- after a response that closes a connection with unread input (413, framing errors,
  overload), a bounded "lingering close" (RFC 9112 §9.6): shut our side, discard what the
  client still sends for ``linger_s``, then close — so the client reads our answer instead
  of a connection reset;
- draining on shutdown: new requests get 503 + ``Connection: close``; accepted ones finish.

Why the standard library (``ThreadingHTTPServer``) and not uvicorn + starlette: no
dependency, and a thread blocked on its request's future is the natural shape for a
batcher (the batching happens behind the futures). The thread count is bounded by
``max_connections``. uvicorn has no deadline for receiving a request (its keep-alive
timeout restarts with every byte: https://github.com/xorbitsai/inference/pull/5213
wraps its protocol to add one). An ASGI server was not measured against this one (see
the README); ``DynamicBatcher.submit_async`` is there for one.

Must not: do its own preprocessing or batching.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import logging
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any

import torch

from fastload.errors import CorruptSampleError, DeadlineExceeded, DeviceFailure, Overloaded
from fastload.serve._conn import DeadlineReader, Lingerer, raw_response
from fastload.serve.metrics import Metric, render_prometheus, serving_metrics

__all__ = ["FrontOptions", "make_server", "serve_forever", "MAX_BODY_BYTES"]

log = logging.getLogger("fastload.serve")

MAX_BODY_BYTES = 64 << 20
_OK_TYPES = ("image/", "application/octet-stream")
_DECIMAL = re.compile(r"[0-9]{1,18}")


@dataclass(frozen=True, kw_only=True)
class FrontOptions:
    """The HTTP front's limits (seconds, bytes, counts). See the module docstring for each."""

    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 15.0
    request_timeout_s: float = 30.0
    max_connections: int = 256
    linger_s: float = 2.0
    k: int = 5

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s", "request_timeout_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_connections", "k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route through logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    # ---- connection: deadlines, keep-alive, lingering close --------------------------------

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a deadline-bound reader (the socket stays open)
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader, 1 << 16)
        self.linger = False

    def handle(self) -> None:
        opts = self.server.options
        self.close_connection = True
        first = True
        while True:
            if not first:  # keep-alive: wait for the next request's first byte, at most the idle timeout
                self.reader.deadline = time.monotonic() + opts.idle_timeout_s
                self.server.set_idle(self, True)
                try:
                    if not self.rfile.peek(1):
                        return
                except (TimeoutError, OSError):
                    return
                finally:
                    self.server.set_idle(self, False)
            first = False
            self.reader.deadline = time.monotonic() + opts.header_timeout_s
            with self.server.counting():
                self.handle_one_request()
            if self.close_connection or self.linger:
                return

    def finish(self) -> None:
        if self.linger:
            try:
                self.wfile.flush()
            except OSError:
                pass
            self.server.hand_off(self.connection)
        super().finish()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self.close_connection = True  # an error from the base parser: the framing cannot be trusted
        self.linger = True
        self.server.count_status(code)
        super().send_error(code, message, explain)

    def handle_expect_100(self) -> bool:  # answer 413 before the client sends the body
        length = self.headers.get("Content-Length", "")
        if _DECIMAL.fullmatch(length.strip()) and int(length) > self.server.options.max_body_bytes:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": self._too_large(int(length))}, close=True)
            return False
        return super().handle_expect_100()

    # ---- responses -------------------------------------------------------------------------

    def _send(self, status: int, body: dict[str, Any] | str, headers: dict[str, str] | None = None, *,
              close: bool = False, ctype: str = "application/json") -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close or self.server.draining:
            self.send_header("Connection", "close")
            self.linger = self.linger or close
        self.end_headers()
        self.wfile.write(data)
        self.server.count_status(status)

    def _too_large(self, length: int) -> str:
        return (f"body of {length} bytes is over the {self.server.options.max_body_bytes} byte limit; "
                "send a smaller (downscaled) image")

    def _framing(self, *, body_allowed: bool) -> int | None:
        """The body length from strict framing; None after answering an error (connection closing)."""
        if self.headers.get("Transfer-Encoding") is not None:
            te = self.headers.get("Transfer-Encoding", "").strip().lower()
            if te == "chunked":
                self._send(HTTPStatus.LENGTH_REQUIRED, {"error": "chunked request bodies are not accepted: send "
                                                                 "the image with a Content-Length header"}, close=True)
            else:
                self._send(HTTPStatus.BAD_REQUEST, {"error": f"unsupported Transfer-Encoding {te!r}; send the "
                                                             "image with a Content-Length header"}, close=True)
            return None
        values = self.headers.get_all("Content-Length") or []
        if not values:
            if body_allowed:
                self._send(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length required: POST the image bytes "
                                                                 "with a Content-Length header"}, close=True)
                return None
            return 0
        if len(set(v.strip() for v in values)) != 1 or not _DECIMAL.fullmatch(values[0].strip()):
            shown = ", ".join(repr(v) for v in values)
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"Content-Length must be one non-negative decimal integer, "
                                                         f"got {shown}"}, close=True)
            return None
        length = int(values[0])
        if length and not body_allowed:
            self.close_connection = True  # answer, then close: the unread body is never parsed as a request
            self.linger = True
        return length

    # ---- routes ----------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self._framing(body_allowed=False) is None:
            return
        t = self.server.target
        if self.path == "/healthz":
            ready = t.ready.is_set() and not self.server.draining
            self._send(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                       {"ready": ready, "draining": self.server.draining, "device": str(t.device)})
        elif self.path == "/stats":
            self._send(HTTPStatus.OK, {**t.stats(), "http": self.server.http_stats()})
        elif self.path == "/metrics":
            self._send(HTTPStatus.OK, render_prometheus(self.server.metrics()),
                       ctype="text/plain; version=0.0.4; charset=utf-8")
        elif self.path == "/trace":
            self._send(HTTPStatus.OK, t.trace())
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}; try POST /predict, GET /healthz, "
                                                       "/stats, /metrics or /trace"})

    def do_POST(self) -> None:
        opts = self.server.options
        length = self._framing(body_allowed=True)
        if length is None:
            return
        if self.path != "/predict":
            self.close_connection = bool(length)
            self.linger = bool(length)
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}; POST image bytes to /predict"})
            return
        if length > opts.max_body_bytes:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": self._too_large(length)}, close=True)
            return
        if self.server.draining:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "the server is shutting down; retry on another "
                                                                 "instance"}, {"Retry-After": "1"}, close=True)
            return
        self.reader.deadline = time.monotonic() + opts.body_timeout_s
        try:
            body = self.rfile.read(length) if length else b""
        except TimeoutError:
            self._send(HTTPStatus.REQUEST_TIMEOUT,
                       {"error": f"the body did not arrive within {opts.body_timeout_s:g}s"}, close=True)
            return
        if len(body) < length:  # the client closed mid-body
            self.close_connection = True
            return
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if not ctype.startswith(_OK_TYPES):
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"wrong content type {ctype or '(none)'!r}: send the image "
                                                         "bytes as image/jpeg, image/png or application/octet-stream"})
            return
        if not body:
            self._send(HTTPStatus.BAD_REQUEST, {"error": "empty body: POST the encoded image bytes"})
            return
        self._predict(body)

    def _predict(self, body: bytes) -> None:
        timeout = self.server.options.request_timeout_s
        try:
            future = self.server.target.submit(body, timeout=timeout)
        except (Overloaded, DeviceFailure) as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, {"Retry-After": "1"})
            return
        except RuntimeError as exc:  # not started, or stopping
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, {"Retry-After": "5"})
            return
        try:
            out = future.result(timeout=timeout)
        except TimeoutError:
            future.cancel()  # leaves the queue now; its slot is free for others
            self._send(HTTPStatus.GATEWAY_TIMEOUT, {"error": f"no answer within the {timeout:g}s request deadline; "
                                                             "the request was dropped"})
            return
        except DeadlineExceeded as exc:
            self._send(HTTPStatus.GATEWAY_TIMEOUT, {"error": str(exc)})
            return
        except CorruptSampleError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        except DeviceFailure as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, {"Retry-After": "1"})
            return
        except Exception as exc:
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(HTTPStatus.OK, {"top_k": self.server.top_k(out)})


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # listen backlog: the default 5 refuses connections under a burst

    def __init__(self, address, target, options: FrontOptions, classes: list[str] | None = None) -> None:
        super().__init__(address, _Handler)
        self.target, self.options, self.classes = target, options, classes
        self.lingerer = Lingerer()
        self.draining = False
        self._lock = threading.Condition()
        self._open = 0
        self._idle: set[_Handler] = set()
        self._handed_off: set[socket.socket] = set()
        self._active = 0
        self._status: collections.Counter = collections.Counter()
        self._refused = 0

    # ---- connections ------------------------------------------------------------------------

    def process_request(self, request, client_address) -> None:
        with self._lock:
            refuse = self.draining or self._open >= self.options.max_connections
            if not refuse:
                self._open += 1
        if refuse:
            self.refuse(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1
                self._lock.notify_all()

    def refuse(self, sock: socket.socket) -> None:
        """503 + Retry-After on a connection over the cap (or while draining), then a lingering close."""
        why = ("the server is shutting down" if self.draining
               else f"{self.options.max_connections} connections are open (max_connections)")
        try:
            sock.settimeout(0.5)
            sock.sendall(raw_response(503, {"error": f"{why}; retry later"}, {"Retry-After": "1"}))
        except OSError:
            sock.close()
            return
        with self._lock:
            self._refused += 1
            self._status[503] += 1
        self.lingerer.add(sock, self.options.linger_s)

    def hand_off(self, sock: socket.socket) -> None:
        """The handler is done with ``sock``: finish it with a lingering close instead of closing it now."""
        with self._lock:
            self._handed_off.add(sock)

    def shutdown_request(self, request) -> None:
        with self._lock:
            handed = request in self._handed_off
            self._handed_off.discard(request)
        if handed:
            self.lingerer.add(request, self.options.linger_s)
        else:
            super().shutdown_request(request)

    def set_idle(self, handler: _Handler, idle: bool) -> None:
        with self._lock:
            (self._idle.add if idle else self._idle.discard)(handler)
            if idle and self.draining:
                self._close_idle(handler)

    @staticmethod
    def _close_idle(handler: _Handler) -> None:
        try:  # wakes its blocked read with EOF: an idle keep-alive connection just closes
            handler.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def counting(self):
        server = self

        class _Count:
            def __enter__(self):
                with server._lock:
                    server._active += 1

            def __exit__(self, *exc):
                with server._lock:
                    server._active -= 1
                    server._lock.notify_all()

        return _Count()

    def count_status(self, status: int) -> None:
        with self._lock:
            self._status[int(status)] += 1

    # ---- draining ---------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """New requests get 503 + Connection: close; idle keep-alive connections close."""
        with self._lock:
            self.draining = True
            for h in list(self._idle):
                self._close_idle(h)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is being handled; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._active and time.monotonic() < deadline:
                self._lock.wait(0.05)
            return not self._active

    def refuse_backlog(self) -> int:
        """Accept what is still in the listen backlog and answer each 503 (instead of a reset at close)."""
        n = 0
        self.socket.setblocking(False)
        while True:
            try:
                sock, _ = self.socket.accept()
            except (BlockingIOError, OSError):
                return n
            sock.setblocking(True)
            self.refuse(sock)
            n += 1

    def close_all(self, timeout: float) -> None:
        self.server_close()
        self.lingerer.close(timeout)

    # ---- reporting --------------------------------------------------------------------------

    def http_stats(self) -> dict[str, Any]:
        with self._lock:
            return {"connections": self._open, "active_requests": self._active, "refused_connections": self._refused,
                    "responses": {str(k): v for k, v in sorted(self._status.items())}, "draining": self.draining}

    def metrics(self) -> list[Metric]:
        return serving_metrics(self.target, self.http_stats())

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away mid-response: nothing to answer, nothing to fix
            log.debug("connection from %s ended: %s", client_address, exc)
            return
        log.exception("unexpected error while handling a request from %s", client_address)

    def top_k(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        probs = torch.softmax(logits.float().flatten(), 0)
        k = min(self.options.k, probs.numel())
        values, idx = probs.topk(k)
        return [{"index": int(i), "class": self.classes[int(i)] if self.classes else str(int(i)),
                 "score": float(v)} for v, i in zip(values, idx)]


def make_server(target, host: str = "127.0.0.1", port: int = 8000, *, k: int | None = None,
                classes: list[str] | None = None, options: FrontOptions | None = None) -> _Server:
    """An HTTP server for ``target`` (a ``DynamicBatcher`` or a ``Router``) bound to ``host:port``.

    ``port=0`` binds an ephemeral port (see ``server_address``). ``k`` overrides ``options.k``.
    """
    options = options or FrontOptions()
    if k is not None:
        options = dataclasses.replace(options, k=k)
    return _Server((host, port), target, options, classes)


def serve_forever(server: _Server) -> threading.Thread:
    """Run ``server`` in a daemon thread; returns the thread (``server.shutdown()`` stops it)."""
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="fastload-http",
                         daemon=True)
    t.start()
    return t
