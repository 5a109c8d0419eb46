"""A small HTTP front for ``DynamicBatcher``, for load tests over loopback and simple deployments.

Owns: ``POST /predict`` (image bytes in, JSON top-k out), ``GET /healthz`` (200 only after
warm-up), ``GET /stats``, ``GET /trace`` (Chrome trace), and the error mapping: 400 naming
the problem for an empty body, a wrong content type or undecodable bytes (decompression
bombs included), 503 with ``Retry-After`` when the queue is full.

Why the standard library's ``ThreadingHTTPServer``: no dependency, and a thread per
connection that blocks on its request's future is the natural shape for a batcher (the
batching happens behind the futures). It is fine for loopback load tests and modest
fan-in; behind a high-concurrency ASGI server, use ``DynamicBatcher.submit_async``.

Must not: do its own preprocessing or batching.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from fastload.errors import CorruptSampleError, Overloaded
from fastload.serve.batcher import DynamicBatcher

__all__ = ["make_server", "serve_forever", "MAX_BODY_BYTES"]

log = logging.getLogger("fastload.serve")

MAX_BODY_BYTES = 64 << 20
_OK_TYPES = ("image/", "application/octet-stream")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # route through logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        b = self.server.batcher
        if self.path == "/healthz":
            ready = b.ready.is_set()
            self._send(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                       {"ready": ready, "device": str(b.device)})
        elif self.path == "/stats":
            self._send(HTTPStatus.OK, b.stats())
        elif self.path == "/trace":
            self._send(HTTPStatus.OK, b.trace())
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}; try POST /predict, GET /healthz, "
                                                       "/stats or /trace"})

    def do_POST(self) -> None:
        if self.path != "/predict":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}; POST image bytes to /predict"})
            return
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       {"error": f"body of {length} bytes is over the {MAX_BODY_BYTES} byte limit"})
            return
        body = self.rfile.read(length) if length else b""
        if not ctype.startswith(_OK_TYPES):
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"wrong content type {ctype or '(none)'!r}: send the image "
                                                         "bytes as image/jpeg, image/png or application/octet-stream"})
            return
        if not body:
            self._send(HTTPStatus.BAD_REQUEST, {"error": "empty body: POST the encoded image bytes"})
            return
        try:
            future = self.server.batcher.submit(body)
        except Overloaded as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, {"Retry-After": "1"})
            return
        except RuntimeError as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)}, {"Retry-After": "5"})
            return
        try:
            out = future.result(timeout=self.server.request_timeout)
        except CorruptSampleError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        except Exception as exc:
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._send(HTTPStatus.OK, {"top_k": self.server.top_k(out)})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # listen backlog: the default 5 refuses connections under a burst

    def __init__(self, address, batcher: DynamicBatcher, *, k: int = 5, classes: list[str] | None = None,
                 request_timeout: float = 60.0) -> None:
        super().__init__(address, _Handler)
        self.batcher, self.k, self.classes, self.request_timeout = batcher, k, classes, request_timeout

    def top_k(self, logits: torch.Tensor) -> list[dict[str, Any]]:
        probs = torch.softmax(logits.float().flatten(), 0)
        k = min(self.k, probs.numel())
        values, idx = probs.topk(k)
        return [{"index": int(i), "class": self.classes[int(i)] if self.classes else str(int(i)),
                 "score": float(v)} for v, i in zip(values, idx)]


def make_server(batcher: DynamicBatcher, host: str = "127.0.0.1", port: int = 8000, *, k: int = 5,
                classes: list[str] | None = None) -> _Server:
    """An HTTP server bound to ``host:port`` (``port=0``: an ephemeral one, see ``server_address``)."""
    return _Server((host, port), batcher, k=k, classes=classes)


def serve_forever(server: _Server) -> threading.Thread:
    """Run ``server`` in a daemon thread; returns the thread (``server.shutdown()`` stops it)."""
    t = threading.Thread(target=server.serve_forever, name="fastload-http", daemon=True)
    t.start()
    return t
