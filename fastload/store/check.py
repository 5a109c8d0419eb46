"""Checking a store: ``inspect_store`` (what it holds) and ``verify_store`` (re-read everything).

Owns: the tools a user runs on a finished store. Verification re-reads every record in
spawned processes (crash-isolated from the caller), checks checksums and decodes.

Must not: be imported by the hot read path (``reader.py``), or write.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastload.errors import IncompleteStoreError
from fastload.store.reader import StoreReader, load_store_metas

__all__ = ["inspect_store", "verify_store", "VerifyReport", "report_json"]


def inspect_store(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a store holds: counts, classes, bytes, encodings, options, completeness."""
    path = Path(path)
    try:
        metas = load_store_metas(path)
    except IncompleteStoreError as exc:
        return {"path": str(path), "complete": False, "problem": str(exc)}
    labels = np.concatenate([m.labels for m in metas])
    classes = metas[0].classes
    counts = np.bincount(labels, minlength=len(classes)) if len(labels) else np.zeros(len(classes), int)
    total: dict[str, Any] = {"encodings": {}, "stored_as": {}, "canonicalised": {}}
    for m in metas:
        for key in total:
            for k, v in m.header[key].items():
                total[key][k] = total[key].get(k, 0) + v
    return {
        "path": str(path),
        "complete": True,
        "format_version": metas[0].header["version"],
        "count": int(len(labels)),
        "shards": len(metas) if len(metas) > 1 else None,
        "classes": {c: int(n) for c, n in zip(classes, counts)},
        "bytes": int(sum(m.header["bytes"] for m in metas)),
        "skipped": sum(len(m.header["skipped"]) for m in metas),
        "source": metas[0].header["source"],
        "options": metas[0].header["options"] if len(metas) == 1 else
        [m.header["options"] for m in metas],
        **total,
    }


@dataclass
class VerifyReport:
    """The outcome of ``verify_store``: ``failures`` holds ``(index, relpath, reason)``."""

    path: str
    count: int
    failures: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def _verify_range(args: tuple[str, int, int, bool]) -> list[tuple[int, str, str]]:
    path, start, stop, decode = args
    from fastload.image.fast import decode_rgb_fast

    reader = StoreReader(path)
    bad = []
    for i in range(start, stop):
        rel = reader.paths[i]
        try:
            data = reader.get(i)
        except Exception as exc:
            bad.append((i, rel, f"unreadable: {exc}"))
            continue
        if zlib.crc32(data) != int(reader.crc32[i]):
            bad.append((i, rel, f"checksum mismatch (stored crc32 {int(reader.crc32[i]):08x}, "
                                f"bytes give {zlib.crc32(data):08x})"))
            continue
        if decode:
            try:
                decode_rgb_fast(data)
            except Exception as exc:
                bad.append((i, rel, f"decode failed: {exc}"))
    reader.close()
    return bad


def verify_store(path: str | os.PathLike[str], *, decode: bool = True, workers: int | None = None,
                 progress: bool = False) -> VerifyReport:
    """Re-read every record, check its checksum and (by default) decode it.

    Raises:
        StoreError: the path is not a complete store.
    """
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    from fastload.system import available_cpus

    reader = StoreReader(path)
    n = len(reader)
    report = VerifyReport(str(path), n)
    step = 256
    jobs = [(str(path), s, min(n, s + step), decode) for s in range(0, n, step)]
    workers = workers or available_cpus()
    with tqdm(total=n, unit="img", desc="verify", disable=not progress) as bar:
        if workers <= 1 or len(jobs) <= 1:
            results = (_verify_range(j) for j in jobs)
            for job, bad in zip(jobs, results):
                report.failures.extend(bad)
                bar.update(job[2] - job[1])
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                for job, bad in zip(jobs, pool.map(_verify_range, jobs)):
                    report.failures.extend(bad)
                    bar.update(job[2] - job[1])
    report.failures.sort()
    return report


def report_json(report: VerifyReport) -> str:
    return json.dumps({"path": report.path, "count": report.count, "ok": report.ok,
                       "failures": [{"index": i, "relpath": r, "reason": why} for i, r, why in report.failures]},
                      indent=1)
