"""Writing a store: open for writing, commit chunks, read the resume state, finalise.

Owns: the write side of the on-disk contract (``format.py``). ``StoreWriter`` opens (or
creates) one store directory, refuses one that is not a store, commits each chunk of
samples with its ``ChunkRecord`` in one transaction (doubling the LMDB map whenever it is
full), reads back what earlier runs committed so a conversion can resume, and writes the
metadata record **last**, in the same transaction that deletes the chunk records: a store
without it is incomplete for every reader, never silently short.

Errors that come from the disk (full, read-only, a file-size limit) become
``ConvertError`` with a HINT saying which, and that rerunning resumes. One writer per
store: a ``flock`` on ``.fastload-writer.lock`` (``StoreLockedError`` names the holder).

Must not: read sources, decode images, or know about torch.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import ConvertError, StoreLockedError
from fastload.store import format as fmt
from fastload.store.reader import forget_stale, release

__all__ = ["StoreWriter", "ResumeState", "STORE_FILES", "LOCK_NAME"]

log = logging.getLogger("fastload")

#: Files a store directory may hold besides dot-files (``report.json`` is the conversion's report).
STORE_FILES = frozenset({"data.mdb", "lock.mdb", "report.json"})


def io_hint(exc: BaseException, path: Path) -> str:
    """A HINT line for an I/O failure: full disk, file-size limit, or an unwritable folder."""
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS) or "ermission" in text or "ead-only" in text:
        return "HINT: the folder is not writable: fix its permissions or choose another DST."
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO) or any(
            w in text for w in ("space", "too large", "Input/output")):
        # LMDB reports a short write (disk full, file-size limit) as EIO.
        import resource
        import shutil

        where = []
        try:
            where.append(f"{shutil.disk_usage(path).free / 1e6:,.0f} MB free on its filesystem")
        except OSError:
            pass
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            where.append(f"a file-size limit (ulimit -f) of {limit:,} bytes")
        return ("HINT: the disk (or a file-size limit) is full" + (f" ({'; '.join(where)})" if where else "")
                + ": free space, then rerun the same command to resume.")
    return "HINT: rerun the same command to resume once the cause is fixed."


LOCK_NAME = fmt.LOCK_NAME


def _take_lock(path: Path) -> int:
    """Hold ``path/.fastload-writer.lock`` (``flock``) for this conversion, or refuse at once.

    The kernel releases a ``flock`` when its process dies, so a lock left by a killed run is
    free: it is taken over with a message naming the dead owner. The file holds the owner's
    pid, host and start time, for the message the next writer prints.
    """
    import fcntl
    import socket
    import time

    lock = path / LOCK_NAME
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        raise ConvertError(f"cannot create the writer lock {lock}: {exc}\n{io_hint(exc, path)}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise StoreLockedError(
            f"{path} is being written by another conversion ({owner}).\nHINT: wait for it to finish, or stop "
            "it; rerunning the same command afterwards resumes where it stopped.") from None
    previous = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if previous:
        log.warning("%s: taking over the writer lock of a conversion that did not finish (%s); resuming its work",
                    path, previous)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
              .encode(), 0)
    return fd


@dataclass
class ResumeState:
    """What a store directory already holds: the finished header, the build record, the chunks."""

    meta: dict[str, Any] | None
    build: dict[str, Any] | None
    chunks: list[fmt.ChunkRecord]


class StoreWriter:
    """The one writer of one store directory (a context manager; ``close()`` releases it).

    Args:
        path: the store directory (created if missing).
        map_size: the first LMDB map size in bytes; it doubles whenever it is full.
        meminit: zero new pages before use (LMDB's ``MDB_NOMEMINIT`` off). Sharded conversion
            needs it: without it, unused parts of pages hold whatever memory held, and two runs
            of the same shard differ in those bytes.

    Raises:
        ConvertError: ``path`` is a file, a folder that is not a store, or cannot be opened
            for writing (the message says why and what to do).
    """

    def __init__(self, path: Path, *, map_size: int, meminit: bool = False) -> None:
        import lmdb

        self.path = path
        self._lock_fd: int | None = None
        if path.exists() and not path.is_dir():
            raise ConvertError(f"{path} exists and is a file; DST must be a new or empty folder or a fastload store.")
        if path.is_dir():
            foreign = [p.name for p in path.iterdir() if p.name not in STORE_FILES and not p.name.startswith(".")]
            if foreign and not fmt.is_store_dir(path):
                raise ConvertError(
                    f"{path} exists and is not a fastload store (it holds {', '.join(sorted(foreign)[:3])}...).\n"
                    "HINT: DST must be a new or empty folder; nothing was written."
                )
        release(path)  # a read handle of this process on DST would refuse the writer
        forget_stale()  # and so would one on a deleted store whose freed inode DST's data.mdb reuses
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConvertError(f"cannot create {path}: {exc}\n{io_hint(exc, path)}") from exc
        self._lock_fd = _take_lock(path)
        try:
            self.env = lmdb.open(str(path), map_size=map_size, subdir=True, readonly=False, lock=True,
                                 sync=True, metasync=True, meminit=meminit, max_dbs=0)
        except (OSError, lmdb.Error) as exc:
            self._unlock()
            raise ConvertError(f"cannot open {path} for writing: {exc}\n{io_hint(exc, path)}") from exc

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.env.close()
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)  # empty = released cleanly (a non-empty free lock is stale)
            except OSError:
                pass
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def commit(self, puts: list[tuple[bytes, bytes]], deletes: list[bytes] = (), *, committed: int) -> None:
        """Write one transaction, doubling the map as often as needed.

        ``committed`` (samples already in the store) only goes into the error message.
        """
        import lmdb

        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in puts:
                        txn.put(k, v)
                    for k in deletes:
                        txn.delete(k)
                self._pad_to_last_page()
                return
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.Error as exc:
                raise ConvertError(
                    f"{self.path}: writing failed after {committed} committed samples: {exc}. Everything "
                    f"committed is kept.\n{io_hint(exc, self.path)}"
                ) from exc

    def _pad_to_last_page(self) -> None:
        """Make ``data.mdb`` as long as its meta page says, so readers' truncation check passes.

        LMDB does not write pages freed within the transaction that allocated them ("loose"
        pages, ``mdb_page_flush`` skips them), so a committed file can end a page or more
        short of ``(last_pgno + 1) * psize``. Those pages are free and never read, but a
        reader cannot tell them from a copy cut short (``reader.check_data_file``, which
        prevents SIGBUS), so the writer fills them with zeros. Seen after a SIGKILL and
        resume: a complete store one page short.
        """
        need = (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"]
        data = self.path / "data.mdb"
        if data.stat().st_size < need:
            os.truncate(data, need)

    def resume_state(self) -> ResumeState:
        """What earlier runs committed here."""
        with self.env.begin() as txn:
            meta = txn.get(fmt.META_KEY)
            build = txn.get(fmt.BUILD_KEY)
            chunks = [fmt.ChunkRecord.from_bytes(v) for k, v in txn.cursor() if k.startswith(fmt.CHUNK_PREFIX)]
            has_samples = txn.get(fmt.sample_key(0)) is not None
        if meta is None and build is None and has_samples:
            raise ConvertError(f"{self.path} is an LMDB environment that fastload did not write; choose another DST.")
        chunks.sort(key=lambda c: c.n)
        return ResumeState(json.loads(meta) if meta else None, json.loads(build) if build else None, chunks)

    def start(self, build: dict[str, Any]) -> None:
        """Write the build record (first transaction of a new conversion)."""
        self.commit([(fmt.BUILD_KEY, json.dumps(build, sort_keys=True).encode())], committed=0)

    def commit_chunk(self, chunk: fmt.ChunkRecord, samples: list[tuple[bytes, bytes]], *, committed: int) -> None:
        """The chunk's samples and its record, in one transaction."""
        self.commit(samples + [(fmt.chunk_key(chunk.n), chunk.to_bytes())], committed=committed)

    def finalize(self, build: dict[str, Any], chunks: list[fmt.ChunkRecord], *, classes: list[str],
                 source: dict[str, Any]) -> dict[str, Any]:
        """Write the metadata record and drop the chunk records, in one transaction; returns the header."""
        chunks = sorted(chunks, key=lambda c: c.n)
        labels = np.array([x for c in chunks for x in c.labels], dtype=np.int64)
        crc = np.array([x for c in chunks for x in c.crc32], dtype=np.uint32)
        enc = np.array([fmt.ENCODINGS.index(x) for c in chunks for x in c.encoding], dtype=np.uint8)
        stored_as = np.array([fmt.STORED_AS.index(x) for c in chunks for x in c.stored_as], dtype=np.uint8)
        paths = [p for c in chunks for p in c.paths]
        reasons = Counter(r for c in chunks for r, s in zip(c.reasons, c.stored_as) if s == "canonicalised")
        reencoded = Counter(r for c in chunks for r, s in zip(c.reasons, c.stored_as) if s == "reencoded")
        psnr = np.array([p for c in chunks for p in c.psnr], dtype=np.float64)
        header = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.FORMAT_VERSION,
            "count": len(labels),
            "classes": classes,
            "source": source,
            "options": build["options"],
            "skipped": [s for c in chunks for s in c.skipped],
            "canonicalised": dict(sorted(reasons.items())),
            "reencoded": dict(sorted(reencoded.items())),
            # every record fastload encoded lossily (JPEG): how close it is to the pixels it encodes
            "lossy": fmt.lossy_summary(psnr),
            "encodings": {name: int((enc == i).sum()) for i, name in enumerate(fmt.ENCODINGS)},
            "stored_as": {name: int((stored_as == i).sum()) for i, name in enumerate(fmt.STORED_AS)},
            "bytes": int(sum(c.bytes for c in chunks)),
            # per file, from every run that wrote a chunk (a resume included); absent in older headers
            "salvaged": [x for c in chunks for x in c.salvaged],
            "decoder_warnings": [x for c in chunks for x in c.decoder_warnings],
        }
        puts = fmt.meta_records(header, {"labels": labels, "crc32": crc, "encoding": enc, "stored_as": stored_as},
                                paths)
        deletes = [fmt.chunk_key(c.n) for c in chunks] + [fmt.BUILD_KEY]
        self.commit(puts, deletes, committed=len(labels))
        return json.loads(dict(puts)[fmt.META_KEY])
