"""The ASGI front: ``routes.py`` as a starlette app served by uvicorn (``pip install 'fastload[serve]'``).

Owns: the starlette app (the same routes and answers as ``http.py``: both ask
``routes.py``), awaiting predictions with ``submit_async`` on uvicorn's event loop (no
thread per connection or request), the uvicorn server on a socket bound here (``port=0``
and bind errors behave as in ``http.py``), the defences uvicorn leaves to the application,
and the interface ``app.py`` drives (``serve_forever``, ``begin_drain``, ``wait_idle``,
``shutdown``, ``refuse_backlog``, ``http_stats``, ``close_all``).

What applies as in ``http.py``, and where:
- framing: uvicorn's parser (httptools, or h11 without it) frames every request, and
  refuses a malformed ``Content-Length`` itself (its own 400 "Invalid HTTP request
  received.", connection closed); the app then applies ``routes.framing`` (411 on chunked
  or a missing length on POST);
- 413 from the headers before the body is read; after every answer that closes the
  connection (413, framing, draining, a body sent with a GET) the app reads and discards
  what the client still sends (until ``linger_s`` passes without data, 30 s at most), as
  ``http.py``'s lingering close does, so the client reads the answer, not a reset;
- the body deadline (``body_timeout_s`` over the whole body: 408, closed): the app reads
  the body, so it bounds it;
- keep-alive idle timeout: uvicorn's ``timeout_keep_alive`` (the close made lingering by
  ``_protocol``);
- the connection cap: at the cap the oldest idle keep-alive connection closes to make room
  (``_protocol``, as ``http.py``); a request arriving while more than ``max_connections``
  connections are still open gets 503 + ``Retry-After`` (uvicorn's own
  ``limit_concurrency`` answers without ``Retry-After`` and outside the app's counters);
  idle connections cost no thread;
- the head caps (``_protocol``): 100 fields of 64 KiB each, as ``http.py``, and 1 MiB in all
  (httptools buffers an unfinished field without limit): 431, lingering close;
- draining (``_protocol.shutdown``): an idle connection, or one whose request has not
  arrived, gets ``linger_s`` of grace (its request is answered 503 + close), then a
  lingering close; uvicorn would close it at once and reset a request crossing the close;
- queue cap (503), request deadline (504, the request leaves the queue: cancelling the
  awaiting task cancels it), pixel budget and bad images (400): the batcher and ``routes.py``.

- the header deadline (``header_timeout_s`` for the request line and headers, in total,
  from the connection's opening or the next request's first byte): uvicorn has none (it
  arms its keep-alive timer only between requests and cancels it on any byte), so with
  httptools (the ``serve`` extra) its protocol class is wrapped (``_protocol``):
  a timer armed when a connection opens and when a request's first byte arrives, disarmed
  when its headers are complete, closes the connection when it fires. The same approach
  as https://github.com/xorbitsai/inference/pull/5213, written here against uvicorn's
  ``HttpToolsProtocol`` callbacks (``connection_made``, ``on_message_begin``,
  ``on_headers_complete``, ``connection_lost``). Without httptools (h11) there is no header
  deadline, no head caps beyond h11's own 16 KiB, no eviction at the cap and no grace at a
  drain, and ``make_server`` logs it.

What uvicorn does not allow: its own 400s (unparseable requests) are not counted in
``/metrics``.

Must not: decide what a route answers (``routes.py``), preprocess or batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import itertools
import logging
import socket
import threading
import time
from typing import Any

from fastload.errors import MissingDependencyError
from fastload.serve._conn import Lingerer, drain_backlog, raw_response, refuse
from fastload.serve.routes import MAX_HEAD_BYTES, MAX_HEADER_LINE, MAX_HEADERS, FrontOptions, Reply, Routes, framing

__all__ = ["AsgiServer", "make_server", "serve_forever", "require"]

log = logging.getLogger("fastload.serve")

_LINGER_MAX_S = 30.0  # as http.py's Lingerer: a client streaming a huge body is cut after this
_GET = ("GET", "HEAD")


def require() -> Any:
    """The ``uvicorn`` module; ``MissingDependencyError`` with the pip command when the extra is missing."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise MissingDependencyError(f"the ASGI front needs uvicorn and starlette ({exc}).\n"
                                     "HINT: pip install 'fastload[serve]', or serve with --front stdlib") from None
    return uvicorn


