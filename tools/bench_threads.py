"""Thread pipeline vs worker processes: images/s and peak memory of the process tree, side by side.

    python tools/bench_threads.py [DATA] [--workers 2] [--batch-size 64] [--rounds 5] [--rate IMG_PER_S]

DATA is a fastload store or an image folder (packed to a temporary store first); without it,
the generated default dataset. Both paths do the same work to the same output:
``LMDBImageDataset(store, transform=train_transform(size))`` read by ``fastload.DataLoader``
(``backend="processes"`` with ``collate_uint8``, or ``backend="threads"``), batches of
``batch_size`` normalised to float32 on the CPU by ``DevicePrefetcher(loader, "cpu")``.

Discipline (issue #17): every timed segment starts its own loader (workers or threads start
during the untimed warm-up) and shuts it down afterwards, so no path's prefetching steals CPU
from the next; the order of the paths rotates between rounds; per-round ratios are reported
with their spread.

Memory: while a segment runs, a sampler sums RSS and PSS over this process and all its
children (psutil) every 0.1 s; the peaks are reported. RSS counts pages shared between worker
processes (the torch libraries) once per process; PSS splits them, so its sum is the tree's
real footprint. ``--rate`` makes the consumer take at most that many images/s, so both paths
can be compared at the same throughput (pick a rate both reach).

Prints a table; ``--json PATH`` also writes the rounds. Asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from fastload.datasets import ensure_default_dataset
from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.prefetch import DevicePrefetcher
from fastload.load.transforms import collate_uint8, train_transform

PATHS = ("processes", "threads")


class TreeMemory:
    """Peak summed RSS and PSS of this process and its descendants, sampled in a thread."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval, self.peak_rss, self.peak_pss = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)

    def sample(self) -> None:
        me = psutil.Process()
        rss = pss = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def make_loader(path: str, store: Path, a: argparse.Namespace) -> DevicePrefetcher:
    ds = LMDBImageDataset(store, transform=train_transform(a.image_size))
    loader = DataLoader(ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, drop_last=True,
                        collate_fn=collate_uint8, pin_memory=False, backend=path)
    return DevicePrefetcher(loader, "cpu")


def segment(path: str, store: Path, a: argparse.Namespace) -> dict:
    """One timed run of one path on a freshly started loader, shut down before returning."""
    loader = make_loader(path, store, a)
    with TreeMemory() as mem:
        it = _forever(loader)
        for _ in range(a.warmup):
            next(it)
        n, t0 = 0, time.perf_counter()
        for _ in range(a.batches):
            images, _labels = next(it)
            n += len(images)
            if a.rate:  # a consumer that takes at most `rate` images/s (a simulated training step)
                time.sleep(max(0.0, t0 + n / a.rate - time.perf_counter()))
        elapsed = time.perf_counter() - t0
        it.close()  # ends the epoch's iterator: worker processes / threads shut down
        del it, loader
    return {"images_per_s": n / elapsed, "peak_rss_mb": mem.peak_rss / 1e6, "peak_pss_mb": mem.peak_pss / 1e6}


def _forever(loader):
    while True:
        yield from loader


def resolve_store(data: str | None, tmp: Path) -> Path:
    from fastload.pack.convert import ConvertOptions, convert

    src = Path(data) if data else ensure_default_dataset(progress=True)
    if (src / "data.mdb").exists() or any(src.glob("*/data.mdb")):
        return src
    store = tmp / "store.lmdb"
    convert(src, store, ConvertOptions(progress=True))
    return store


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", nargs="?",
                    help="a fastload store or an image folder (default: the generated default dataset)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes / threads for both paths")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--batches", type=int, default=30, help="timed batches per path per round")
    ap.add_argument("--warmup", type=int, default=4, help="untimed batches per segment (loader start-up)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rate", type=float, default=0.0, help="consume at most this many images/s (0: no limit)")
    ap.add_argument("--json", type=Path, help="also write the rounds here")
    a = ap.parse_args(argv)
    if a.workers < 1 or a.batch_size < 1 or a.batches < 1 or a.rounds < 1 or a.warmup < 0 or a.rate < 0:
        ap.error("need --workers >= 1, --batch-size >= 1, --batches >= 1, --rounds >= 1, --warmup >= 0, --rate >= 0")
    with tempfile.TemporaryDirectory(prefix="fastload-bench-threads-") as tmp:
        store = resolve_store(a.data, Path(tmp))
        rounds: list[dict[str, dict]] = []
        for r in range(a.rounds):
            order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
            rounds.append({p: segment(p, store, a) for p in order})
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(
                f"{p} {rounds[-1][p]['images_per_s']:.0f} img/s" for p in PATHS), file=sys.stderr)
    ratios = [rd["threads"]["images_per_s"] / rd["processes"]["images_per_s"] for rd in rounds]
    print(f"store {store.name}, {a.workers} workers/threads, batch {a.batch_size}, {a.image_size}px, "
          f"{a.batches} batches x {a.rounds} rounds, rate limit {a.rate or 'none'}; torch {torch.__version__}, "
          f"{psutil.cpu_count()} CPUs")
    print(f"{'path':<10} {'img/s (median)':>15} {'peak RSS tree MB':>17} {'peak PSS tree MB':>17}")
    for p in PATHS:
        speed = statistics.median(rd[p]["images_per_s"] for rd in rounds)
        rss, pss = (max(rd[p][k] for rd in rounds) for k in ("peak_rss_mb", "peak_pss_mb"))
        print(f"{p:<10} {speed:>15.0f} {rss:>17.0f} {pss:>17.0f}")
    print(f"threads / processes: {statistics.median(ratios):.2f}x (per round {min(ratios):.2f}-{max(ratios):.2f}x)")
    if a.json:
        a.json.write_text(json.dumps({"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in
                                                  vars(a).items()}, "rounds": rounds, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
