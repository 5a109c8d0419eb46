"""The node-local shard cache: whole shards of a remote store, shared by every process of a node.

Owns: fetching a shard WHOLE into ``cache_dir`` (to a temporary name, checked against the
manifest's size and sha256, published by one atomic ``rename``), leases that keep a shard a
reader has open from being evicted, least-recently-used eviction under ``cache_limit``, and
the per-process counters a profiler reads (``stats()``).

Layout (``cache_dir`` may hold anything else: only entries the cache made are ever touched)::

    cache_dir/.fastload-cache.lock          global lock: space accounting and eviction
    cache_dir/<store key>/shard-…/data.mdb  a complete shard (a store directory)
    cache_dir/<store key>/shard-…/fastload-cache.json   what makes it ours: url, size, sha256, the
                                            store key and shard name it was published under, and
                                            data.mdb's identity then (size, mtime_ns, inode); its mtime
                                            is the LRU clock (touched at each lease)
    cache_dir/<store key>/shard-…/fastload-unread        a prefetched shard no reader has leased yet
                                            (removed at its first lease); evicted only after every
                                            shard that has been read: its use is still ahead
    cache_dir/<store key>/.locks/<shard>.lease  shared flock held by each reader of the shard
    cache_dir/<store key>/.locks/<shard>.dl     exclusive flock: one download per shard per node
    cache_dir/<store key>/.partial/<shard>.<pid>   a download in progress (never read)
    cache_dir/.reserve/<store key>.<shard>   space reserved by a download (flocked while live)
    cache_dir/.downloads.log                 one JSON line per completed download (``node_downloads``),
                                            written before the shard is published

The store key holds the manifest's identity (``key_for``): a store re-uploaded under the same URL is
another folder, so a job still reading the old version and a new job reading the new one live side by
side; the old version's shards are ordinary LRU entries, evicted under ``cache_limit`` once unleased.

Ours and intact: an entry is the cache's own only where its ``fastload-cache.json`` names the very
folder it sits in (a hand-made copy elsewhere in ``cache_dir`` is never counted nor evicted), and it
is served only while ``data.mdb`` still has the size, mtime_ns and inode recorded when it was
published (one ``stat`` per lease, never a re-hash): a file swapped or rewritten in place is replaced
by a fresh download. Folders a cleanup removed (``.locks/``, ``.partial/``, ``.reserve/``) are made
again where they are needed.

Concurrency uses ``fcntl.flock`` only: a crashed process's locks vanish with it, so a crash
leaves no lock held and no shared-memory segment; its partial file and reservation are
recognised as stale (their lock is free) and removed by the next process.

Must not: know about S3 or any client (the fetch function is injected; ``store/remote.py``'s
``download_file`` by default), decode, or open LMDB (``reader.py`` does, on the leased path).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastload.errors import CacheFullError, RemoteStoreError, ShardCacheError, ShardIntegrityError

__all__ = ["ShardSpec", "ShardCache", "Lease", "parse_size", "stats", "node_downloads", "CACHE_META"]

CACHE_META = "fastload-cache.json"
UNREAD = "fastload-unread"
#: Seconds a prefetched, unread shard outranks read ones for staying (its reader comes within them: a late
#: rank's workers came ~10 s after the other's); after that it is an ordinary LRU entry, so the prefetches of
#: a killed job, or of a resume that no longer needs them, do not outrank every read shard for ever.
UNREAD_HOLD_S = 600.0
#: A reader queued on a download that failed on the endpoint meets its error when it waited this share of
#: that download's tries (it arrived with it, or soon after); otherwise it tries for a budget of its own.
REPLAY_SHARE = 0.8
DOWNLOAD_LOG = ".downloads.log"
_LOCK = ".fastload-cache.lock"
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
Fetch = Callable[[str, Path], None]
#: ``give_back()``: the reader releases one shard it holds; False when it holds none.
GiveBack = Callable[[], bool]


def parse_size(value: int | str | None) -> int | None:
    """Bytes from ``20GB`` (10**9), ``20GiB`` (2**30), ``512MB``, ``1.5T`` or an int; None: no limit.

    Raises:
        ValueError: not a size.
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        if value is not None and value <= 0:
            raise ValueError(f"cache_limit must be positive, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"Unknown value {value!r} for argument cache_limit. Valid values are a byte count "
                         "or a size such as '20GB', '512MiB', '1.5T'.")
    power = " KMGT".index(m.group(2).upper() or " ")
    n = int(float(m.group(1)) * ((1024 if m.group(3) else 1000) ** power))
    if n <= 0:
        raise ValueError(f"cache_limit must be positive, got {value!r}")
    return n


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """One shard as the manifest describes it: where it is and what it must be."""

    name: str
    url: str
    size: int
    sha256: str