async def _discard(receive, quiet_s: float, max_s: float) -> None:
    """Drop what the client still sends: until its body ends, it leaves, ``quiet_s`` pass without data, or ``max_s``."""
    end = time.monotonic() + max_s
    while (left := end - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(receive(), min(quiet_s, left))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _response(reply: Reply, *, close: bool, linger: tuple[float, float] | None):
    """A starlette response for ``reply``; with ``linger``, it discards the client's unread input before closing."""
    from starlette.responses import Response

    class _Linger(Response):
        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body, "more_body": True})
            await _discard(receive, *linger)  # the answer is out; the connection closes after this
            await send({"type": "http.response.body", "body": b""})

    headers = {**reply.headers, **({"Connection": "close"} if close else {})}
    return (Response if linger is None else _Linger)(reply.encoded(), reply.status, headers, media_type=reply.ctype)


class _App:
    """The ASGI callable: counts and guards every request (connection cap, framing), then starlette routes it."""

    def __init__(self, server: AsgiServer) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.server, self.routes, self.options = server, server.routes, server.options
        self.active = 0
        self.admitted = 0
        self.refused = 0
        get = [Route(p, self._get, methods=["GET"]) for p in ("/healthz", "/stats", "/metrics", "/trace")]
        self.starlette = Starlette(routes=[Route("/predict", self._predict, methods=["POST"]), *get,
                                           Route("/{path:path}", self._other, methods=["GET", "HEAD", "POST", "PUT",
                                                                                       "DELETE", "PATCH", "OPTIONS"])])

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not served
            return

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.routes.count(message["status"])
            await send(message)

        self.active += 1
        before_drain = not self.routes.draining  # what a drain waits for (later ones are answered 503 at once)
        self.admitted += before_drain
        try:
            early = self._guard(scope)
            if early is None:
                await self.starlette(scope, receive, counted)
            else:
                await self._reply(early, scope)(scope, receive, counted)
        finally:
            self.active -= 1
            self.admitted -= before_drain

    def _guard(self, scope) -> Reply | None:
        """503 over the connection cap; the framing error, if any (the body length goes in ``scope["state"]``)."""
        if self.server.connections() > self.options.max_connections:
            self.refused += 1
            return self.routes.over_cap()
        headers = scope["headers"]
        te = [v.decode("latin-1") for n, v in headers if n == b"transfer-encoding"]
        lengths = [v.decode("latin-1") for n, v in headers if n == b"content-length"]
        length = framing(", ".join(te) if te else None, lengths, body_allowed=scope["method"] == "POST")
        if isinstance(length, Reply):
            return length
        scope.setdefault("state", {})["content_length"] = length
        return None

    def _reply(self, reply: Reply, scope, *, linger_s: float | None = None):
        """The response for ``reply``; a closing one lingers (a body sent with a GET closes too)."""
        unread = scope["method"] != "POST" and scope.get("state", {}).get("content_length", 0) > 0
        close = reply.close or unread or self.routes.draining
        lingering = reply.close or unread
        linger = ((self.options.linger_s, _LINGER_MAX_S if linger_s is None else linger_s) if lingering else None)
        return _response(reply, close=close, linger=linger)

    # ---- routes ----------------------------------------------------------------------------

    async def _get(self, request):
        path = request.url.path
        if path == "/healthz":
            reply = self.routes.get(path, self.server.http_stats)
        else:  # stats, metrics and traces take milliseconds of CPU: off the event loop
            from starlette.concurrency import run_in_threadpool

            reply = await run_in_threadpool(self.routes.get, path, self.server.http_stats)
        return self._reply(reply, request.scope)

    async def _other(self, request):
        method, path = request.method, request.url.path
        length = request.scope["state"]["content_length"]
        reply = self.routes.get(path, self.server.http_stats, method) if method in _GET else \
            self.routes.other(method, path, length)
        return self._reply(reply, request.scope)

    async def _predict(self, request):
        from starlette.requests import ClientDisconnect

        length = request.scope["state"]["content_length"]
        early = self.routes.before_body(request.url.path, length)
        if early is not None:
            return self._reply(early, request.scope)

        async def read() -> bytes:
            return b"".join([chunk async for chunk in request.stream()])

        try:
            body = await asyncio.wait_for(read(), self.options.body_timeout_s)
        except asyncio.TimeoutError:  # a slow body: answer and close, lingering at most linger_s
            return self._reply(self.routes.body_timeout(), request.scope, linger_s=self.options.linger_s)
        except ClientDisconnect:  # gone mid-body: nobody to answer
            return self._reply(Reply(400, {"error": "the client closed the connection mid-body"}, close=True),
                               request.scope, linger_s=0.001)
        reply = self.routes.check_body(request.headers.get("content-type"), body) or \
            await self.routes.predict_async(body)
        return self._reply(reply, request.scope)


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request's head is over a cap (the answer is 431)."""


