"""Helpers for the streaming tests: publish a local sharded store to a bucket, and a loopback TCP proxy
that can be slowed down or taken away (the "throttled endpoint" and "endpoint gone" of the tests)."""

from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
import time
from pathlib import Path

from fastload.store import format as fmt
from fastload.store import remote
from fastload.store.manifest import MANIFEST_NAME, MANIFEST_VERSION, SAMPLES_NAME, Manifest, ShardEntry, samples_object
from fastload.store.reader import load_store_metas


def manifest_for(store: Path) -> tuple[Manifest, bytes]:
    """The manifest (format ``MANIFEST_VERSION``) of a local folder of shards, and its samples object."""
    metas = load_store_metas(store)
    entries, start = [], 0
    for m in metas:
        data = (m.path / "data.mdb").read_bytes()
        entries.append(ShardEntry(m.path.name, start, m.count, len(data), hashlib.sha256(data).hexdigest()))
        start += m.count
    samples, entry = samples_object([y for m in metas for y in m.labels.tolist()], [p for m in metas for p in m.paths])
    return Manifest(MANIFEST_VERSION, tuple(entries), tuple(metas[0].classes), start, {}, {}, entry), samples


def publish(store: Path, url: str, *, format_version: int = MANIFEST_VERSION) -> Manifest:
    """Upload every shard's data.mdb, the samples object (format 2), then the manifest (last, as the
    contract says). ``format_version=1``: a store as fastload wrote it before the samples object."""
    man, samples = manifest_for(store)
    loc = remote.RemoteLocation.parse(url)
    for e in man.shards:
        remote.upload_file(store / e.name / "data.mdb", loc.child(f"{e.name}/data.mdb"))
    if format_version == 1:
        man = dataclasses.replace(man, format_version=1, samples=None)
    else:
        remote.put_bytes(loc.child(SAMPLES_NAME), samples)
    remote.put_bytes(loc.child(MANIFEST_NAME), man.to_json().encode())
    return man


def sharded_store(tree: Path, dst: Path, shards: int) -> Path:
    from fastload.pack.convert import ConvertOptions, convert

    for i in range(shards):
        convert(tree, dst, ConvertOptions(progress=False, workers=1, num_shards=shards, shard_index=i))
    assert len(fmt.find_shards(dst)) == shards
    return dst


_BURST = 256 << 10  # shared link: bytes it may send at once after being idle (absorbs the proxy's own jitter)


class Proxy:
    """A loopback TCP proxy to ``target_port``: ``rate`` bytes/s towards the client (None: unlimited), per
    connection, or with ``shared=True`` for all connections together (one link: concurrent downloads share
    it); ``down()`` closes every connection and refuses new ones until ``up()``; ``hang()`` closes every
    connection and accepts new ones but never answers them (held open until ``close()``: a server that
    has its port back but does not serve yet), until ``up()``. ``mark()`` then
    ``traffic()``: the bytes sent towards the client since the mark, and the ``time.monotonic()`` of the
    first and the last of them (how busy the link was)."""

    def __init__(self, target_port: int, rate: float | None = None, *, shared: bool = False) -> None:
        self.target, self.rate, self.shared = target_port, rate, shared
        self._link_free = 0.0  # shared: when the link has sent what was queued on it (monotonic)
        self._sent, self._first, self._last = 0, 0.0, 0.0
        self._up = threading.Event()
        self._up.set()
        self._hang = False
        self.held: list[socket.socket] = []  # hang(): the connections accepted and never answered
        self._stop = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self._hang:
                self.held.append(client)
                continue
            if not self._up.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.rate, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, rate: float | None, down: bool = False) -> None:
        try:
            while True:
                data = src.recv(16384)
                if not data:
                    break
                if down and rate and self.shared:  # queue on the one link: wait for its turn, then send
                    with self._lock:  # a token bucket of _BURST bytes: the proxy's own pauses are not lost time
                        now = time.monotonic()
                        self._link_free = max(self._link_free, now - _BURST / rate) + len(data) / rate
                        until = self._link_free
                    time.sleep(max(0.0, until - now))
                dst.sendall(data)
                if down:
                    with self._lock:
                        self._last = time.monotonic()
                        self._first = self._first or self._last
                        self._sent += len(data)
                if rate and not self.shared:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def down(self) -> None:
        self._up.clear()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                    c.close()
                except OSError:
                    pass
            self._conns.clear()

    def hang(self) -> None:
        self.down()
        self._hang = True

    def up(self) -> None:
        self._hang = False
        self._up.set()

    def mark(self) -> None:
        with self._lock:
            self._sent, self._first, self._last = 0, 0.0, 0.0

    def traffic(self) -> tuple[int, float, float]:
        with self._lock:
            return self._sent, self._first, self._last

    def close(self) -> None:
        self._stop = True
        for c in self.held:
            c.close()
        self.down()
        self.sock.close()
