"""Reading a store: the per-process LMDB handle cache and ``StoreReader``.

Owns: opening stores read-only (``readonly=True, lock=False, readahead=False`` by
default), one handle per store per process, reopened after ``fork`` and never pickled;
reading and checking the metadata record (``read_meta``, ``load_store_metas``); and
``StoreReader``, random access to the records of a store or a shard set seen as one index
space.

LMDB forbids using an environment across ``fork()``, and py-lmdb refuses to open one
twice in a process. DataLoader workers fork (or spawn) after the dataset was built in the
parent, so handles live in a per-process table keyed by path and checked against
``os.getpid()``; a reader holds only the key, so it pickles without a handle.

Must not: decode images, write, or start processes (``check.py`` verifies in a pool).
"""

from __future__ import annotations

import bisect
import contextlib
import os
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import ChecksumError, IncompleteStoreError, NotAStoreError, StoreChangedError
from fastload.marks import timed
from fastload.store import format as fmt
from fastload.store.manifest import MANIFEST_NAME, PLAN_NAME
from fastload.store.remote import is_remote

__all__ = ["StoreReader", "open_readonly", "release", "briefly", "forget_stale", "read_meta", "load_store_metas"]

_ENVS: dict[str, tuple[int, Any]] = {}
_ENVS_LOCK = threading.Lock()
_ENV_FILES: dict[str, tuple[int, int] | None] = {}  # (st_dev, st_ino) of each cached store's data.mdb


def _data_file_id(store: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(store, "data.mdb"))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _forget_stale_locked() -> None:
    for key in [k for k, fid in _ENV_FILES.items() if fid is None or _data_file_id(k) != fid]:
        hit = _ENVS.pop(key, None)
        _ENV_FILES.pop(key, None)
        if hit is not None:
            hit[1].close()


def forget_stale() -> None:
    """Close the handles this process keeps on stores deleted or replaced since they were opened.

    py-lmdb refuses a second open of a data file it holds open, and it knows files by device
    and inode: a handle kept on a deleted store can make a NEW store whose data.mdb was given
    the freed inode look "already open in this process". Called before every new open (and by
    the writer); cheap: one stat per cached store.
    """
    with _ENVS_LOCK:
        _forget_stale_locked()


def open_readonly(path: str | os.PathLike[str], *, readahead: bool = False):
    """The process-wide read-only environment of one store (``readonly=True, lock=False``).

    LMDB allows one open of an environment per process (py-lmdb refuses a second), so
    every reader in a process shares one handle per store, opened on first use. Handles
    inherited through ``fork`` belong to the parent and are never used: the child opens
    its own. ``readahead=False`` by default: OS readahead makes random reads of a store
    larger than RAM pull in pages that are never used (docs/store.md, "Readahead"); the first
    open in a process decides it.
    """
    key = os.path.realpath(path)
    hit = _ENVS.get(key)
    if hit is not None and hit[0] == os.getpid():
        return hit[1]
    with _ENVS_LOCK:
        hit = _ENVS.get(key)
        if hit is not None and hit[0] == os.getpid():
            return hit[1]
        if hit is not None:
            # Inherited through fork. py-lmdb still counts it as open in this process and
            # refuses a new open until it is closed; closing the child's copy (lock=False:
            # no lock file, no shared reader slot) leaves the parent's handle untouched.
            hit[1].close()
        _forget_stale_locked()
        env = _lmdb_open(Path(path), readahead)
        _ENVS[key] = (os.getpid(), env)
        _ENV_FILES[key] = _data_file_id(key)
        return env


def open_resolved(key: str):
    """``open_readonly`` of a path already resolved with ``os.path.realpath`` (kept by the caller): one
    dict lookup when this process has the handle, where resolving the path again costs a few ``lstat``
    calls per read (~25 us of the remote reader's warm read, tools/bench_warm_reads.py)."""
    hit = _ENVS.get(key)
    if hit is not None and hit[0] == os.getpid():
        return hit[1]
    return open_readonly(key)