def _protocol(base: type, options: FrontOptions) -> type:
    """``base`` (uvicorn's ``HttpToolsProtocol``) with the defences uvicorn leaves out.

    - a deadline for each request's line and headers (``header_timeout_s``);
    - caps on each request's head as ``http.py`` has them (``MAX_HEADERS`` fields, each
      ``MAX_HEADER_LINE`` bytes) plus ``MAX_HEAD_BYTES`` in all: httptools buffers an
      unfinished header without limit (a 200 MB header flood grew the server by 406 MB);
      over a cap: 431 and a lingering close;
    - closes that never reset a request crossing them: an idle connection that closes
      (idle timeout, evicted, end of a drain) sends FIN first and discards what still
      arrives for ``linger_s`` (uvicorn closes at once, and a request arriving on the closed
      socket is reset);
    - at ``shutdown()`` (a drain), an idle connection or one whose request has not yet
      arrived gets ``linger_s`` of grace (its request is answered 503 + close), then closes
      so; a request under way closes after its answer;
    - at the connection cap, the oldest idle keep-alive connection closes to make room
      (as ``http.py``), instead of the new client getting 503. "Oldest" is the order in
      which connections became idle, counted, not timed: uvloop's ``loop.time()`` is
      libuv's ``uv_now``, whole milliseconds, so connections that became idle within one
      millisecond tied, and ``min`` over uvicorn's connection *set* (hash order) then
      closed any one of them, not necessarily the oldest.
    """
    seconds, linger_s, cap = options.header_timeout_s, options.linger_s, options.max_connections
    became_idle = itertools.count()  # the order idle keep-alive connections became idle in

    class Protocol(base):
        _deadline: asyncio.TimerHandle | None = None
        _grace: asyncio.TimerHandle | None = None
        _linger: asyncio.TimerHandle | None = None
        lingering = False
        _closing = False
        _head: int | None = 0  # bytes of the request head received so far; None once the headers are complete
        _fields = 0
        _too_large = ""
        idle_order: int | None = None  # when the last answer completed, as a count (an idle keep-alive connection)

        # ---- the header deadline ----------------------------------------------------------

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()  # no request was started: nothing to answer

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that sends nothing is cut too
            self._make_room()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.idle_order = None
            self._head, self._fields = 0, 0
            self._arm()  # the next request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._disarm()
            self._head = None
            super().on_headers_complete()
            if self._closing and self.cycle is not None:
                self.cycle.keep_alive = False

        def connection_lost(self, exc) -> None:
            for timer in (self._deadline, self._grace, self._linger):
                if timer is not None:
                    timer.cancel()
            super().connection_lost(exc)

        # ---- the head caps ------------------------------------------------------------------

        def data_received(self, data: bytes) -> None:
            if self.lingering:
                self._linger_more()
                return
            if self._head is not None:
                self._head += len(data)
                if self._head > MAX_HEAD_BYTES:
                    self._refuse_head(f"the request head is over {MAX_HEAD_BYTES} bytes")
                    return
            super().data_received(data)

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > MAX_HEADER_LINE:
                self._too_large = f"the request target is over {MAX_HEADER_LINE} bytes"
                raise _HeadTooLarge

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += 1
            if self._fields > MAX_HEADERS:
                self._too_large = f"more than {MAX_HEADERS} header fields"
                raise _HeadTooLarge
            if len(name) + len(value) > MAX_HEADER_LINE:
                self._too_large = f"a header field is over {MAX_HEADER_LINE} bytes"
                raise _HeadTooLarge
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:  # uvicorn's answer to a parser error
            if self._too_large:  # the error was ours, raised from a callback
                self._refuse_head(self._too_large)
            else:
                super().send_400_response(msg)

        def _refuse_head(self, why: str) -> None:
            self._disarm()
            self.transport.write(raw_response(431, {"error": f"{why}; send fewer or smaller headers"}, {}))
            self._linger_close()

        # ---- lingering closes ---------------------------------------------------------------

        def _linger_close(self) -> None:
            """FIN now, discard what still arrives, close after ``linger_s`` quiet (30 s at most)."""
            if self.lingering or self.transport.is_closing():
                return
            self.lingering = True
            self._unset_keepalive_if_required()
            for timer in (self._deadline, self._grace):
                if timer is not None:
                    timer.cancel()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._hard_end = self.loop.time() + _LINGER_MAX_S
            self._linger_more()

        def _linger_more(self) -> None:
            if self._linger is not None:
                self._linger.cancel()
            at = min(self.loop.time() + linger_s, self._hard_end)
            self._linger = self.loop.call_at(at, self.transport.close)

        def eof_received(self) -> bool | None:
            if self.lingering:
                self.transport.close()
            return None  # asyncio closes the transport after an EOF unless told otherwise

        def timeout_keep_alive_handler(self) -> None:  # the idle timeout
            self._linger_close()

        # ---- draining and the connection cap ------------------------------------------------

        def _busy(self) -> bool:
            return bool(self._head) or (self.cycle is not None and not self.cycle.response_complete)

        def shutdown(self) -> None:
            self._closing = True
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False  # closes after its answer
            elif self._grace is None and not self.lingering:
                self._grace = self.loop.call_later(linger_s, self._end_grace)

        def _end_grace(self) -> None:
            self._grace = None
            if not self._busy():
                self._linger_close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._closing and not self._busy() and not self.transport.is_closing():
                self._linger_close()
            else:
                self.idle_order = next(became_idle)

        def _make_room(self) -> None:
            open_ = [c for c in self.connections if not getattr(c, "lingering", False)]
            if len(open_) <= cap:
                return
            idle = [c for c in open_ if getattr(c, "idle_order", None) is not None and not c._busy()]
            if idle:
                min(idle, key=lambda c: c.idle_order)._linger_close()

    return Protocol


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class AsgiServer:
    """uvicorn serving the app for ``target`` (a ``DynamicBatcher`` or a ``Router``) on a socket bound here."""

    backlog = 512  # as http.py: the listen backlog absorbs a burst of connections

    def __init__(self, target: Any, host: str, port: int, options: FrontOptions,
                 classes: list[str] | None = None) -> None:
        uvicorn = require()
        self.options = options
        self.routes = Routes(target, options, classes)
        self.socket = _listen(host, port, self.backlog)
        self.server_address = self.socket.getsockname()
        # a second handle on the listening socket: when uvicorn closes its own at shutdown, the backlog stays
        # for refuse_backlog() to answer 503 (as http.py does) instead of the kernel resetting it
        self._spare = self.socket.dup()
        self.app = _App(self)
        self.http_impl = "httptools" if importlib.util.find_spec("httptools") else "h11"
        if self.http_impl == "httptools":
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            http: Any = _protocol(HttpToolsProtocol, options)
        else:
            http = "h11"
            log.warning("httptools is not installed: the asgi front has no header deadline "
                        "(pip install 'fastload[serve]')")
        self.config = uvicorn.Config(self.app, http=http, lifespan="off", log_config=None,
                                     log_level="warning", access_log=False, proxy_headers=False, server_header=False,
                                     timeout_keep_alive=options.idle_timeout_s, backlog=self.backlog,
                                     timeout_graceful_shutdown=2 * options.linger_s + 1.0)
        self.uvicorn = uvicorn.Server(self.config)
        self.lingerer = Lingerer()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def draining(self) -> bool:
        return self.routes.draining

    def connections(self) -> int:
        """Open connections, not counting those in a lingering close (their answer is sent)."""
        return sum(not getattr(c, "lingering", False) for c in self.uvicorn.server_state.connections)

    def run(self) -> None:
        """Serve until ``shutdown()``, on an event loop of this thread (uvloop when installed)."""
        if importlib.util.find_spec("uvloop") is not None:
            import uvloop

            loop = uvloop.new_event_loop()
        else:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            loop.run_until_complete(self.uvicorn.serve(sockets=[self.socket]))
        finally:
            loop.close()

    # ---- draining (the interface app.py drives, as http.py's server) -------------------------

    def begin_drain(self) -> None:
        """New requests get 503 + Connection: close; idle keep-alive connections close."""
        self.routes.draining = True
        if self._loop is not None and not self._loop.is_closed():
            def close_idle() -> None:
                for conn in list(self.uvicorn.server_state.connections):
                    conn.shutdown()  # with httptools, _protocol's: idle ones get linger_s of grace, then close

            self._loop.call_soon_threadsafe(close_idle)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every request taken before the drain is answered; False if ``timeout`` passed first.

        Requests arriving during the drain are answered 503 at once and are not waited for
        (under steady load they never stop coming, so waiting for none in flight would always
        run to the timeout).
        """
        deadline = time.monotonic() + timeout
        while self.app.admitted and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.app.admitted

    def shutdown(self) -> None:
        """Stop uvicorn (it closes its listening socket and connections) and wait for its thread."""
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()

    def refuse_backlog(self) -> int:
        """Answer 503 to the connections still in the listen backlog, then close the listener at once.

        Call after ``shutdown()``. As in ``http.py``: a connection still in the backlog when
        the listener closes is reset by the kernel, so ``drain_backlog`` has the kernel drop
        new connection requests first (Linux) and the backlog it empties stays empty.
        """
        def answer(sock: socket.socket) -> None:
            if refuse(sock, "the server is shutting down", self.lingerer, self.options.linger_s):
                self.routes.count(503)

        n = drain_backlog(self._spare, answer)
        self._spare.close()
        return n

    def close_all(self, timeout: float) -> None:
        self._spare.close()
        self.lingerer.close(timeout)

    def server_close(self) -> None:
        self.socket.close()
        self._spare.close()

    # ---- reporting ------------------------------------------------------------------------

    def http_stats(self) -> dict[str, Any]:
        return {"front": "asgi", "http_impl": self.http_impl, "connections": self.connections(),
                "active_requests": self.app.active, "refused_connections": self.app.refused,
                "responses": self.routes.responses(), "draining": self.draining}


def make_server(target: Any, host: str = "127.0.0.1", port: int = 8000, *, k: int | None = None,
                classes: list[str] | None = None, options: FrontOptions | None = None) -> AsgiServer:
    """An ASGI front for ``target`` bound to ``host:port`` (as ``http.make_server``; ``port=0``: ephemeral).

    Raises:
        MissingDependencyError: uvicorn or starlette is not installed.
    """
    options = options or FrontOptions(server="asgi")
    if k is not None:
        options = dataclasses.replace(options, k=k)
    return AsgiServer(target, host, port, options, classes)


def serve_forever(server: AsgiServer) -> threading.Thread:
    """Run ``server`` in a daemon thread; returns the thread (``server.shutdown()`` stops it)."""
    t = threading.Thread(target=server.run, name="fastload-asgi", daemon=True)
    server._thread = t
    t.start()
    return t
