"""``fastload bench convert``: conversion speed against simply reading the files.

Owns: one side-by-side run, in one process tree, of three passes over the same files with
the same worker pool (``fastload._pool``): read only (``cat``), read + validate — the very
worker function conversion runs per file (``fastload.image.policy:prepare_file``, called
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

from fastload._pool import imap_isolated
from fastload.errors import ConvertError
from fastload.pack.convert import ConvertOptions, convert, validator_options
from fastload.pack.sources import open_source

__all__ = ["bench_convert", "ConvertBench"]


def read_only(path: str, _: object) -> int:
    with open(path, "rb") as f:
        return len(f.read())


#: The worker function ``convert`` runs per file (``pack/convert.py`` uses the same name).
VALIDATE_HANDLER = "fastload.image.policy:prepare_file"


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
