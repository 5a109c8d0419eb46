"""The standard library HTTP front (the default) for a ``DynamicBatcher`` or a ``Router``, safe on a network.

Owns: serving ``routes.py``'s routes (``POST /predict``: image bytes in, JSON top-k out;
``GET /healthz``, ``/stats``, ``/metrics``, ``/trace``) over ``ThreadingHTTPServer``, and the
socket-side defences a front needs:

- read deadlines: the request line and headers must arrive within ``header_timeout_s`` and
  the body within ``body_timeout_s`` of their start, however slowly the client dribbles
  (a per-``recv`` timeout alone lets a byte a second hold a connection forever);
- keep-alive connections idle for ``idle_timeout_s`` are closed (a lingering close: a
  request crossing the close meets an orderly end, never a reset);
- at most ``max_connections`` connections, one thread each; at the cap, the oldest idle
  keep-alive connection is closed to make room (as nginx does), and only when none is idle
  is the next one answered 503 + ``Retry-After`` at once by the accept loop (never an
  unbounded thread per connection); the in-flight cap is the batchers' ``max_queue`` (503 +
  ``Retry-After``);
- a request's head: at most 100 fields of 64 KiB each (``http.server``'s own limits: 431);
- a query string never changes the route; a route's wrong method is 405 + ``Allow``;
- a request deadline (``request_timeout_s``): 504, and the request leaves the queue;
- strict framing: ``Content-Length`` must be one non-negative decimal number (else 400),
  a missing one on POST is 411, ``Transfer-Encoding`` (chunked or not) is refused with 411 /
  400 and the connection closed, so a body can never be read as the next request;
- the body limit: 413 answered from the headers, before the body is read;
- after a response that closes a connection with unread input (413, framing errors,
  overload), a bounded "lingering close" (RFC 9112 §9.6): shut our side, discard what the
  client still sends for ``linger_s``, then close — so the client reads our answer instead
  of a connection reset;
- draining on shutdown: new requests and connections get 503 + ``Connection: close`` until
  the listener closes (right after its backlog is answered); accepted ones finish; an idle
  keep-alive connection's request within ``linger_s`` gets 503, then it closes, lingering.

Why this is the default front and not uvicorn + starlette (``asgi.py``, ``--front asgi``):
measured side by side (``fastload bench serve --fronts stdlib,asgi``, docs/serving.md, "Which
front, measured"), uvicorn serves the same throughput, with a 3-14% lower p50, up to 8%
less CPU per request when images are tiny, and about twice the p99 at
the highest load measured; and uvicorn has no deadline for receiving a request's headers
(``asgi.py`` adds one by wrapping uvicorn's protocol class, which ties it to uvicorn's
internals). This one needs no dependency; a thread blocked on its request's future is the natural
shape for a batcher, and ``max_connections`` bounds the threads.

Must not: do its own preprocessing or batching.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any

from fastload.serve._conn import DeadlineReader, Lingerer, drain_backlog, refuse
from fastload.serve.routes import MAX_BODY_BYTES, FrontOptions, Reply, Routes, framing

__all__ = ["FrontOptions", "make_server", "serve_forever", "MAX_BODY_BYTES"]

log = logging.getLogger("fastload.serve")


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
        self.evicted = False  # set by the server (under its lock): answer what is under way, then close

    def handle(self) -> None:
        opts = self.server.options
        self.close_connection = True
        first = True
        while True:
            if not first and not self._next_request(opts.idle_timeout_s):
                return
            first = False
            self.reader.deadline = time.monotonic() + opts.header_timeout_s
            with self.server.counting():
                self.handle_one_request()
            if self.close_connection or self.linger or self.evicted:
                return

    def _next_request(self, idle_timeout_s: float) -> bool:
        """Keep-alive: wait for the next request's first byte; False when the connection is to close.

        The server may end the wait early (``set_idle``, ``begin_drain``) by shortening the
        reader's deadline; the close is then a lingering one (FIN first, then discard what
        still arrives), so a request sent just as the connection closes meets an orderly end
        of the connection, never a reset.
        """
        self.reader.deadline = time.monotonic() + idle_timeout_s
        self.reader.poll = True
        self.server.set_idle(self, True)
        try:
            data = self.rfile.peek(1)
        except TimeoutError:  # idle timeout, evicted for a new client, or the end of a drain
            self.linger = True
            return False
        except OSError:  # reset by the client
            return False
        finally:
            self.reader.poll = False
            self.server.set_idle(self, False)
        return bool(data)  # b"": the client closed it

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
        self.server.routes.count(code)
        super().send_error(code, message, explain)

    def handle_expect_100(self) -> bool:  # answer 413 before the client sends the body
        length = framing(None, self.headers.get_all("Content-Length") or [], body_allowed=True)
        early = self.server.routes.before_body(self.path, length) if isinstance(length, int) else None
        if early is not None and early.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
            self._reply(early)
            return False
        return super().handle_expect_100()

    # ---- responses -------------------------------------------------------------------------

    def _reply(self, reply: Reply, *, head: bool = False) -> None:
        data = reply.encoded()
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.ctype)
        self.send_header("Content-Length", str(len(data)))
        for k, v in reply.headers.items():
            self.send_header(k, v)
        if reply.close or self.server.routes.draining or self.evicted:
            self.send_header("Connection", "close")
            self.linger = self.linger or reply.close
        self.end_headers()
        if not head:
            self.wfile.write(data)
        self.server.routes.count(reply.status)

    def _framing(self, *, body_allowed: bool) -> int | None:
        """The body length from strict framing; None after answering an error (connection closing)."""
        length = framing(self.headers.get("Transfer-Encoding"), self.headers.get_all("Content-Length") or [],
                         body_allowed=body_allowed)
        if isinstance(length, Reply):
            self._reply(length)
            return None
        if length and not body_allowed:
            self.close_connection = True  # answer, then close: the unread body is never parsed as a request
            self.linger = True
        return length

    # ---- routes ----------------------------------------------------------------------------

    def do_GET(self) -> None:
        if self._framing(body_allowed=False) is not None:
            self._reply(self.server.routes.get(self.path, self.server.http_stats))

    def do_HEAD(self) -> None:  # GET's answer without its body, as uvicorn + starlette answer HEAD
        if self._framing(body_allowed=False) is not None:
            self._reply(self.server.routes.get(self.path, self.server.http_stats, "HEAD"), head=True)

    def _other_method(self) -> None:  # 405 + Allow on a route (as starlette answers), else 404
        length = self._framing(body_allowed=False)
        if length is not None:
            self._reply(self.server.routes.other(self.command, self.path, length))

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def do_POST(self) -> None:
        routes = self.server.routes
        length = self._framing(body_allowed=True)
        if length is None:
            return
        early = routes.before_body(self.path, length)
        if early is not None:
            self.close_connection = early.close
            self._reply(early)
            return
        self.reader.deadline = time.monotonic() + self.server.options.body_timeout_s
        try:
            body = self.rfile.read(length) if length else b""
        except TimeoutError:
            self._reply(routes.body_timeout())
            return
        if len(body) < length:  # the client closed mid-body
            self.close_connection = True
            return
        self._reply(routes.check_body(self.headers.get("Content-Type"), body) or routes.predict(body))


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # listen backlog: the default 5 refuses connections under a burst

    def __init__(self, address, target, options: FrontOptions, classes: list[str] | None = None) -> None:
        super().__init__(address, _Handler)
        self.options = options
        self.routes = Routes(target, options, classes)
        self.lingerer = Lingerer()
        self._lock = threading.Condition()
        self._open = 0
        self._idle: dict[_Handler, float] = {}  # idle keep-alive connections -> when they became idle
        self._evicted: set[socket.socket] = set()  # their threads are ending: their places are free
        self._handed_off: set[socket.socket] = set()
        self._active = 0
        self._refused = 0

    @property
    def draining(self) -> bool:
        return self.routes.draining

    # ---- connections ------------------------------------------------------------------------

    def process_request(self, request, client_address) -> None:
        with self._lock:
            full = self._open - len(self._evicted) >= self.options.max_connections
            refuse = self.draining or (full and not self._evict_oldest_idle())
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
                self._evicted.discard(request)
                self._lock.notify_all()

    def refuse(self, sock: socket.socket) -> None:
        """503 + Retry-After on a connection over the cap (or while draining), then a lingering close."""
        why = ("the server is shutting down" if self.draining
               else f"{self.options.max_connections} connections are open (max_connections)")
        if refuse(sock, why, self.lingerer, self.options.linger_s):
            with self._lock:
                self._refused += 1
            self.routes.count(503)

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
            if not idle:
                self._idle.pop(handler, None)
            elif handler.evicted:  # evicted while answering its last request: close now
                handler.reader.deadline = 0.0
            else:
                self._idle[handler] = time.monotonic()
                if self.draining:
                    self._close_idle_soon(handler)

    def _evict_oldest_idle(self) -> bool:
        """At the connection cap: close the oldest idle keep-alive connection to make room (lock held).

        As nginx and others do, idle connections yield to new clients instead of locking them
        out for the idle timeout. The evicted handler's place counts as free at once (its
        thread ends within ``DeadlineReader.POLL_S``); a request it is already reading is
        still answered, with ``Connection: close``. False when no connection is idle.
        """
        if not self._idle:
            return False
        oldest = min(self._idle, key=self._idle.__getitem__)
        del self._idle[oldest]
        oldest.evicted = True
        oldest.reader.deadline = 0.0  # its idle wait ends at its next poll
        self._evicted.add(oldest.connection)
        return True

    def _close_idle_soon(self, handler: _Handler) -> None:
        """Draining: an idle connection's next request (within ``linger_s``) gets 503; then it closes."""
        handler.reader.deadline = min(handler.reader.deadline, time.monotonic() + self.options.linger_s)

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

    # ---- draining ---------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """New requests and connections get 503 + Connection: close; idle keep-alive connections close soon.

        An idle connection is not closed at once: a client may be sending its next request on
        it right now, and a close crossing that request resets it. Its next request within
        ``linger_s`` is answered 503 + ``Connection: close``; after that it closes, lingering.
        """
        with self._lock:
            self.routes.draining = True
            for h in list(self._idle):
                self._close_idle_soon(h)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every accepted connection is answered and closed; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while (self._active or self._open) and time.monotonic() < deadline:
                self._lock.wait(0.05)
            return not (self._active or self._open)

    def refuse_backlog(self) -> int:
        """Stop new connections, answer 503 to what is still in the listen backlog, then close the listener.

        Call after ``shutdown()``. A connection left in the backlog when the listener closes
        is reset by the kernel: ``drain_backlog`` has the kernel drop new connection requests
        first (Linux), so the backlog it empties stays empty until the close.
        """
        n = drain_backlog(self.socket, self.refuse)
        self.socket.close()
        return n

    def close_all(self, timeout: float) -> None:
        self.server_close()
        self.lingerer.close(timeout)

    # ---- reporting --------------------------------------------------------------------------

    def http_stats(self) -> dict[str, Any]:
        with self._lock:
            open_, active, refused = self._open, self._active, self._refused
        return {"front": "stdlib", "connections": open_, "active_requests": active, "refused_connections": refused,
                "responses": self.routes.responses(), "draining": self.draining}

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # the client went away mid-response: nothing to answer, nothing to fix
            log.debug("connection from %s ended: %s", client_address, exc)
            return
        log.exception("unexpected error while handling a request from %s", client_address)


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
