"""Connection plumbing for the HTTP front: overall read deadlines and lingering closes.

Owns: ``DeadlineReader`` (a raw socket reader whose every ``recv`` waits only until one
overall deadline, so a client dribbling a byte a second cannot hold a connection past
it), ``Lingerer`` (one thread finishing lingering closes, RFC 9112 §9.6), ``raw_response``
(a complete response written by the accept loop itself), ``refuse`` (a 503 written that
way, then a lingering close), ``accept_backlog`` (what still waits in a listen backlog),
``stop_new_connections`` (the kernel stops taking new connections into the backlog) and
``drain_backlog`` (stop, then answer the backlog, so closing the listener resets no client that
connected in time).

Must not: parse HTTP or know about batching.
"""

from __future__ import annotations

import collections
import io
import json
import selectors
import socket
import threading
import time
from http import HTTPStatus
from collections.abc import Iterator
from typing import Any

__all__ = ["DeadlineReader", "Lingerer", "raw_response", "refuse", "accept_backlog", "drain_backlog",
           "stop_new_connections"]


class DeadlineReader(io.RawIOBase):
    """A socket reader whose every ``recv`` waits only until one overall deadline.

    With ``poll`` set, a blocked read wakes every ``POLL_S`` to re-read ``deadline``, so another
    thread can shorten it (an idle keep-alive connection closed early: evicted to make room
    for a new one, or closing at the end of a drain) without touching the socket, whose
    shutdown from another thread could reset a request crossing it.
    """

    POLL_S = 0.1

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.deadline = time.monotonic() + 60.0
        self.poll = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("read deadline passed")
            if not self.poll:
                self.sock.settimeout(remaining)
                return self.sock.recv_into(buf)
            self.sock.settimeout(min(remaining, self.POLL_S))
            try:
                return self.sock.recv_into(buf)
            except TimeoutError:
                continue


class Lingerer:
    """One thread that finishes lingering closes: discard what each socket still receives, then close it.

    A socket closes at EOF, after ``linger_s`` without data, or ``max_s`` after it came
    here, whichever is first (nginx's ``lingering_timeout`` and ``lingering_time``).
    """

    def __init__(self, max_s: float = 30.0) -> None:
        self.max_s = max_s
        self._sel = selectors.DefaultSelector()
        self._new: collections.deque[tuple[socket.socket, float]] = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False

    def add(self, sock: socket.socket, linger_s: float) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        with self._lock:
            self._new.append((sock, linger_s))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fastload-linger", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        socks: dict[socket.socket, list[float]] = {}  # sock -> [quiet deadline, hard deadline, linger_s]
        while True:
            now = time.monotonic()
            with self._lock:
                while self._new:
                    sock, linger_s = self._new.popleft()
                    socks[sock] = [now + linger_s, now + self.max_s, linger_s]
                    self._sel.register(sock, selectors.EVENT_READ)
                if not socks:
                    self._thread = None
                    return
            for key, _ in self._sel.select(0.05):
                sock = key.fileobj
                try:
                    more = sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    more = b""
                entry = socks[sock]
                entry[0] = time.monotonic() + entry[2] if more else 0.0
            now = time.monotonic()
            for sock in [s for s, (quiet, hard, _) in socks.items() if now >= min(quiet, hard)]:
                self._sel.unregister(sock)
                sock.close()
                del socks[sock]

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the sockets still lingering to close."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)


def raw_response(status: int, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    data = json.dumps(body).encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(data)}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


def refuse(sock: socket.socket, why: str, lingerer: Lingerer, linger_s: float) -> bool:
    """503 + ``Retry-After`` on ``sock`` without reading its request, then a lingering close; False if it was gone."""
    try:
        sock.settimeout(0.5)
        sock.sendall(raw_response(503, {"error": f"{why}; retry later"}, {"Retry-After": "1"}))
    except OSError:
        sock.close()
        return False
    lingerer.add(sock, linger_s)
    return True


# A classic BPF program for a TCP listener's socket filter. The kernel runs it on each segment with the
# TCP header at offset 0: byte 13 holds the flags; a segment with SYN set and ACK clear (a new connection
# request) is dropped (return 0), every other one kept (the final ACK of a handshake already begun,
# data and FIN of accepted connections).
_DROP_SYNS = ((0x30, 0, 0, 13),           # ldb [13]
              (0x54, 0, 0, 0x12),         # and #(SYN | ACK)
              (0x15, 0, 1, 0x02),         # jeq #SYN, drop, keep
              (0x06, 0, 0, 0),            # drop: ret #0
              (0x06, 0, 0, 0xFFFFFFFF))   # keep: ret #-1
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)  # Linux


def stop_new_connections(listener: socket.socket) -> bool:
    """From now on the kernel drops new connection requests to ``listener`` (a SYN without ACK), while
    handshakes already begun still complete into its backlog. The clients' SYNs are retried (after
    about 1 s) and then refused, once the listener is closed: refused, not reset, since nothing was
    accepted. Linux only (a socket filter, ``SO_ATTACH_FILTER``); False where it cannot be attached.

    Without it, closing a listener under load resets whatever connections completed their handshake
    between the last look at the backlog and the close (the kernel accepts them on its own): a
    client that connected and sent its request then reads a reset (1 of 346 requests in a CI run of
    ``test_sigterm_under_load_answers_every_request_200_or_503_and_resets_none``).
    """
    import ctypes
    import struct
    import sys

    if not sys.platform.startswith("linux") or listener.family not in (socket.AF_INET, socket.AF_INET6):
        return False
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in _DROP_SYNS))
    prog = struct.pack("HP", len(_DROP_SYNS), ctypes.addressof(code))  # struct sock_fprog (the kernel copies it)
    try:
        listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, prog)
    except OSError:
        return False
    return True


def drain_backlog(listener: socket.socket, answer, settle_s: float = 0.2) -> int:
    """Stop new connections (``stop_new_connections``), then ``answer(sock)`` every connection in the
    backlog until none has arrived for ``settle_s`` (handshakes begun before the stop complete within a
    round trip), for at most ``max(2, 10 * settle_s)`` seconds in all (SYN-cookie handshakes can still
    complete for minutes); returns how many. A handshake that completes later (a round trip over
    ``settle_s``, a lost segment) can still be reset by the close. Where new connections cannot be
    stopped: one pass, as before (the close then leaves a window of microseconds for a reset)."""
    stopped = stop_new_connections(listener)
    n = 0
    quiet_since = t0 = time.monotonic()
    while True:
        for sock in accept_backlog(listener):
            answer(sock)
            n += 1
            quiet_since = time.monotonic()
        now = time.monotonic()
        if not stopped or now - quiet_since >= settle_s or now - t0 >= max(2.0, 10 * settle_s):
            return n
        time.sleep(0.01)


def accept_backlog(listener: socket.socket) -> Iterator[socket.socket]:
    """Accept, without waiting, the connections still in ``listener``'s backlog (blocking sockets)."""
    listener.setblocking(False)
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:  # BlockingIOError: the backlog is empty
            return
        sock.setblocking(True)
        yield sock
