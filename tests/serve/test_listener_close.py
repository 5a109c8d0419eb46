"""Closing a listener under load resets nothing a client connected: the kernel stops taking new
connections (``_conn.stop_new_connections``) before the backlog is answered and the listener closed."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from fastload.serve._conn import drain_backlog, stop_new_connections

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")


def _listener() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, sock.getsockname()[1]


def test_after_the_stop_a_new_connection_is_not_taken_and_then_refused():
    listener, port = _listener()
    served = socket.create_connection(("127.0.0.1", port))
    inside, _ = listener.accept()
    waiting = socket.create_connection(("127.0.0.1", port))  # handshake done: in the backlog
    assert stop_new_connections(listener)
    late = socket.socket()
    late.settimeout(0.5)
    with pytest.raises(TimeoutError):  # its SYN is dropped: the kernel does not take it into the backlog
        late.connect(("127.0.0.1", port))
    late.close()
    served.sendall(b"ping")  # an accepted connection still works both ways
    assert inside.recv(4) == b"ping"
    inside.sendall(b"pong")
    assert served.recv(4) == b"pong"
    answered = []

    def answer(sock: socket.socket) -> None:
        sock.sendall(b"503")
        answered.append(sock)

    t0 = time.monotonic()
    assert drain_backlog(listener, answer, settle_s=0.1) == 1  # the connection that was waiting, answered
    assert time.monotonic() - t0 < 5
    assert waiting.recv(3) == b"503"
    listener.close()
    again = socket.socket()
    again.settimeout(5)
    with pytest.raises(ConnectionRefusedError):  # refused, not reset: nothing was accepted
        again.connect(("127.0.0.1", port))
    for s in (served, inside, waiting, again, *answered):
        s.close()