def lock_holder(path: Path) -> str | None:
    """Who is writing the store at ``path`` now ("pid N on HOST, since ..."), or None when no
    live conversion holds its writer lock.

    Read without taking the lock (a reader must never make a writer starting at that moment
    fail): on Linux ``/proc/locks`` lists every held ``flock`` with its inode; elsewhere the
    pid the lock file names is looked up when it names this host.
    """
    import re
    import socket

    lock = Path(path) / fmt.LOCK_NAME
    try:
        ino = os.stat(lock).st_ino
        owner = lock.read_text("utf-8", "replace").strip()
    except OSError:
        return None
    if not owner:
        return None  # emptied when its writer closed cleanly
    try:
        held = Path("/proc/locks").read_text()
    except OSError:
        held = None
    if held is not None:  # "1: FLOCK  ADVISORY  WRITE 1234 08:01:56789 0 EOF" (waiters have "->")
        for line in held.splitlines():
            f = line.split()
            # FLOCK, or POSIX where a file system (NFS) emulates flock with fcntl locks
            if len(f) >= 6 and f[1] in ("FLOCK", "POSIX") and f[3] == "WRITE" and f[5].rsplit(":", 1)[-1] == str(ino):
                return owner
        return None
    m = re.match(r"pid (\d+) on (\S+),", owner)
    if m is None or m.group(2) != socket.gethostname():
        return None
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return owner


def release(path: str | os.PathLike[str]) -> None:
    """Close this process's read handle on ``path`` (before writing to it); reopened on next use."""
    with _ENVS_LOCK:
        hit = _ENVS.pop(os.path.realpath(path), None)
        _ENV_FILES.pop(os.path.realpath(path), None)
    if hit is not None and hit[0] == os.getpid():
        hit[1].close()


@contextlib.contextmanager
def briefly(path: str | os.PathLike[str]) -> Iterator[Any]:
    """This process's shared handle if it has one, else a handle closed again on exit."""
    hit = _ENVS.get(os.path.realpath(path))
    if hit is not None and hit[0] == os.getpid():
        yield hit[1]
        return
    forget_stale()
    env = _lmdb_open(Path(path), False)
    try:
        yield env
    finally:
        env.close()


_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def _holds_images(path: Path, look: int = 200) -> bool:
    """Whether a folder looks like an image folder: an image file in it or in one of its first sub-folders
    (at most ``look`` entries read: a hint, never a scan of a large tree)."""
    seen = 0
    try:
        for entry in path.iterdir():
            entries = entry.iterdir() if entry.is_dir() else iter((entry,))
            for f in entries:
                seen += 1
                if f.suffix.lower() in _IMAGE_SUFFIXES:
                    return True
                if seen >= look:
                    return False
    except OSError:  # unreadable: no opinion
        pass
    return False


def _lmdb_open(path: Path, readahead: bool):
    import lmdb

    if not path.exists():
        raise NotAStoreError(f"{path} does not exist.\nHINT: create a store with `fastload convert SRC {path}`.")
    if not fmt.is_store_dir(path):
        if path.is_dir() and _holds_images(path):  # the image folder itself: the store goes beside it
            store = path.with_name(path.name + ".lmdb")
            hint = (f"{path} looks like the image folder itself: pack it into a store beside it with "
                    f"`fastload convert {path} {store}` and read {store}.")
        else:
            hint = f"create one with `fastload convert SRC {path}` (SRC: your image folder, not {path})."
        raise NotAStoreError(f"{path} is not a fastload store (no data.mdb inside).\nHINT: {hint}")
    check_data_file(path)
    try:
        return lmdb.open(str(path), readonly=True, lock=False, readahead=readahead,
                         max_readers=2048, subdir=True, meminit=False, max_spare_txns=2)
    except lmdb.Error as exc:
        raise fmt.damaged(path, f"LMDB cannot open it ({exc})") from exc