class _Stats:
    """Counters of this process (the profiler's hook): read with ``stats()``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.downloads = 0
        self.bytes_downloaded = 0
        self.hits = 0
        self.wait_s = 0.0       # time a reader (not the prefetcher) waited for a shard to arrive
        self.download_s = 0.0   # time spent downloading, in any thread of this process

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return {"downloads": self.downloads, "bytes_downloaded": self.bytes_downloaded, "hits": self.hits,
                    "wait_s": self.wait_s, "download_s": self.download_s}


_STATS = _Stats()


def stats() -> dict[str, float]:
    """This process's cache counters: downloads, bytes_downloaded, hits, wait_s (a reader
    blocked on a shard download), download_s. ``fastload profile`` reads ``wait_s``."""
    return _STATS.snapshot()


def node_downloads(cache_dir: str | os.PathLike[str]) -> list[dict]:
    """Every download this node's cache completed (all processes): store, shard, bytes, pid, time."""
    try:
        text = (Path(cache_dir) / DOWNLOAD_LOG).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class Lease:
    """A shard held open by this process: the cache does not evict it until ``release()``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd, self._pid = path, fd, os.getpid()

    def release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _LIVE.discard(self)
            if self._pid == os.getpid():
                os.close(fd)  # closing the descriptor drops the flock

    @property
    def held(self) -> bool:
        return self._fd >= 0


_LIVE: set[Lease] = set()


def _drop_inherited() -> None:
    # A forked child holds copies of the parent's lease descriptors; the lock lives until every
    # copy is closed, so a child that kept them would block eviction for the parent's releases.
    for lease in list(_LIVE):
        if lease._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(lease._fd)
            lease._fd = -1
    _LIVE.clear()


os.register_at_fork(after_in_child=_drop_inherited)


def _open_lock(path: Path) -> int:
    """A descriptor on the lock file ``path``, its folder made again when missing (a cleanup job
    removed ``.locks/``: every reader needing an eviction crashed with FileNotFoundError)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[int]:
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, mode)
        yield fd
    finally:
        os.close(fd)


