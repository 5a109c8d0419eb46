"""One shard of a sharded conversion: ``convert_shard(shard, job) -> ShardResult``, the unit every engine runs.

Owns: what a shard task is handed (``ShardSpec``: its files in order; ``ShardJob``: what every
shard shares) and hands back (``ShardResult``), converting one shard (validate and canonicalise
its files in crash-isolated processes, write one complete store in local scratch, compact it into
one ``data.mdb``), publishing it whole (a local DST by an atomic ``rename`` of a finished folder,
a remote one by one upload), and reading back a shard an earlier run published.

Must not: decide placement, run engines or write the plan or manifest (``engines.py`` does),
decode images itself (``image.policy.prepare`` does, in the pool), or import torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.errors import ConvertError, SourceReadError
from fastload.pack.work import PrepareOptions, Prepared, Rejected
from fastload.store import format as fmt
from fastload.store import remote
from fastload.store.cache import sha256_file
from fastload.store.manifest import SHARD_FILE

__all__ = ["ShardSpec", "ShardJob", "ShardResult", "convert_shard", "publish", "published", "describe_published",
           "read_failed", "fsync_dir", "HANDLER"]

HANDLER = "fastload.pack.work:prepare_item"


@dataclass(frozen=True)
class ShardSpec:
    """One shard of the plan: its position, name and files ``(location, relpath, label)`` in order."""

    index: int
    total: int
    first: int  # position of its first file in the source order
    files: tuple[tuple[str, str, int], ...]
    sizes: int = 0

    @property
    def name(self) -> str:
        return fmt.shard_dirname(self.index, self.total)


@dataclass(frozen=True)
class ShardJob:
    """What every shard task shares: where to publish, what to record, how to validate."""

    dst: str
    build: dict[str, Any]
    classes: tuple[str, ...]
    source: dict[str, Any]
    prepare: PrepareOptions
    workers: int = 1
    scratch: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    chunk_size: int = 256
    handler: str = HANDLER  # "module:function" each file goes through (a test substitutes one that crashes)


@dataclass(frozen=True)
class ShardResult:
    """What one published shard holds (the manifest's entry, and the report's counts)."""

    index: int
    name: str
    consumed: int
    stored: int
    bytes: int
    sha256: str
    header: dict[str, Any] = field(repr=False, default_factory=dict)
    published: bool = True  # False: found already published by an earlier run
    labels: list[int] = field(repr=False, default_factory=list)  # per stored sample, for the samples object
    paths: list[str] = field(repr=False, default_factory=list)


def published(dst: str, name: str) -> bool:
    if remote.is_remote(dst):
        return remote.head(remote.RemoteLocation.parse(dst).child(f"{name}/{SHARD_FILE}")) is not None
    return (Path(dst) / name / SHARD_FILE).is_file()


def convert_shard(shard: ShardSpec, job: ShardJob, on_file: Callable[[int, int], None] | None = None,
                  prepared: Iterator[tuple[int, bool, Any]] | None = None) -> ShardResult:
    """Convert one shard and publish it to ``job.dst``; the unit every engine runs.

    Writes a complete store in scratch (its files validated in ``job.workers`` crash-isolated
    processes), compacts it into one ``data.mdb``, then publishes it: an atomic rename into a
    local DST, one upload to a remote one. ``on_file(files, bytes)`` is called as files are done.
    ``prepared``: the shard's files already going through a pool (``(j, ok, value)`` in order, as
    ``pool.imap_isolated`` yields them); by default a pool of ``job.workers`` is started here.

    Raises:
        ConvertError: the shard cannot be written (disk, permissions) or published.
        RemoteStoreError: the upload failed (names the URL).
    """
    import lmdb

    from fastload.pool import imap_isolated
    from fastload.store.writer import StoreWriter

    for k, v in job.env:
        os.environ[k] = v  # the driver's object-store credentials and endpoint, on a cluster worker
    _remove_stale_scratch(job.scratch)
    scratch = Path(tempfile.mkdtemp(prefix=f"fastload-{shard.name}-pid{os.getpid()}-", dir=job.scratch))
    try:
        work = scratch / "work"
        build = dict(job.build, shard={"index": shard.index, "count": shard.total, "first": shard.first,
                                       "files": len(shard.files)})
        chunks: list[fmt.ChunkRecord] = []
        map_size = max(64 << 20, int(shard.sizes * 1.25) + (64 << 20))
        with StoreWriter(work, map_size=map_size, meminit=True) as writer:
            writer.start(build)
            chunk = fmt.ChunkRecord(n=0)
            puts: list[tuple[bytes, bytes]] = []
            stored = 0
            pending_files = pending_bytes = 0
            last = time.monotonic()

            def flush() -> None:
                nonlocal chunk, puts, stored
                if chunk.consumed:
                    writer.commit_chunk(chunk, puts, committed=stored)
                    stored += chunk.stored
                    chunks.append(chunk)
                    chunk, puts = fmt.ChunkRecord(n=chunk.n + 1), []

            payloads = [f[0] for f in shard.files]
            if prepared is None:
                prepared = imap_isolated(job.handler, job.prepare, payloads, job.workers)
            for j, ok, value in prepared:
                _, rel, label = shard.files[j]
                chunk.consumed += 1
                if ok and isinstance(value, Prepared):
                    puts.append((fmt.sample_key(stored + chunk.stored), value.data))
                    chunk.add(label=label, crc32=zlib.crc32(value.data), encoding=value.encoding,
                              stored_as=value.stored_as, reason=value.reason, path=rel, nbytes=len(value.data),
                              psnr=value.psnr)
                    pending_bytes += value.source_bytes
                elif not ok and getattr(value, "io", False):
                    raise read_failed(shard.files[j][0], value, shard.name)
                else:
                    reason = value.reason if isinstance(value, Rejected) else str(value)
                    chunk.skipped.append({"relpath": rel, "reason": reason})
                if ok and isinstance(value, Prepared | Rejected):
                    chunk.note(path=rel, salvaged=getattr(value, "salvaged", None), warnings=value.warnings)
                pending_files += 1
                if chunk.stored >= job.chunk_size:
                    flush()
                if on_file is not None and (time.monotonic() - last > 0.5 or j + 1 == len(payloads)):
                    on_file(pending_files, pending_bytes)
                    pending_files = pending_bytes = 0
                    last = time.monotonic()
            flush()
            header = writer.finalize(build, chunks, classes=list(job.classes), source=job.source)
        packed = scratch / "packed"
        packed.mkdir()
        env = lmdb.open(str(work), readonly=True, lock=False, subdir=True)
        try:
            env.copy(str(packed), compact=True)  # one file, no free pages: the bytes depend on the records only
        finally:
            env.close()
        data = packed / SHARD_FILE
        result = ShardResult(shard.index, shard.name, len(shard.files), header["count"], data.stat().st_size,
                             sha256_file(data), header, labels=[x for c in chunks for x in c.labels],
                             paths=[p for c in chunks for p in c.paths])
        publish(data, job.dst, shard.name)
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def read_failed(location: str, reason: str, shard: str | None = None) -> SourceReadError:
    """A source file that could not be read (I/O, not a bad image): the shard fails, nothing is
    published, and a retry or a rerun reads it again. Recording it as skipped would lose it for good."""
    where = f" (shard {shard} not published)" if shard else ""
    return SourceReadError(f"{location}: reading it failed: {reason}{where}\nHINT: a transient failure "
                           "(throttling, a reset connection, expired credentials, a disk error): fix the cause and "
                           "rerun the same command; published shards are kept, only missing ones are redone.")


def _remove_stale_scratch(folder: str | None) -> None:
    """Delete scratch folders of shard attempts whose process is dead (killed mid-shard: a retry or a
    rerun then starts afresh), so repeated kills do not fill this machine's disk."""
    import re

    base = Path(folder or tempfile.gettempdir())
    for p in base.glob("fastload-shard-*-pid*-*"):
        m = re.search(r"-pid(\d+)-", p.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass  # alive, or not ours to signal: leave it


def publish(data: Path, dst: str, name: str) -> None:
    if remote.is_remote(dst):
        remote.upload_file(data, remote.RemoteLocation.parse(dst).child(f"{name}/{SHARD_FILE}"))
        return
    final = Path(dst) / name
    tmp = Path(dst) / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.mkdir(parents=True)
        shutil.copyfile(data, tmp / SHARD_FILE)
        with open(tmp / SHARD_FILE, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.rename(tmp, final)  # atomic; fails when another attempt published it first (same bytes)
        except OSError:
            if not (final / SHARD_FILE).is_file():
                raise
        fsync_dir(Path(dst))
    except OSError as exc:
        from fastload.store.writer import io_hint

        raise ConvertError(f"{final}: publishing the shard failed: {exc}\n{io_hint(exc, Path(dst))}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def describe_published(dst: str, name: str, index: int, files: int) -> ShardResult:
    """The ``ShardResult`` of a shard an earlier run published (read back: sha256 and header)."""
    from fastload.store.reader import briefly, read_meta, release

    with tempfile.TemporaryDirectory(prefix="fastload-check-") as tmp:
        if remote.is_remote(dst):
            folder = Path(tmp) / name
            folder.mkdir()
            remote.download_file(remote.RemoteLocation.parse(dst).child(f"{name}/{SHARD_FILE}"), folder / SHARD_FILE)
        else:
            folder = Path(dst) / name
        data = folder / SHARD_FILE
        with briefly(folder) as env:
            meta = read_meta(env, folder)
        release(folder)
        return ShardResult(index, name, files, meta.count, data.stat().st_size, sha256_file(data), meta.header,
                           published=False, labels=meta.labels.tolist(), paths=list(meta.paths))


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