_MDB_MAGIC = 0xBEEFC0DE


def check_data_file(path: Path) -> None:
    """Refuse a ``data.mdb`` shorter than its own LMDB meta pages say, before anything maps it.

    Reading a memory map past the end of its file kills the process with SIGBUS, so an
    interrupted copy (rsync, cp) must be caught here. LMDB keeps two meta pages at the
    start of the file (the newer one, by transaction id, is current); each records the page
    size (in the free database's ``md_pad``) and the last page in use (``mm_last_pg``).
    Layout: ``lmdb.h``/``mdb.c`` ``MDB_meta`` after the 16-byte page header, 64-bit build.
    """
    import struct

    data_file = path / "data.mdb"
    try:
        size = data_file.stat().st_size
        with open(data_file, "rb") as f:
            head = f.read(16 + 152)
            metas = []
            if len(head) >= 16 + 152:
                page = struct.unpack_from("<I", head, 16 + 24)[0]  # mm_dbs[FREE_DBI].md_pad = page size
                f.seek(page if 512 <= page <= 1 << 16 else 4096)
                second = f.read(16 + 152)
                for blob in (head, second):
                    if len(blob) < 16 + 152:
                        continue
                    magic, _version = struct.unpack_from("<II", blob, 16)
                    psize = struct.unpack_from("<I", blob, 16 + 24)[0]
                    last_pg, txnid = struct.unpack_from("<QQ", blob, 16 + 24 + 96)
                    if magic == _MDB_MAGIC:
                        metas.append((txnid, last_pg, psize))
    except OSError as exc:
        raise NotAStoreError(f"{path}: cannot read {data_file.name}: {exc}") from exc
    if size == 0:
        raise fmt.damaged(path, "its data.mdb is empty (0 bytes): the copy or conversion never wrote it")
    if not metas:
        raise fmt.damaged(path, f"its data.mdb ({size:,} bytes) has no valid LMDB header: it is not an LMDB "
                                "file, or its first pages were overwritten")
    _txnid, last_pg, psize = max(metas)
    need = (last_pg + 1) * psize
    if size < need:
        raise fmt.damaged(path, f"its data.mdb is {size:,} bytes but its LMDB header says the data fills "
                                f"{need:,} bytes: the file was cut short (an interrupted copy?); "
                                f"{need - size:,} bytes are missing")


def _file_id(data_file: str) -> tuple[int, int, int, int] | None:
    """What says data.mdb is still the file that was opened: device, inode, size, mtime (ns)."""
    try:
        st = os.stat(data_file)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_meta(env, path: Path) -> fmt.StoreMeta:
    """Read and check the metadata of an open store; raise a clear error if it is unusable."""
    import lmdb

    try:
        with env.begin(buffers=False) as txn:
            raw = txn.get(fmt.META_KEY)
            if raw is None:
                build = txn.get(fmt.BUILD_KEY)
                if build is None:
                    raise NotAStoreError(f"{path} is an LMDB environment but not a fastload store (no ~meta record).")
                done = 0
                for k, v in txn.cursor():
                    if k.startswith(fmt.CHUNK_PREFIX):
                        try:
                            done += fmt.ChunkRecord.from_bytes(v).stored
                        except (ValueError, TypeError):
                            raise fmt.damaged(path, "one of its chunk records is unreadable") from None
                writer = lock_holder(path)
                if writer is not None:
                    raise IncompleteStoreError(
                        f"{path} is being written: its conversion ({writer}) is still running, "
                        f"{done} samples so far; the metadata record comes last.\nHINT: wait for that "
                        "`fastload convert` to finish, then open the store."
                    )
                raise IncompleteStoreError(
                    f"{path} is incomplete: its conversion stopped after {done} samples and never "
                    "wrote the metadata record.\nHINT: rerun the same `fastload convert` command to "
                    "resume it; it continues where it stopped."
                )
            check = txn.get(fmt.META_CHECK_KEY)
            blobs = {name: txn.get(fmt.array_key(name)) for name in fmt.META_ARRAYS}
            blobs["paths"] = txn.get(fmt.PATHS_KEY)
    except lmdb.Error as exc:
        raise fmt.damaged(path, f"LMDB reports {exc}") from None
    return fmt.parse_meta(path, raw, check, blobs)