def _try_flock(path: Path, mode: int) -> int | None:
    """A descriptor holding ``mode | LOCK_NB`` on ``path``, or None when someone else holds it."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class ShardCache:
    """Whole shards of one remote store in a node-local directory, shared by every process.

    Args:
        cache_dir: the node's cache directory (created if missing); shared by all stores.
        store_key: this store's folder name inside it (``key_for(url, manifest)``).
        fetch: ``fetch(url, dest_path)`` writes the object at ``url`` to ``dest_path``.
        limit: bytes the cache may hold (all stores together; ``parse_size`` strings), None: no limit.
        wait_s: how long a reader waits for space (other processes' shards to be released)
            before ``CacheFullError``. It never waits on its own process's leases: see ``acquire``.

    The constructor touches nothing on disk (it may run in a parent before workers fork).
    """

    def __init__(self, cache_dir: str | os.PathLike[str], *, store_key: str, fetch: Fetch,
                 limit: int | str | None = None, wait_s: float = 120.0) -> None:
        self.dir = Path(cache_dir)
        self.key = store_key
        self.fetch = fetch
        self.limit = parse_size(limit)
        self.wait_s = wait_s

    @staticmethod
    def key_for(url: str, manifest: bytes = b"") -> str:
        """The folder name of a store's shards: readable, unique per URL and per version of the store
        (``manifest``: the bytes of its manifest.json). A store re-uploaded under the same URL gets
        another folder, so a job still reading the old version does not stop a new one."""
        tail = re.sub(r"[^A-Za-z0-9._-]+", "_", url.rstrip("/").split("://")[-1])[-40:]
        key = f"{tail}-{hashlib.sha1(url.rstrip('/').encode()).hexdigest()[:10]}"
        return f"{key}-m{hashlib.sha256(manifest).hexdigest()[:10]}" if manifest else key

    # ---- paths --------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return self.dir / self.key

    def path(self, spec: ShardSpec) -> Path:
        """Where ``spec``'s shard lives when cached (a store directory)."""
        return self.root / spec.name

    def _lock(self, spec: ShardSpec, kind: str) -> Path:
        return self.root / ".locks" / f"{spec.name}.{kind}"

    def _dirs(self) -> None:
        """Make the cache's folders (again: a cleanup may have removed them).

        Raises:
            ShardCacheError: ``cache_dir`` is a file, or this process cannot write in it.
        """
        problem = ""
        try:
            for d in (self.root / ".locks", self.root / ".partial", self.dir / ".reserve"):
                d.mkdir(parents=True, exist_ok=True)
        except (NotADirectoryError, FileExistsError):
            problem = "it, or a folder above it, is a file, not a folder"
        except OSError as exc:
            problem = f"it cannot be written ({exc.strerror or exc})"
        else:
            for d in (self.dir, self.root, self.root / ".locks", self.root / ".partial", self.dir / ".reserve"):
                if not os.access(d, os.W_OK | os.X_OK):  # an existing folder: EACCES, or EROFS for root too
                    why = "read-only file system" if _read_only(d) else "permission denied"
                    problem = f"{d} cannot be written ({why})"
                    break
        if problem:
            raise ShardCacheError(
                f"{self.dir}: the shard cache folder cannot be used: {problem}.\nHINT: pass cache_dir= (or set "
                "XDG_CACHE_HOME) to a writable folder on a local disk, shared by every process of the node; "
                "each process creates and locks files in it.")

    # ---- public -------------------------------------------------------------------------------
    def cached(self, spec: ShardSpec) -> bool:
        """Whether ``spec`` is in the cache, complete, published against the manifest's sha256, and its
        data.mdb still the file published then (size, mtime_ns, inode: one ``stat``)."""
        meta = self._meta(self.path(spec), intact=True)
        return meta is not None and meta.get("sha256") == spec.sha256 and meta.get("size") == spec.size

    def acquire(self, spec: ShardSpec, *, give_back: GiveBack | None = None) -> Lease:
        """``spec``'s shard, downloaded if needed, leased to this process until ``release()``.

        A reader never waits on itself: when the room ``spec`` needs within ``limit`` is held only by
        this process's own leases, ``give_back()`` is called (the reader releases one of its shards)
        until it fits; when that gives nothing back, ``CacheFullError`` is raised at once, naming the
        limit and the shard size (waiting could not help).

        Raises:
            ShardIntegrityError: the downloaded object's size or sha256 is not the manifest's
                (twice in a row: the object was replaced or damaged in the bucket).
            CacheFullError: no room within ``limit`` (every other shard is leased) for
                ``wait_s`` seconds, or at once when this process's own leases fill it, or the cache
                disk is full.
            ShardCacheError: ``cache_dir`` is a file or cannot be written.
            Whatever ``fetch`` raises (``RemoteStoreError`` for the real client).
        """
        self._dirs()
        t0 = time.perf_counter()
        waited = False
        while True:
            lease = self._lease_if_cached(spec)
            if lease is not None:
                if waited:
                    with _STATS.lock:
                        _STATS.wait_s += time.perf_counter() - t0
                else:
                    with _STATS.lock:
                        _STATS.hits += 1
                return lease
            waited = True
            self._download(spec, blocking=True, give_back=give_back)

    def prefetch(self, spec: ShardSpec) -> bool:
        """Download ``spec`` if absent, without waiting for space or for another downloader.

        Returns whether it is cached now. Never raises for lack of room (the reader that needs
        the shard will wait for room instead); integrity and fetch errors are raised.
        """
        self._dirs()
        if self.cached(spec):
            return True
        return self._download(spec, blocking=False)

    def usage(self) -> int:
        """Bytes held by complete cached shards (of every store in ``cache_dir``)."""
        return sum(size for _p, size, _t in self._entries())

    # ---- internals ----------------------------------------------------------------------------
    @staticmethod
    def _meta(path: Path, *, intact: bool = False) -> dict | None:
        """The record of a shard the cache published at ``path`` itself (it names this very folder: a
        copy made elsewhere by hand is not ours), or None. ``intact``: and data.mdb is still the file
        published then (same size, mtime_ns, inode), not one swapped in or rewritten since."""
        try:
            meta = json.loads((path / CACHE_META).read_text())
            st = (path / "data.mdb").stat()
        except (OSError, ValueError):
            return None
        if isinstance(meta, dict) and "key" not in meta:  # a record from before it named its folder
            url, tail = meta.get("url"), f"/{path.name}/data.mdb"
            ours = (isinstance(url, str) and url.endswith(tail) and meta.get("size") == st.st_size
                    and path.parent.name == ShardCache.key_for(url[:-len(tail)]))
            # the cache's own download under that version's folder name (never one a newer key reads):
            # counted and evicted as before, never served; a copy elsewhere does not sit under its key
            return meta if ours and not intact else None
        if not isinstance(meta, dict) or meta.get("key") != path.parent.name or meta.get("name") != path.name:
            return None
        if intact and (meta.get("size") != st.st_size or meta.get("mtime_ns") != st.st_mtime_ns
                       or meta.get("ino") != st.st_ino):
            return None
        return meta

    def _lease_if_cached(self, spec: ShardSpec) -> Lease | None:
        fd = _open_lock(self._lock(spec, "lease"))
        fcntl.flock(fd, fcntl.LOCK_SH)  # eviction holds LOCK_EX only while it deletes
        if not self.cached(spec):
            os.close(fd)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.path(spec) / CACHE_META)  # the LRU clock
        with contextlib.suppress(OSError):
            os.unlink(self.path(spec) / UNREAD)  # read now: an ordinary LRU entry from here on
        lease = Lease(self.path(spec), fd)
        _LIVE.add(lease)
        return lease

    def _download(self, spec: ShardSpec, *, blocking: bool, give_back: GiveBack | None = None) -> bool:
        dl = self._lock(spec, "dl")
        fd = _open_lock(dl)
        failed = dl.with_suffix(".failed")
        waiting_since = time.time()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                return False  # another process downloads it: the reader will wait for that one
            if self.cached(spec):
                return True
            self._replay_failure(failed, waiting_since)
            final = self.path(spec)
            if final.exists():  # an older version of this shard, or a damaged or swapped copy: replace it
                if not self._evict_one(final):
                    if not blocking:
                        return False
                    raise ShardIntegrityError(
                        f"{spec.url}: the cached copy at {final} has another sha256 than the manifest and "
                        "a reader still has it open.\nHINT: the store was rewritten while jobs read it; "
                        "restart the readers of the old version.")
            reserve = self._reserve(spec, blocking, give_back)
            if reserve is None:
                return False
            started = time.time()
            try:
                self._fetch_checked(spec, final, reserve, unread=not blocking)
            except RemoteStoreError as exc:
                # the readers queued on this lock meet an endpoint failure (a whole retry budget spent) at once
                # instead of each retrying for a budget of its own after it (8 workers on a dead endpoint: 8
                # budgets, one after another); any other failure costs a queued reader one request: it asks itself
                if exc.reason != "endpoint":
                    raise
                with contextlib.suppress(OSError):
                    failed.write_text(json.dumps({"started": started, "time": time.time(), "message": exc.args[0],
                                                  "url": exc.url, "reason": exc.reason}))
                raise
            else:
                with contextlib.suppress(OSError):
                    failed.unlink()
            finally:  # a failed download's reservation (a published shard's went with its rename)
                if reserve[0] is not None:
                    with _flock(self.dir / _LOCK, fcntl.LOCK_EX):
                        self._unreserve(reserve)
            return True
        finally:
            os.close(fd)

    @staticmethod
    def _replay_failure(failed: Path, waiting_since: float) -> None:
        """Raise the error of the download of this shard that failed on the endpoint while this reader waited
        for its lock, when the reader waited about as long as that download tried (``REPLAY_SHARE`` of it):
        trying again would only spend a second budget. A reader that came late in it (behind a prefetch
        that had been trying for a while) tries for a budget of its own."""
        try:
            f = json.loads(failed.read_text())
            started, ended = float(f["started"]), float(f["time"])
        except (OSError, ValueError, TypeError, KeyError):
            return
        now = time.time()
        if waiting_since <= ended <= now and now - waiting_since >= REPLAY_SHARE * (ended - started):
            head, sep, rest = str(f.get("message", "")).partition("\n")
            raise RemoteStoreError(f"{head} (the download this reader waited for failed so; not retried again)"
                                   f"{sep}{rest}", url=f.get("url", ""), reason=f.get("reason", "other"))

    @staticmethod
    def _unreserve(reserve: list) -> None:
        """Give a download's reserved room back (under the global lock; once: ``reserve[0]`` becomes None)."""
        fd, path = reserve
        if fd is None:
            return
        reserve[0] = None
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()

    def _fetch_checked(self, spec: ShardSpec, final: Path, reserve: list, *, unread: bool = False) -> None:
        part_dir = self.root / ".partial" / f"{spec.name}.{os.getpid()}.{threading.get_ident()}"
        for stale in (self.root / ".partial").glob(f"{spec.name}.*"):  # we hold its download lock:
            shutil.rmtree(stale, ignore_errors=True)                    # these are dead downloads'
        problem = ""
        for _attempt in range(2):  # a second try when the bytes disagree: a torn or replaced read
            shutil.rmtree(part_dir, ignore_errors=True)
            part_dir.mkdir(parents=True)
            data = part_dir / "data.mdb"
            t0 = time.perf_counter()
            try:
                self.fetch(spec.url, data)
            except Exception as exc:
                shutil.rmtree(part_dir, ignore_errors=True)
                if _disk_full(exc):
                    raise CacheFullError(
                        f"{self.dir}: the cache disk is full while downloading {spec.url} "
                        f"({spec.size:,} bytes); the partial file was removed.\nHINT: free space on that "
                        "disk, or set a smaller cache_limit (it must hold a few shards).") from exc
                raise
            except BaseException:
                shutil.rmtree(part_dir, ignore_errors=True)
                raise
            finally:
                with _STATS.lock:
                    _STATS.download_s += time.perf_counter() - t0
            size = data.stat().st_size if data.exists() else -1
            digest = sha256_file(data) if size == spec.size else ""
            with _STATS.lock:
                _STATS.downloads += 1
                _STATS.bytes_downloaded += max(size, 0)
            if size == spec.size and digest == spec.sha256:
                st = data.stat()  # its identity, checked at each lease (a rename keeps inode and mtime)
                (part_dir / CACHE_META).write_text(json.dumps(
                    {"url": spec.url, "size": spec.size, "sha256": spec.sha256, "fetched": time.time(),
                     "key": self.key, "name": spec.name, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}))
                if unread:  # a prefetch: published with its marker, in the same rename
                    (part_dir / UNREAD).touch()
                # logged before it is published: whoever sees the shard in the cache also sees its line (logged
                # after the rename, a reader in this process leased the prefetched shard, read the rest of the
                # epoch and counted the node's downloads before the prefetch thread wrote it: CI saw 7 of 8)
                line = json.dumps({"store": self.key, "shard": spec.name, "bytes": size, "pid": os.getpid(),
                                   "time": time.time()}) + "\n"
                fd = os.open(self.dir / DOWNLOAD_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line.encode())  # one small O_APPEND write: whole lines from every process
                finally:
                    os.close(fd)
                # atomic: a shard is there whole or not at all. Under the global lock, with its reservation
                # given back in the same step: an accountant sees the reservation or the shard, never both
                # (two ranks under torchrun with a cache of exactly the store's size: counted twice, one shard
                # was evicted and downloaded again) and never neither (over the limit)
                with _flock(self.dir / _LOCK, fcntl.LOCK_EX):
                    os.rename(part_dir, final)
                    self._unreserve(reserve)
                return
            problem = (f"{size:,} bytes instead of {spec.size:,}" if size != spec.size
                       else f"sha256 {digest[:16]}… instead of the manifest's {spec.sha256[:16]}…")
        shutil.rmtree(part_dir, ignore_errors=True)
        raise ShardIntegrityError(
            f"{spec.url}: the downloaded shard has {problem} (twice); it was not used.\nHINT: the object "
            "was replaced or damaged after the manifest was written: run `fastload verify` on the store "
            "URL, or convert it again.")

    def _entries(self) -> list[tuple[Path, int, float]]:
        """Complete shards the cache made, in every store folder: (path, size, last use), in eviction
        order: shards read at least once, least recently used first, then prefetched ones no reader
        has leased yet (oldest first). A prefetched shard's use is still ahead: evicting it first
        (its download is older than the leases of shards read since) would download it twice. An
        unread shard older than ``UNREAD_HOLD_S`` is an ordinary entry (its reader is not coming)."""
        out, now = [], time.time()
        for meta in self.dir.glob(f"*/*/{CACHE_META}"):
            shard = meta.parent
            info = self._meta(shard)
            if info is None:
                continue
            with contextlib.suppress(OSError):
                used = meta.stat().st_mtime
                out.append((shard, int(info["size"]), used,
                            (shard / UNREAD).exists() and now - used < UNREAD_HOLD_S))
        out.sort(key=lambda e: (e[3], e[2]))
        return [e[:3] for e in out]

    def _reserved(self) -> int:
        total = 0
        for r in (self.dir / ".reserve").glob("*"):
            fd = _try_flock(r, fcntl.LOCK_EX)
            if fd is not None:  # nobody holds it: a crashed download's; clean its partial too
                os.close(fd)
                with contextlib.suppress(OSError):
                    r.unlink()
                continue
            with contextlib.suppress(OSError, ValueError):
                total += int(r.read_text() or 0)
        return total

    def _clean_partials(self) -> None:
        for part in (self.root / ".partial").glob("*"):
            name = part.name.split(".")[0]
            fd = _try_flock(self.root / ".locks" / f"{name}.dl", fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is not None:  # no download of that shard runs: the partial is a dead one's
                shutil.rmtree(part, ignore_errors=True)
                os.close(fd)

    def _reserve(self, spec: ShardSpec, blocking: bool, give_back: GiveBack | None = None
                 ) -> list | None:
        """Room for ``spec`` within ``limit`` (evicting least-recently-used unleased shards). When only this
        process's own leases stand in the way, ``give_back()`` frees one and the room is sought again at
        once; with nothing to give back, ``CacheFullError`` at once (waiting on itself could not help)."""
        path = self.dir / ".reserve" / f"{self.key}.{spec.name}.{os.getpid()}"
        deadline = time.monotonic() + self.wait_s
        while True:
            with _flock(self.dir / _LOCK, fcntl.LOCK_EX):
                self._clean_partials()
                if self.limit is None or self._make_room(spec.size):
                    fd = _open_lock(path)
                    os.ftruncate(fd, 0)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    os.write(fd, str(spec.size).encode())
                    return [fd, path]  # a list: _unreserve marks it given back
                own = self._held_here(spec.size) if blocking else None
            if not blocking:
                return None
            assert own is not None and self.limit is not None
            if own[2]:  # the room is ours to free: nobody else will
                if give_back is not None and give_back():
                    continue
                raise CacheFullError(
                    f"{self.dir}: no room for {spec.url} ({spec.size:,} bytes) within cache_limit {self.limit:,} "
                    f"bytes: this process itself holds {own[0]} shard(s) open ({own[1]:,} bytes), and waiting "
                    "for them would never end.\nHINT: raise cache_limit to hold the shards one process reads at "
                    f"once (shuffle window + prefetch, about {self.limit // max(spec.size, 1) + 3} shards of "
                    f"{spec.size:,} bytes or more), or lower the window.")
            if time.monotonic() > deadline:
                raise CacheFullError(
                    f"{self.dir}: no room for {spec.url} ({spec.size:,} bytes) within cache_limit "
                    f"{self.limit:,} bytes for {self.wait_s:.0f} s: every cached shard is open in a reader.\n"
                    "HINT: raise cache_limit to hold at least the shards every process of this node reads at "
                    "once (shuffle window + prefetch, per rank), or lower the window.")
            time.sleep(0.05)

    def _make_room(self, need: int) -> bool:
        assert self.limit is not None
        if need > self.limit:
            raise CacheFullError(f"{self.dir}: one shard ({need:,} bytes) is larger than cache_limit "
                                 f"({self.limit:,} bytes).\nHINT: raise cache_limit.")
        entries = self._entries()  # in eviction order
        used = sum(size for _p, size, _t in entries) + self._reserved()
        for path, size, _t in entries:
            if used + need <= self.limit:
                break
            if self._evict_one(path):
                used -= size
        return used + need <= self.limit

    def _held_here(self, need: int) -> tuple[int, int, bool]:
        """(shards, bytes) of the cached entries this process holds leases on, and whether ``need`` bytes
        would fit within ``limit`` without them (called under the global lock)."""
        mine = {os.path.abspath(lease.path) for lease in list(_LIVE) if lease.held}
        entries = self._entries()
        held = [size for p, size, _t in entries if os.path.abspath(p) in mine]
        others = sum(size for _p, size, _t in entries) - sum(held) + self._reserved()
        return len(held), sum(held), bool(held) and others + need <= (self.limit or 0)

    def _evict_one(self, shard: Path) -> bool:
        """Delete one cached shard unless a reader holds it; True when gone."""
        lease = shard.parent / ".locks" / f"{shard.name}.lease"
        fd = _try_flock(lease, fcntl.LOCK_EX)
        if fd is None:
            return False
        try:
            gone = shard.parent / ".partial" / f"{shard.name}.evicted.{os.getpid()}"
            gone.parent.mkdir(exist_ok=True)  # removed by a cleanup: the rename below would fail
            os.rename(shard, gone)  # out of sight at once, then deleted
            shutil.rmtree(gone, ignore_errors=True)
            return True
        except FileNotFoundError:
            return True
        finally:
            os.close(fd)


def _disk_full(exc: BaseException | None) -> bool:
    """An ENOSPC/EDQUOT anywhere in the chain (the client wraps the OSError in its own error)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _read_only(path: Path) -> bool:
    """Whether ``path`` is on a read-only file system."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes (a shard's, as the manifest records it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
