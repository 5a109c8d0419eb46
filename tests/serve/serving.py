"""Test support for the serving tests: a real ``fastload serve`` subprocess, raw sockets, small clients."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class ServeProcess:
    """``python -m fastload.cli serve ARGS --port 0`` on 127.0.0.1; ``port`` is read from its first line."""

    def __init__(self, *args: str, ready_timeout: float = 90.0) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([sys.executable, "-m", "fastload.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=REPO)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(ready_timeout):
            self.kill()
            raise RuntimeError("fastload serve did not become ready:\n" + self.output())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self._port = int(m.group(1))
            if line.startswith("ready on"):
                self._ready.set()

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 30.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)
        self.proc.stdout.close()


def call(port: int, method: str, path: str, body: bytes = b"", ctype: str | None = "image/jpeg",
         timeout: float = 30.0) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": ctype} if ctype else {})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            data = json.loads(raw or b"{}")
        except ValueError:
            data = {"text": raw.decode(errors="replace")}
        return resp.status, data, dict(resp.getheaders())
    finally:
        conn.close()


def raw(port: int, payload: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``payload`` on a fresh connection and read until the server closes it (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                more = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not more:
                break
            chunks.append(more)
        return b"".join(chunks)


def status_of(response: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", response)
    return int(m.group(1)) if m else -1


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (EOF or reset), or None if still open after ``seconds``."""
    t0 = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


class LoadOutcome:
    """What each request of a ``loopback_load`` got: a status, or the kind of failure."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.failures: list[str] = []  # "reset ...", "no answer ...": what must never happen
        self.refused = 0  # a new connection refused: the listener is closed (nothing was accepted)

    def add(self, status: int | None = None, failure: str | None = None, refused: bool = False) -> None:
        with self.lock:
            if status is not None:
                self.statuses.append(status)
            if failure is not None:
                self.failures.append(failure)
            self.refused += refused


def loopback_load(port: int, body: bytes, *, keep_alive: int, fresh: int, stop: threading.Event,
                  max_requests: int = 400) -> tuple[LoadOutcome, list[threading.Thread]]:
    """Threads POSTing ``body`` to /predict: ``keep_alive`` of them reuse a connection, ``fresh`` connect per request.

    Each thread stops when ``stop`` is set, after ``max_requests``, or when a new connection is
    refused (the listener closed). A reset or a connection closed without an answer is recorded
    as a failure; so is a kept-alive connection that the server closed without saying
    ``Connection: close`` (the client could not know the request would not be read).
    """
    out = LoadOutcome()
    headers = {"Content-Type": "image/jpeg"}

    def worker(reuse: bool) -> None:
        conn = None
        used = 0
        for _ in range(max_requests):
            if stop.is_set():
                break
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    conn.connect()
                except ConnectionRefusedError:
                    out.add(refused=True)
                    return
                used = 0
            used += 1
            where = f"on a {'reused' if used > 1 else 'new'} connection"
            try:
                conn.request("POST", "/predict", body=body, headers=headers)
                resp = conn.getresponse()
                resp.read()
                out.add(status=resp.status)
                closing = resp.will_close
            except (ConnectionResetError, BrokenPipeError) as exc:  # a broken pipe is a reset met while sending
                out.add(failure=f"reset {where}: {exc!r}")
                closing = True
            except (http.client.RemoteDisconnected, ConnectionAbortedError) as exc:
                out.add(failure=f"no answer {where}: {exc!r}")
                closing = True
            except OSError as exc:
                out.add(failure=f"error {where}: {exc!r}")
                closing = True
            if closing or not reuse:
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    threads = [threading.Thread(target=worker, args=(i < keep_alive,), daemon=True)
               for i in range(keep_alive + fresh)]
    for t in threads:
        t.start()
    return out, threads
