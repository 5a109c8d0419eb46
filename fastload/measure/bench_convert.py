"""``fastload bench convert``: conversion speed against simply reading the files.

Owns: one side-by-side run, in one process tree, of three passes over the same files with
the same worker pool (``pack._pool``): read only (``cat``), read + full Pillow decode
(the validation floor), and ``convert`` into a temporary store. A first unreported read
warms the page cache so no pass pays for the disk the others do not.

Must not: assert on timings (it reports them).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastload._pool import imap_isolated
from fastload.pack.convert import ConvertOptions, convert
from fastload.pack.sources import open_source

__all__ = ["bench_convert", "ConvertBench"]


def read_only(path: str, _: object) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def read_and_decode(path: str, _: object) -> int:
    from PIL import Image

    with open(path, "rb") as f, Image.open(f) as img:
        img.load()
        return img.width * img.height


@dataclass
class ConvertBench:
    files: int
    workers: int
    mbytes: float
    rates: dict[str, float]  # images/s per pass

    def ratios(self) -> dict[str, float]:
        base = self.rates["read+decode"]
        return {k: v / base for k, v in self.rates.items()}

    def table(self) -> str:
        lines = [f"{self.files} files, {self.mbytes:.1f} MB, {self.workers} worker processes",
                 f"{'pass':<14}{'images/s':>10}{'vs read+decode':>16}"]
        for k, v in self.rates.items():
            lines.append(f"{k:<14}{v:>10.0f}{self.ratios()[k]:>15.2f}x")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"files": self.files, "workers": self.workers, "mbytes": self.mbytes,
                "paths": [{"name": k, "images_per_s": v, "ratio": self.ratios()[k]} for k, v in self.rates.items()]}


def _timed_pool(handler: str, paths: list[str], workers: int) -> float:
    t0 = time.perf_counter()
    for _, ok, value in imap_isolated(handler, None, paths, workers):
        if not ok:
            raise RuntimeError(value)
    return len(paths) / (time.perf_counter() - t0)


def bench_convert(src: str | Path, *, workers: int | None = None) -> ConvertBench:
    """Measure read, read+decode and convert over ``src`` with ``workers`` processes."""
    from fastload.system import available_cpus

    source = open_source(src)
    paths = [source.abspath(rel) for rel, _ in source.items]
    workers = workers or available_cpus()
    mod = __name__
    _timed_pool(f"{mod}:read_only", paths, workers)  # warm the page cache
    rates = {"read (cat)": _timed_pool(f"{mod}:read_only", paths, workers),
             "read+decode": _timed_pool(f"{mod}:read_and_decode", paths, workers)}
    with tempfile.TemporaryDirectory(prefix="fastload-bench-") as tmp:
        report = convert(src, Path(tmp) / "store", ConvertOptions(workers=workers, progress=False))
        rates["convert"] = report.total / report.seconds
    mbytes = sum(Path(p).stat().st_size for p in paths) / 1e6
    return ConvertBench(len(paths), workers, mbytes, rates)
