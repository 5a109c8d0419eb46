"""Sharded conversion on an engine: ``convert_sharded(source, dst, options, engine) -> ConvertReport``.

Owns: the deterministic plan (which source files go to which shard), the engines that run the
one unit of work (``shard.convert_shard(shard, job) -> ShardResult``: validate, write, compact,
publish one shard) — ``local``: shard after shard, each on today's crash-isolated process pool;
``ray``: one plain Ray task per shard, ``max_retries`` — resume, and the plan and manifest,
the manifest written last (after ``samples.json.gz``, every sample's label and path, built by the
driver from what each shard reports, so its bytes do not depend on the engine either).

Guarantees, whatever the engine, worker count or retry history:

* placement is a function of (source listing, options) only: shard ``i`` gets the files
  ``plan[i]`` of the (seeded, optionally shuffled) source order, and its samples are written in
  that order, so the stores are byte-for-byte identical;
* a shard is visible only when complete: local DST by an atomic ``rename`` of a finished
  folder, remote DST by one object upload (S3 shows an object only once it is whole); a
  duplicated or retried attempt publishes the same bytes again;
* a rerun redoes only shards without a published file; on a complete DST (``manifest.json``)
  it does nothing and says so; another source or other options on an existing DST is an
  error naming the difference (``plan.json``, written first, records them).

Must not: convert a shard itself (``shard.py`` does), decode images (``image.policy.prepare``
does, in the pool), or import torch.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import ConvertError
from fastload.pack.convert import ConvertOptions, ConvertReport, _differences, _name_salvaged
from fastload.pack.shard import (HANDLER, ShardJob, ShardResult, ShardSpec, convert_shard, describe_published,
                                 fsync_dir, published)
from fastload.pack.containers import open_any_source
from fastload.pack.sources import Source
from fastload.pack.work import PrepareOptions
from fastload.store import format as fmt
from fastload.store import remote
from fastload.store.manifest import (MANIFEST_NAME, MANIFEST_VERSION, PLAN_NAME, SAMPLES_NAME, SHARD_FILE, Manifest,
                                     ShardEntry, samples_object)

__all__ = ["EngineOptions", "ShardSpec", "ShardJob", "ShardResult", "plan_shards", "convert_shard",
           "convert_sharded", "ENGINES", "parse_size"]

ENGINES = ("local", "ray")
DEFAULT_SHARD_BYTES = 64 << 20  # 64 MiB (67,108,864 bytes): the help and docs say so
_FORWARD_ENV = ("AWS_", "GOOGLE_", "AZURE_")


def parse_size(text: str) -> int:
    """``"64MB"``, ``"512k"``, ``"1GiB"``, ``"1000"`` -> bytes: ``K``/``KB``, ``M``/``MB``, ``G``/``GB`` are
    decimal (``64MB`` = 64,000,000), ``Ki``/``KiB``, ``Mi``/``MiB``, ``Gi``/``GiB`` binary (``64MiB`` = 2**26)."""
    t = text.strip().upper().replace(" ", "")
    units = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
             "KI": 2**10, "KIB": 2**10, "MI": 2**20, "MIB": 2**20, "GI": 2**30, "GIB": 2**30}
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"not a size: {text!r} (examples: 64MB = 64,000,000 bytes, 64MiB = 2**26, 512KB, 1GiB)")
    return int(value * units[unit])


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Where and how shards run.

    Args:
        engine: ``"local"`` (this machine's process pool) or ``"ray"`` (one Ray task per shard).
        address: the Ray cluster (``"auto"``, ``"ray://HOST:PORT"``); None starts a local one.
        num_shards: exactly this many shards (by file count); None sizes them by ``shard_bytes``.
        shard_bytes: target bytes of source files per shard (default 64 MiB, 2**26).
        max_retries: Ray retries of a shard task whose worker died (or whose source read failed).
        scratch: local folder for shards being written (default: the system's temporary folder).
        shared_fs: with ``address``: a local SRC and DST are on a filesystem every node of the cluster
            mounts at the same path. Without it, ``address`` needs object-store URLs for both (a task
            on another machine cannot read this machine's SRC, and would publish into its own DST).
    """

    engine: str = "local"
    address: str | None = None
    num_shards: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    max_retries: int = 3
    scratch: str | None = None
    shared_fs: bool = False

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"Unknown value {self.engine!r} for argument engine. Valid values are "
                             f"{', '.join(ENGINES)}.")
        if self.num_shards is not None and not 1 <= self.num_shards <= 99999:
            raise ValueError(f"num_shards must be in 1..99999, got {self.num_shards}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


def plan_shards(src: Source, order: Sequence[int], sizes: Sequence[int], options: EngineOptions) -> list[ShardSpec]:
    """Split the source order into contiguous shards: ``num_shards`` by count, else by ``shard_bytes``."""
    n = len(order)
    if options.num_shards is not None:
        k = options.num_shards
        bounds = [(i * n) // k for i in range(k + 1)]
    else:
        bounds = [0]
        acc = 0
        for j, i in enumerate(order):
            acc += sizes[i]
            if acc >= options.shard_bytes and j + 1 < n:
                bounds.append(j + 1)
                acc = 0
        bounds.append(n)
        k = len(bounds) - 1
    shards = []
    for s in range(k):
        idx = order[bounds[s]:bounds[s + 1]]
        files = tuple((src.abspath(src.items[i][0]), src.items[i][0], src.items[i][1]) for i in idx)
        shards.append(ShardSpec(s, k, bounds[s], files, int(sum(sizes[i] for i in idx))))
    return shards


# --- the driver --------------------------------------------------------------------------------------

def _forwarded_env() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_FORWARD_ENV)))