def _local_path(path: object) -> None:
    """A store path given as a string that looks like a URL is never read as a local folder."""
    if isinstance(path, str) and is_remote(path):  # an unsupported URL raises, naming the schemes
        raise NotAStoreError(f"{path}: a store in object storage is not read in place.\nHINT: read it with "
                             "LMDBImageDataset (or `fastload inspect`/`verify` URL), through the node shard cache.")


def load_store_metas(path: str | os.PathLike[str]) -> list[fmt.StoreMeta]:
    """Metadata of the store at ``path``: one entry, or one per shard of a shard directory."""
    _local_path(path)
    path = Path(path)
    if (path / PLAN_NAME).is_file() and not (path / MANIFEST_NAME).is_file():
        raise IncompleteStoreError(
            f"{path}: a sharded conversion that has not finished (no {MANIFEST_NAME}).\nHINT: rerun the same "
            "`fastload convert` command: it converts only the shards that are missing, then writes the manifest.")
    shards = [] if fmt.is_store_dir(path) else fmt.find_shards(path)
    if shards:
        fmt.check_shard_set(path, shards)
    metas = []
    for p in shards or [path]:
        with briefly(p) as env:  # constructors open nothing that outlives them
            metas.append(read_meta(env, p))
    if len(metas) > 1:
        first = metas[0]
        for m in metas[1:]:
            same_source = m.header["source"]["fingerprint"] == first.header["source"]["fingerprint"]
            if m.classes != first.classes or not same_source:
                raise NotAStoreError(
                    f"{path}: {m.path.name} was converted from a different source than {first.path.name}.")
    return metas


