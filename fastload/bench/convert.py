"""``fastload bench convert``: conversion speed against simply reading the files.

Owns: one side-by-side run, in one process tree, of three passes over the same files with
the same worker pool (``fastload.pool``): read only (``cat``), read + validate — the very
worker function conversion runs per file (``fastload.pack.work:prepare_item``, called
by name with conversion's options, so the denominator is whatever validation ``convert``
really does) — and ``convert`` into a temporary store (validation plus writing). A first
unreported read warms the page cache so no pass pays for the disk the others do not.

Must not: assert on timings (it reports them).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastload.pool import imap_isolated
from fastload.errors import ConvertError
from fastload.pack.convert import ConvertOptions, convert, validator_options
from fastload.pack.sources import open_source

__all__ = ["bench_convert", "ConvertBench"]


def read_only(path: str, _: object) -> int:
    with open(path, "rb") as f:
        return len(f.read())


#: The worker function ``convert`` runs per file (``pack/convert.py`` uses the same name).
VALIDATE_HANDLER = "fastload.pack.work:prepare_item"


@dataclass
class ConvertBench:
    files: int
    workers: int
    mbytes: float
    rates: dict[str, float]  # images/s per pass

    def ratios(self) -> dict[str, float]:
        base = self.rates["read+validate"]
        return {k: v / base for k, v in self.rates.items()}

    def table(self) -> str:
        lines = [f"{self.files} files, {self.mbytes:.1f} MB, {self.workers} worker processes",
                 f"{'pass':<14}{'images/s':>10}{'vs read+validate':>18}"]
        for k, v in self.rates.items():
            lines.append(f"{k:<14}{v:>10.0f}{self.ratios()[k]:>17.2f}x")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"files": self.files, "workers": self.workers, "mbytes": self.mbytes,
                "paths": [{"name": k, "images_per_s": v, "ratio": self.ratios()[k]} for k, v in self.rates.items()]}


def _timed_pool(handler: str, init: object, paths: list[str], workers: int) -> float:
    """Files/s of ``handler`` over ``paths`` (a file it rejects counts: conversion skips it too)."""
    t0 = time.perf_counter()
    for _, ok, value in imap_isolated(handler, init, paths, workers):
        if not ok:
            raise ConvertError(f"bench convert: a worker died: {value}")
    return len(paths) / (time.perf_counter() - t0)


def bench_convert(src: str | Path, *, workers: int | None = None) -> ConvertBench:
    """Measure read, read+validate and convert over ``src`` with ``workers`` processes."""
    from fastload.system import available_cpus

    source = open_source(src)
    paths = [source.abspath(rel) for rel, _ in source.items]
    workers = workers or available_cpus()
    mod = __name__
    options = ConvertOptions(workers=workers, progress=False)
    init = validator_options(options, source)
    _timed_pool(f"{mod}:read_only", None, paths, workers)  # warm the page cache
    rates = {"read (cat)": _timed_pool(f"{mod}:read_only", None, paths, workers),
             "read+validate": _timed_pool(VALIDATE_HANDLER, init, paths, workers)}
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
        report = convert(src, Path(tmp) / "store", options)
        rates["convert"] = report.total / report.seconds
    mbytes = sum(Path(p).stat().st_size for p in paths) / 1e6
    return ConvertBench(len(paths), workers, mbytes, rates)


@dataclass
class EngineBench:
    """``bench convert --engine``: images/s of each engine over the same files and shard plan, Ray's
    start-up cost, and (with ``--to``) the object-store upload rate against a local write."""

    files: int
    mbytes: float
    shards: int
    rates: dict[str, float]  # images/s of each engine, start-up included
    ray_startup_s: float | None = None
    upload: dict[str, float] | None = None  # MB/s: "local write", "upload"

    def break_even(self) -> str:
        """How many files make Ray pay on this machine (start-up against its steady rate)."""
        if self.ray_startup_s is None or "ray" not in self.rates or "local" not in self.rates:
            return ""
        steady = self.files / max(1e-9, self.files / self.rates["ray"] - self.ray_startup_s)
        if steady <= self.rates["local"]:
            return (f"ray's steady rate ({steady:.0f} images/s without its {self.ray_startup_s:.1f}s start-up) "
                    f"does not beat local ({self.rates['local']:.0f} images/s) on this machine: it pays only with "
                    "more cores (more nodes) than one machine has")
        n = self.ray_startup_s / (1 / self.rates["local"] - 1 / steady)
        return f"ray pays above about {n:,.0f} files on this machine"

    def table(self) -> str:
        lines = [f"{self.files} files, {self.mbytes:.1f} MB, {self.shards} shards",
                 f"{'engine':<10}{'images/s':>10}"]
        lines += [f"{k:<10}{v:>10.0f}" for k, v in self.rates.items()]
        if self.ray_startup_s is not None:
            lines.append(f"ray start-up (init + first task): {self.ray_startup_s:.1f}s; {self.break_even()}")
        if self.upload:
            lines.append("shard files: " + ", ".join(f"{k} {v:.0f} MB/s" for k, v in self.upload.items()))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"files": self.files, "mbytes": self.mbytes, "shards": self.shards, "images_per_s": self.rates,
                "ray_startup_s": self.ray_startup_s, "break_even": self.break_even(), "upload_mb_per_s": self.upload}


def _ray_startup() -> float:
    """Seconds from nothing to a local cluster that has run one task (then shut down again)."""
    from fastload.pack.ray_engine import import_ray, start_local

    ray = import_ray(local=True)  # loopback only, as `convert --engine ray` starts it
    t0 = time.perf_counter()
    start_local(ray)
    try:
        ray.get(ray.remote(lambda: 1).remote())
        return time.perf_counter() - t0
    finally:
        ray.shutdown()


def bench_engines(src: str | Path, engines: tuple[str, ...] = ("local", "ray"), *, num_shards: int | None = None,
                  workers: int | None = None, to: str | None = None) -> EngineBench:
    """Convert ``src`` with each engine into a temporary sharded store (same plan), then, with ``to``
    (an object-store prefix), upload the shard files there against copying them on the local disk."""
    import os
    import shutil

    from fastload.pack.engines import EngineOptions, convert_sharded
    from fastload.store import remote

    source = open_source(src)
    mbytes = sum(source.sizes()) / 1e6
    shards = num_shards or max(2, min(64, len(source) // 500))
    options = ConvertOptions(workers=workers, progress=False)
    rates: dict[str, float] = {}
    startup = _ray_startup() if "ray" in engines else None
    upload = None
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
        for name in engines:  # each engine starts from nothing: ray's start-up is in its rate
            dst = Path(tmp) / name
            t0 = time.perf_counter()
            convert_sharded(src, dst, options, EngineOptions(engine=name, num_shards=shards))
            rates[name] = len(source) / (time.perf_counter() - t0)
        if to is not None:
            files = sorted(Path(tmp, engines[0]).glob("shard-*/data.mdb"))
            total = sum(f.stat().st_size for f in files) / 1e6
            t0 = time.perf_counter()
            for f in files:
                copy = Path(tmp) / "copy.mdb"
                shutil.copyfile(f, copy)
                with open(copy, "rb") as fh:
                    os.fsync(fh.fileno())
                copy.unlink()
            local = total / (time.perf_counter() - t0)
            base = remote.RemoteLocation.parse(to)
            t0 = time.perf_counter()
            for f in files:
                remote.upload_file(f, base.child(f"bench-{f.parent.name}/data.mdb"))
            up = total / (time.perf_counter() - t0)
            for f in files:
                remote.delete(base.child(f"bench-{f.parent.name}/data.mdb"))
            upload = {"local write": local, "upload": up}
    return EngineBench(len(source), mbytes, shards, rates, startup, upload)