def _read_text(dst: str, name: str) -> str | None:
    if remote.is_remote(dst):
        url = remote.RemoteLocation.parse(dst).child(name)
        return remote.get_bytes(url).decode() if remote.head(url) is not None else None
    p = Path(dst) / name
    return p.read_text() if p.is_file() else None


def _write_text(dst: str, name: str, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    if remote.is_remote(dst):
        remote.put_bytes(remote.RemoteLocation.parse(dst).child(name), data)
        return
    Path(dst).mkdir(parents=True, exist_ok=True)
    tmp = Path(dst) / f".{name}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, Path(dst) / name)
    fsync_dir(Path(dst))  # ... and the rename too: a power cut leaves the old state or the new, whole


def _remove_stale_tmp(dst: str) -> None:
    """Delete what a killed driver or task left in a local DST: ``.shard-*.tmp`` folders (a publish cut
    short) and ``.plan.json.tmp`` / ``.manifest.json.tmp``. One driver per DST, so nothing is live."""
    if remote.is_remote(dst) or not Path(dst).is_dir():
        return
    for p in Path(dst).iterdir():
        if p.name.startswith(".shard-") and p.name.endswith(".tmp") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.name in (f".{PLAN_NAME}.tmp", f".{MANIFEST_NAME}.tmp", f".{SAMPLES_NAME}.tmp"):
            p.unlink(missing_ok=True)


def _check_cluster_paths(source: str, dst: str, engine: EngineOptions) -> None:
    """A cluster joined by address may run shards on other machines: local paths need --shared-fs."""
    if engine.engine != "ray" or engine.address is None or engine.shared_fs:
        return
    local = [f"{what} {p}" for what, p in (("SRC", source), ("DST", dst)) if not remote.is_remote(p)]
    if local:
        raise ConvertError(
            f"--address {engine.address}: {' and '.join(local)} "
            f"{'is a local path' if len(local) == 1 else 'are local paths'}, but shard tasks may run on other "
            "machines of the cluster, which cannot read this machine's SRC "
            "and would publish shards into their own DST.\nHINT: use s3:// (gs://, az://) URLs for SRC and DST, "
            "or pass --shared-fs if both are on a filesystem every node mounts at the same path; nothing was "
            "written.")


def _changed_shard(src: Source, order: list[int], shard: ShardSpec, entry: dict) -> str:
    """One line naming a shard whose files changed (size, ETag/last-modified or mtime) since the plan."""
    first, last = shard.files[0][1], shard.files[-1][1]
    return (f"\n  changed: a file of {shard.name} ({first} .. {last}) has another size, ETag or modification "
            "time than when it was planned (overwritten since?)")


def _check_dst_free(dst: str) -> None:
    """A new local DST must be empty or absent (a remote prefix is checked by listing)."""
    if remote.is_remote(dst):
        objects = remote.list_prefix(dst)
        if objects:
            raise ConvertError(f"{dst} already holds {len(objects)} objects (e.g. {objects[0][0]}) but no "
                               f"{PLAN_NAME}.\nHINT: choose an empty prefix for DST; nothing was written.")
        return
    p = Path(dst)
    if p.exists() and (not p.is_dir() or any(p.iterdir())):
        raise ConvertError(f"{dst} exists and is not an empty folder or a sharded fastload store.\n"
                           "HINT: choose a new or empty folder for DST; nothing was written.")


def convert_sharded(source: str | os.PathLike[str], dst: str | os.PathLike[str],
                    options: ConvertOptions = ConvertOptions(), engine: EngineOptions = EngineOptions(),
                    *, handler: str = HANDLER) -> ConvertReport:
    """Convert ``source`` (local or remote) into the sharded store ``dst`` (local or remote) on ``engine``.

    ``handler``: the ``"module:function"`` every file goes through (``work.prepare_item``; tests
    substitute one that crashes).

    Returns:
        The ``ConvertReport`` of the whole store (skipped files named across all shards).

    Raises:
        SourceError: the source is unusable.
        ConvertError: DST holds another conversion (the message names the difference) or a
            shard could not be converted or published.
        RemoteStoreError: an object-store operation failed (names the URL).
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    _check_cluster_paths(str(source), str(dst), engine)
    dst = str(dst).rstrip("/") if remote.is_remote(str(dst)) else str(Path(dst).resolve())
    src = open_any_source(source, exclude=() if remote.is_remote(dst) else (Path(dst),),
                          num_classes=options.num_classes)
    order = np.arange(len(src))
    if options.shuffle:
        order = np.random.default_rng(options.seed).permutation(len(src))
    order = order.tolist()
    sizes = src.sizes()
    shards = plan_shards(src, order, sizes, engine)
    record = dict(options.record_options(), num_shards=len(shards), shard_index=None, placement="contiguous")
    fingerprint = src.fingerprint()
    source_desc = {"kind": src.kind, "path": str(src.path), "classes": src.classes, "fingerprint": fingerprint,
                   "count": len(src)}
    build = {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "source": source_desc, "options": record}
    plan = {"build": build, "shards": [{"name": s.name, "first": s.first, "files": len(s.files),
                                        "fp": src.fingerprint(order[s.first:s.first + len(s.files)])} for s in shards]}
    report = ConvertReport(dst=Path(dst) if not remote.is_remote(dst) else dst, source=str(src.path),  # type: ignore[arg-type]
                           total=len(order), warnings=list(src.warnings))

    _remove_stale_tmp(dst)
    old = _read_text(dst, PLAN_NAME)
    if old is None:
        _check_dst_free(dst)
        _write_text(dst, PLAN_NAME, json.dumps(plan, indent=1, sort_keys=True))
    else:
        have = json.loads(old)
        diff = _differences(have["build"], build, contents=True)
        layout = [{k: v for k, v in e.items() if k != "fp"} for e in have["shards"]]
        if not diff and layout != [{k: v for k, v in e.items() if k != "fp"} for e in plan["shards"]]:
            diff = f"  shards: {len(have['shards'])} planned vs now {len(plan['shards'])}"
        elif "were added, removed or changed" in diff and len(layout) == len(shards):
            diff += "".join(_changed_shard(src, order, s, e) for s, e in zip(shards, have["shards"])
                            if e.get("fp") not in (None, plan["shards"][s.index]["fp"]))
        if diff:
            raise ConvertError(f"{dst} holds a conversion with other inputs:\n{diff}\n"
                               "HINT: rerun with the original source and options to finish it, or choose another DST.")
        done = _read_text(dst, MANIFEST_NAME)
        if done is not None:
            manifest = Manifest.from_json(done, where=f"{dst}/{MANIFEST_NAME}")
            report.already_complete = True
            _fill_from_manifest(report, manifest)
            return report

    job = ShardJob(dst=dst, build=build, classes=tuple(src.classes), source=source_desc,
                   prepare=PrepareOptions.from_convert(options, src), workers=1, scratch=engine.scratch,
                   env=_forwarded_env(), chunk_size=options.chunk_size, handler=handler)
    todo, results = [], {}
    for s in shards:
        if published(dst, s.name):
            results[s.index] = describe_published(dst, s.name, s.index, len(s.files))
        else:
            todo.append(s)
    report.resumed_from = sum(len(shards[i].files) for i in results)
    bar = tqdm(total=len(order), initial=report.resumed_from, unit="img", desc=f"convert {Path(dst).name}",
               disable=not options.progress, dynamic_ncols=True)
    stats = {"shards": len(results), "of": len(shards), "bytes": 0, "retries": 0, "t0": time.monotonic()}

    def progress(files: int, nbytes: int) -> None:
        stats["bytes"] += nbytes
        bar.update(files)
        mbps = stats["bytes"] / 1e6 / max(1e-6, time.monotonic() - stats["t0"])
        bar.set_postfix_str(f"{mbps:.1f} MB/s, shards {stats['shards']}/{stats['of']}, retries {stats['retries']}",
                            refresh=False)

    def shard_done(result: ShardResult) -> None:
        if not remote.is_remote(dst):  # published where this driver sees it? (a task ran on another machine)
            data = Path(dst) / result.name / SHARD_FILE
            if not data.is_file() or data.stat().st_size != result.bytes:
                raise ConvertError(
                    f"{data}: shard {result.name} was reported published, but this machine does not see it "
                    f"({'missing' if not data.is_file() else f'{data.stat().st_size} bytes, not {result.bytes}'}): "
                    "its task ran where DST is another folder.\nHINT: DST must be one filesystem every node mounts at "
                    "the same path (--shared-fs), or use an s3:// (gs://, az://) DST; the manifest was not written.")
        results[result.index] = result
        stats["shards"] += 1
        progress(0, 0)

    try:
        if engine.engine == "local":
            # today's crash-isolated pool, one for every file of every shard; shards written in order
            from fastload.pool import imap_isolated

            payloads = [f[0] for s in todo for f in s.files]
            stream = imap_isolated(job.handler, job.prepare, payloads, options.workers or _cpus())
            base = 0
            try:
                for s in todo:
                    part = ((j - b, ok, v) for b in (base,) for j, ok, v in itertools.islice(stream, len(s.files)))
                    shard_done(convert_shard(s, job, progress, part))
                    base += len(s.files)
            finally:
                stream.close()  # stops the pool's processes now, also on an error or Ctrl-C
        else:
            from fastload.pack.ray_engine import run_on_ray

            run_on_ray(todo, job, engine, progress, shard_done, stats)
    finally:
        bar.close()

    ordered = [results[i] for i in range(len(shards))]
    samples, manifest = _manifest(ordered, src.classes, record, source_desc)
    _write_text(dst, SAMPLES_NAME, samples)  # before the manifest that names it
    _write_text(dst, MANIFEST_NAME, manifest.to_json())  # last: the store is complete from here on
    _fill_from_manifest(report, manifest)
    _name_salvaged(report, f"{dst}/{MANIFEST_NAME} (counts.salvaged)")
    report.seconds = time.perf_counter() - t0
    return report


def _cpus() -> int:
    from fastload.system import available_cpus

    return available_cpus()


def _manifest(results: list[ShardResult], classes: list[str], record: dict, source: dict) -> tuple[bytes, Manifest]:
    """The samples object's bytes and the manifest that names it."""
    entries, start = [], 0
    canon: Counter = Counter()
    reenc: Counter = Counter()
    skipped: list[dict[str, str]] = []
    salvaged: list[dict[str, str]] = []
    decoder_warnings: list[dict[str, Any]] = []
    for r in results:
        entries.append(ShardEntry(r.name, start, r.stored, r.bytes, r.sha256))
        start += r.stored
        h = r.header
        skipped += h["skipped"]
        salvaged += h.get("salvaged", [])  # absent from shards written before it was recorded
        decoder_warnings += h.get("decoder_warnings", [])
        canon.update(h["canonicalised"])
        reenc.update(h.get("reencoded", {}))
    counts = {"stored": start, "total": sum(r.consumed for r in results), "skipped": skipped,
              "canonicalised": dict(sorted(canon.items())), "reencoded": sum(r.header["stored_as"]["reencoded"]
                                                                              for r in results),
              "reencoded_reasons": dict(sorted(reenc.items())),
              "lossy": fmt.lossy_summary(headers=[r.header for r in results]),  # the median of every write
              "bytes": sum(r.header["bytes"] for r in results),
              "salvaged": salvaged, "decoder_warnings": decoder_warnings}
    for r in results:
        if len(r.labels) != r.stored or len(r.paths) != r.stored:
            raise ConvertError(f"{r.name}: {r.stored} samples stored but {len(r.labels)} labels and {len(r.paths)} "
                               "paths reported for it; the manifest was not written.\nHINT: rerun the same command.")
    samples, entry = samples_object([x for r in results for x in r.labels], [p for r in results for p in r.paths])
    return samples, Manifest(MANIFEST_VERSION, tuple(entries), tuple(classes), start, dict(record, source=source),
                             counts, entry)


def _fill_from_manifest(report: ConvertReport, manifest: Manifest) -> None:
    c = manifest.counts
    report.stored = manifest.num_samples
    report.total = c.get("total", report.total)
    report.skipped = list(c.get("skipped", []))
    report.canonicalised = dict(c.get("canonicalised", {}))
    report.reencoded = int(c.get("reencoded", 0))
    report.reencoded_reasons = dict(c.get("reencoded_reasons", {}))
    report.lossy = dict(c.get("lossy", {}))
    report.bytes_stored = int(c.get("bytes", 0))
    report.salvaged = list(c.get("salvaged", []))
    report.decoder_warnings = list(c.get("decoder_warnings", []))