class StoreReader:
    """Random access to the records of a store or shard set, safe across fork and pickling.

    Args:
        path: a store or a directory of its shards.
        readahead: OS readahead on the memory map (off: see ``open_readonly``).
        verify: check every record read against its crc32 (default; ``fastload bench decode``
            times it against the decode, in its ``crc32`` row); turn it off only where
            something else already checksums the data.

    Raises:
        NotAStoreError, IncompleteStoreError, StoreVersionError, StoreDamagedError: the
            path is not a complete, intact store (checked when constructed).
    """

    def __init__(self, path: str | os.PathLike[str], *, readahead: bool = False, verify: bool = True) -> None:
        _local_path(path)
        self.path = Path(path)
        self.verify = verify
        self.metas = load_store_metas(self.path)
        self.readahead = readahead
        self.offsets = np.cumsum([0] + [m.count for m in self.metas]).tolist()
        self.classes = self.metas[0].classes
        self.labels = np.concatenate([m.labels for m in self.metas]).astype(np.int64)
        self.paths = [p for m in self.metas for p in m.paths]
        self.crc32 = np.concatenate([m.crc32 for m in self.metas])
        self.encoding = np.concatenate([m.encoding for m in self.metas])
        self._keys = [os.path.realpath(m.path) for m in self.metas]
        self._data_files = [os.path.join(k, "data.mdb") for k in self._keys]
        self._file_ids = [_file_id(f) for f in self._data_files]  # travels with the reader into workers

    def __len__(self) -> int:
        return self.offsets[-1]

    shard_ordered = False  #: ``readers.Reader``: random reads are cheap (the store is on this machine)

    @property
    def shard_sizes(self) -> list[int]:
        """Samples per shard, in store order (one entry for a single store)."""
        return [m.count for m in self.metas]

    def sample_index(self) -> tuple[list[int], list[str]]:
        """Every label and relative path (read with the metadata)."""
        return self.labels.tolist(), self.paths

    def prefetch_shards(self, shards: list[int]) -> None:
        """Nothing to fetch: the shards are on this machine."""

    def _env(self, shard: int):
        hit = _ENVS.get(self._keys[shard])  # hot path: one dict lookup per read
        if hit is not None and hit[0] == os.getpid():
            return hit[1]
        return open_readonly(self.metas[shard].path, readahead=self.readahead)

    def close(self) -> None:
        """Close this process's handles on the store (they reopen on next use)."""
        for m in self.metas:
            release(m.path)

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard, index within shard)`` of a global index."""
        if not 0 <= index < len(self):
            raise IndexError(f"{self.path}: index {index} out of range for {len(self)} samples")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def label(self, index: int) -> int:
        return int(self.labels[index])

    def relpath(self, index: int) -> str:
        return self.paths[index]

    @timed("read")
    def get(self, index: int, *, verify: bool | None = None) -> bytes:
        """The stored bytes of sample ``index``, checked against their crc32 (unless ``verify=False``).

        Raises:
            ChecksumError: the bytes do not match (or the record is missing); names the sample.
            StoreDamagedError: LMDB reports the store's pages as corrupt.
        """
        import lmdb

        shard, local = self.locate(index)
        self._check_unchanged(shard, index)
        try:
            with self._env(shard).begin(buffers=False) as txn:
                data = txn.get(fmt.sample_key(local))
        except lmdb.Error as exc:
            raise fmt.damaged(self.path, f"LMDB failed reading sample {index} ({self.paths[index]}): {exc}") from None
        if data is None or (self.verify if verify is None else verify):
            problem = self.checksum_problem(index, data)
            if problem is not None:
                raise ChecksumError(self._bad(index, problem), index=index, relpath=self.paths[index])
        return data

    def _check_unchanged(self, shard: int, index: int) -> None:
        """Raise ``StoreChangedError`` when the shard's data.mdb is no longer the file this reader
        opened: one ``os.stat`` per read (docs/resume-compat.md has its cost), before the read.

        LMDB reads through a memory map: a data.mdb cut short in place turns the next read past
        its new end into SIGBUS, which kills the process (no Python handler can run); one
        replaced by another file is read stale through the old map. What cannot be guarded: a
        truncation between this check and the read (microseconds) still ends in SIGBUS.
        """
        now = _file_id(self._data_files[shard])
        was = self._file_ids[shard]
        if now == was:
            return
        if now is None:
            what = "it was deleted"
        elif now[:2] != was[:2]:
            what = "another file was put in its place (new inode)"
        elif now[2] != was[2]:
            what = f"its size changed from {was[2]:,} to {now[2]:,} bytes"
        else:
            what = "it was rewritten (its modification time changed)"
        release(self.metas[shard].path)  # never read through the old map again
        raise StoreChangedError(
            f"{self.metas[shard].path}: its data.mdb changed while it was being read ({what}); sample {index} "
            f"({self.paths[index]}) was not read.\nHINT: a store must not be rewritten or copied over while a job "
            "reads it: write the new one to another path, then point the job at it (a new dataset object).")

    def checksum_problem(self, index: int, data: bytes | None) -> str | None:
        """What is wrong with ``data`` as record ``index`` (missing, or not its stored crc32), or None."""
        if data is None:
            return "its record is missing from the store"
        got = zlib.crc32(data)
        if got != int(self.crc32[index]):
            return (f"its bytes fail their checksum (checksum mismatch: stored crc32 {int(self.crc32[index]):08x}, "
                    f"the bytes give {got:08x})")
        return None

    def _bad(self, index: int, what: str) -> str:
        return (f"{self.path}: sample {index} ({self.paths[index]}): {what}: the store is damaged.\n"
                f"HINT: run `fastload verify {self.path}` to list every damaged sample; on_error='skip' "
                "skips them; convert the source again to repair the store.")


