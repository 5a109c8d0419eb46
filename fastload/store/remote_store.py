"""Reading a sharded store in object storage, shard by shard, through the node cache.

Owns: ``RemoteStoreReader``, the remote twin of ``reader.StoreReader``: the manifest read
once, each shard leased from the node's ``ShardCache`` (``cache.py``) when a sample of it is
first read in this process, opened with the same read-only LMDB handle cache as a local
store, every record checked against its crc32; at most ``open_shards`` shards leased per
process (the least recently used is given back first, so the cache may evict it); and
background prefetch of the shards a sampler says come next.

Every shard opened is checked against what was handed out before it: its sample count and class names
against the manifest's (``classes``/``ds.classes`` come from the manifest, so an edited manifest
is named at the first shard read, not trained on), its labels and paths against
``samples.json.gz``'s when those were handed out.

Labels, relative paths and checksums live in each shard's metadata record, so they are known
once the shard is here: ``label(i)`` and ``relpath(i)`` download the shard of ``i`` if needed.
All labels and paths at once (``sample_index()``: ``targets`` / ``samples``) come from the
manifest's ``samples.json.gz`` (format 2) in one small GET, checked against its sha256; a
format-1 store has none (None: the caller reads the shards).

Must not: decode, shuffle or decide an order (``load/shards.py`` does), or write to the bucket.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastload.datasets import cache_dir as fastload_cache_dir
from fastload.errors import ChecksumError, ManifestError, RemoteStoreError, StoreDamagedError
from fastload.marks import timed
from fastload.store import format as fmt
from fastload.store import remote
from fastload.store.cache import ShardCache, ShardSpec
from fastload.store.manifest import MANIFEST_NAME, SAMPLES_NAME, SHARD_FILE, Manifest, parse_samples
from fastload.store.reader import open_readonly, open_resolved, read_meta, release

__all__ = ["RemoteStoreReader", "default_cache_dir"]

log = logging.getLogger("fastload")


def default_cache_dir() -> Path:
    """``shards`` in fastload's one cache folder (``datasets.cache_dir()``: ``$FASTLOAD_CACHE``, else
    ``$XDG_CACHE_HOME/fastload`` or ``~/.cache/fastload``)."""
    return fastload_cache_dir() / "shards"


def _download(url: str, dest: Path) -> None:
    """``remote.download_file``; in a process forked after obstore was used, in a fresh child
    (``_fetch_child.py`` says why)."""
    if not any(key[0] != os.getpid() for key in list(remote._STORES)):
        remote.download_file(url, dest)
        return
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "fastload.store._fetch_child", url, str(dest), str(os.getpid())],
                          capture_output=True, text=True)
    if proc.returncode == 0:
        return
    lines = proc.stderr.strip().splitlines()
    try:
        info = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RemoteStoreError(f"{url}: downloading failed: the download process exited with {proc.returncode}: "
                               f"{' '.join(lines[-3:])[:300]}.\nHINT: rerun; if it persists, check the endpoint",
                               url=url) from None
    cause = OSError(info["errno"], "") if info.get("errno") else None
    raise RemoteStoreError(info["message"], url=info["url"], reason=info["reason"]) from cause


class RemoteStoreReader:
    """Random access to the records of a sharded store in a bucket (``s3://``, ``gs://``, ``az://``).

    Args:
        url: the store's folder URL (the one holding ``manifest.json``).
        cache_dir: the node's shard cache (default ``default_cache_dir()``).
        cache_limit: bytes the cache may hold, or a size string (``"20GB"``); None: no limit.
        verify: check each record against its crc32 (as local stores do).
        open_shards: shards one process keeps leased at once (the default window, 4, and one more);
            fewer when ``cache_limit`` holds fewer (the oldest is given back rather than waited on).
        fetch: ``fetch(url, path)``, for tests; default ``store.remote.download_file``.

    Raises:
        RemoteStoreError: the manifest cannot be read (names the URL).
        ManifestError: it is invalid.
    """

    remote = True

    def __init__(self, url: str, *, cache_dir: str | os.PathLike[str] | None = None, cache_limit=None,
                 verify: bool = True, open_shards: int = 5, fetch=None, prefetch_threads: int = 2) -> None:
        self.path = str(url).rstrip("/") + "/"
        loc = remote.RemoteLocation.parse(self.path)
        where = str(loc.child(MANIFEST_NAME))
        raw = remote.get_bytes(where)
        self.manifest = Manifest.from_json(raw, where=where)
        self.verify = verify
        self.classes = list(self.manifest.classes)
        self.offsets = [s.start for s in self.manifest.shards] + [self.manifest.num_samples]
        self.specs = [ShardSpec(name=s.name, url=str(loc.child(f"{s.name}/{SHARD_FILE}")), size=s.bytes,
                                sha256=s.sha256) for s in self.manifest.shards]
        # the manifest in the key: a re-uploaded store is another folder, so the version a running job still
        # reads and the one a new job reads live side by side (docs/streaming.md says how old ones go)
        self.cache = ShardCache(cache_dir or default_cache_dir(), store_key=ShardCache.key_for(self.path, raw),
                                fetch=fetch or _download, limit=cache_limit)
        self.open_shards = max(1, int(open_shards))
        self.prefetch_threads = prefetch_threads
        self.identity = "manifest:" + hashlib.sha1("".join(s.sha256 for s in self.manifest.shards).encode()
                                                   ).hexdigest()[:20]
        self._samples: tuple[list[int], list[str]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._open: OrderedDict[int, tuple] = OrderedDict()  # shard -> (lease, meta, resolved path)
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._endpoint_failed = -math.inf  # when a prefetch last failed on the endpoint (monotonic)
        self._reading: dict[int, int] = {}  # shard -> reads in flight (threads): never given back meanwhile
        self._pressed: set[int] = set()  # shards given back because the cache_limit asked for room
        self._thrash_said = False

    def __getstate__(self) -> dict:  # leases, handles and threads stay in the process that made them
        state = dict(self.__dict__)
        for k in ("_open", "_lock", "_pool", "_pid", "_samples", "_reading", "_pressed", "_thrash_said"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._samples = None
        self._reset()

    shard_ordered = True  #: ``readers.Reader``: a shard is fetched whole before it is read

    def __len__(self) -> int:
        return self.manifest.num_samples

    @property
    def shard_sizes(self) -> list[int]:
        return [s.count for s in self.manifest.shards]

    def locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.path}: index {index} out of range for {len(self)} samples")
        return self.manifest.locate(index)

    # ---- shards ---------------------------------------------------------------------------
    def _shard(self, i: int, *, hold: bool = False):
        """``(lease, meta, resolved path)`` of shard ``i`` in this process, downloading it if needed.
        ``hold``: a read of it is in flight until ``_let_go(i)`` (it is not given back meanwhile)."""
        if self._pid != os.getpid():
            self._reset()  # inherited through fork: the parent's leases are not ours (cache.py drops them)
        with self._lock:
            hit = self._open.get(i)
            if hit is not None:
                self._open.move_to_end(i)
                if hold:
                    self._reading[i] = self._reading.get(i, 0) + 1
                return hit
            while len(self._open) >= self.open_shards:  # give back the oldest first: it may be evicted
                if not self._give_back_one(pressed=False):
                    break  # every shard held is being read (threads): hold one more for a moment
            spec = self.specs[i]
            if i in self._pressed and not self._thrash_said:
                self._thrash_said = True
                largest = max(s.size for s in self.specs)
                log.warning(
                    "%s: shard %s was given back to make room under cache_limit=%s and is needed again: it may be "
                    "downloaded again each time. HINT: a reader holds its window's shards and one more; raise "
                    "cache_limit to at least %s bytes (5 x the largest shard, %s bytes) per process",
                    self.path, spec.name, self.cache.limit, 5 * largest, largest)
            # a cache_limit that holds fewer shards than open_shards: the cache asks for ours back rather
            # than wait on them (this process would wait on itself for ever)
            lease = self.cache.acquire(spec, give_back=self._give_back_one)
            try:
                env = open_readonly(lease.path)
                meta = read_meta(env, lease.path)
            except BaseException:
                release(lease.path)
                lease.release()
                raise
            problem = None
            if list(meta.classes) != self.classes:  # the names handed out (ds.classes) come from the manifest
                release(lease.path)
                lease.release()
                k = next((j for j, (a, b) in enumerate(zip(meta.classes, self.classes)) if a != b),
                         min(len(meta.classes), len(self.classes)))
                say = (lambda c: repr(c[k]) if k < len(c) else "nothing")  # noqa: E731
                raise ManifestError(
                    f"{self.path}{MANIFEST_NAME}: its class names are not those of {spec.url}: class {k} is "
                    f"{say(self.classes)} in the manifest, {say(meta.classes)} in the shard ({len(self.classes)} vs "
                    f"{len(meta.classes)} classes); every label would be handed out with the wrong name.\nHINT: the "
                    "manifest was edited or comes from another conversion; check the store with `fastload verify "
                    f"{self.path.rstrip('/')}`, and convert the source again into a new DST.")
            if meta.count != self.manifest.shards[i].count:
                problem = f"the shard holds {meta.count} samples, the manifest says {self.manifest.shards[i].count}"
            elif self._samples is not None:  # labels already handed out from samples.json.gz: they must agree
                lo, hi = self.offsets[i], self.offsets[i] + meta.count
                if meta.labels.tolist() != self._samples[0][lo:hi] or list(meta.paths) != self._samples[1][lo:hi]:
                    problem = f"its labels or paths differ from {SAMPLES_NAME}'s"
            if problem is not None:
                release(lease.path)
                lease.release()
                raise StoreDamagedError(f"{spec.url}: {problem}.\nHINT: the store was rewritten after its manifest; "
                                        "convert it again.")
            # the path resolved once: open_readonly resolves it on every call (a few lstat per read)
            self._open[i] = (lease, meta, os.path.realpath(lease.path))
            if hold:
                self._reading[i] = self._reading.get(i, 0) + 1
            return self._open[i]

    def _let_go(self, i: int) -> None:
        with self._lock:
            left = self._reading.get(i, 0) - 1
            if left > 0:
                self._reading[i] = left
            else:
                self._reading.pop(i, None)

    def _give_back_one(self, pressed: bool = True) -> bool:
        """Release the shard this process used least recently and no thread is reading (handle closed,
        lease given back: it may be evicted at once); False when there is none. ``pressed``: the cache
        asked for it to make room (remembered, to warn when the same shard is needed again). Called with
        ``self._lock`` held."""
        j = next((j for j in self._open if not self._reading.get(j)), None)
        if j is None:
            return False  # a shard a thread is reading is never closed under it
        lease, _meta, _key = self._open.pop(j)
        release(lease.path)
        lease.release()
        if pressed:
            self._pressed.add(j)
        return True

    def prefetch_shards(self, shards: list[int]) -> None:
        """Download these shards in the background (best effort: a reader that needs one waits for it)."""
        if self._pid != os.getpid():
            self._reset()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.prefetch_threads, thread_name_prefix="fastload-prefetch")
        queued = time.monotonic()
        for i in shards:
            self._pool.submit(self._prefetch_one, i, queued)

    def _prefetch_one(self, i: int, queued: float) -> None:
        """One background download. Dropped when a prefetch that ended after this one was queued
        failed on the endpoint (it retried for the whole budget): each queued behind it would spend
        another budget on the same dead endpoint (6 shards, 2 threads: 3 budgets after the job has
        already failed). The reader that needs the shard still downloads it, and meets the error
        itself; prefetches queued after the failure (a later window's) try again."""
        if self._endpoint_failed > queued:
            log.debug("prefetch of %s dropped: a prefetch just failed on the endpoint", self.specs[i].url)
            return
        try:
            self.cache.prefetch(self.specs[i])
        except Exception as exc:  # the reader meets the same error, in the sample that needs it
            if getattr(exc, "reason", "") == "endpoint":
                self._endpoint_failed = time.monotonic()
            log.warning("prefetch of %s failed: %s", self.specs[i].url, str(exc).splitlines()[0])

    def close(self) -> None:
        """Give back every shard this process holds (handles closed, leases released)."""
        with self._lock:
            while self._open:
                _i, (lease, _meta, _key) = self._open.popitem(last=False)
                release(lease.path)
                lease.release()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def sample_index(self) -> tuple[list[int], list[str]] | None:
        """Every sample's ``(labels, relative paths)`` from ``samples.json.gz``: one GET, no shard;
        None for a format-1 store (no such object: read them from the shards).

        Raises:
            ManifestError: the object is not the one the manifest names (size, sha256) or does
                not fit it.
            RemoteStoreError: it cannot be read (names the URL).
        """
        if self.manifest.samples is None:
            return None
        if self._samples is None:
            where = str(remote.RemoteLocation.parse(self.path).child(SAMPLES_NAME))
            if any(key[0] != os.getpid() for key in list(remote._STORES)):  # forked after obstore was used
                import tempfile

                with tempfile.TemporaryDirectory(prefix="fastload-samples-") as tmp:
                    _download(where, Path(tmp) / SAMPLES_NAME)  # in a fresh child (_fetch_child.py says why)
                    data = (Path(tmp) / SAMPLES_NAME).read_bytes()
            else:
                data = remote.get_bytes(where)
            self._samples = parse_samples(data, self.manifest, where=where)
        return self._samples

    # ---- records --------------------------------------------------------------------------
    def label(self, index: int) -> int:
        shard, local = self.locate(index)
        return int(self._shard(shard)[1].labels[local])

    def relpath(self, index: int) -> str:
        shard, local = self.locate(index)
        return self._shard(shard)[1].paths[local]

    @timed("read")
    def get(self, index: int, *, verify: bool | None = None) -> bytes:
        """The stored bytes of sample ``index``, checked against their crc32 (unless ``verify=False``).

        Raises:
            ChecksumError: the bytes do not match (or the record is missing); names the sample.
            ShardCacheError, RemoteStoreError: the shard cannot be fetched.
        """
        import lmdb

        shard, local = self.locate(index)
        lease, meta, key = self._shard(shard, hold=True)
        try:
            with open_resolved(key).begin(buffers=False) as txn:
                data = txn.get(fmt.sample_key(local))
        except lmdb.Error as exc:
            raise fmt.damaged(lease.path, f"LMDB failed reading sample {index}: {exc}") from None
        finally:
            self._let_go(shard)
        if data is None or (self.verify if verify is None else verify):
            problem = None
            if data is None:
                problem = "its record is missing from the shard"
            elif zlib.crc32(data) != int(meta.crc32[local]):
                problem = (f"its bytes fail their checksum (stored crc32 {int(meta.crc32[local]):08x}, "
                           f"the bytes give {zlib.crc32(data):08x})")
            if problem is not None:
                rel = meta.paths[local]
                raise ChecksumError(
                    f"{self.path}: sample {index} ({rel}, in {self.specs[shard].name}): {problem}.\n"
                    f"HINT: run `fastload verify {self.path}`; on_error='skip' skips damaged samples.",
                    index=index, relpath=rel)
        return data
