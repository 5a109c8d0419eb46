"""Worker processes with reused batch memory against a fresh segment per batch, interleaved rounds.

    python tools/bench_batch_memory.py IMAGE_FOLDER STORE [--rounds 5] [--float] [--channels-last]

``fastload bench loader``'s ``fastload`` path (the ``fast`` stage: ``fastload.DataLoader`` with worker
processes, ``collate_uint8``, ``train_transform``; ``--float``: normalised by ``DevicePrefetcher`` on the
CPU), built once with ``reuse_batch_memory=False`` (``fresh``: torch's way, a new shared-memory segment
per batch) and once with the default ``True`` (``reuse``: ``fastload/load/batch_pool.py``), the two
alternating in rotated order, each round starting its own workers. The batches are the same bit for bit
(``tests/load/test_batch_pool.py``). Prints each round's images/s and the per-round ratio reuse / fresh
(median and range).

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import fastload.load.loader as loader_mod
from fastload.bench.loader import LoaderBenchOptions, _stage_path, _time, running
from fastload.measure.rounds import interleave
from fastload.measure.stages import StageData


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--float", action="store_true", help="normalised float32 batches (default: uint8)")
    ap.add_argument("--channels-last", action="store_true")
    args = ap.parse_args()
    o = LoaderBenchOptions(paths=("fastload",), uint8=not args.float, rounds=args.rounds,
                           channels_last=args.channels_last)
    build = _stage_path("fast", StageData(args.data, args.store), o)
    reuse = {"on": True}
    init = loader_mod.DataLoader.__init__

    def with_reuse(self, *a, **k):  # the stage builds its loader with the default; the arm decides
        k.setdefault("reuse_batch_memory", reuse["on"])
        init(self, *a, **k)

    loader_mod.DataLoader.__init__ = with_reuse

    def measure(arm: str, k: int) -> float:
        reuse["on"] = arm == "reuse"
        with running(build()) as loader:
            v = _time(loader, o.warmup, o.batches, None, o.channels_last)
        print(f"round {k}: {arm:<6} {v:7.0f} images/s", flush=True)
        return v

    arms = interleave(["fresh", "reuse"], o.rounds, measure)
    fresh, pooled = arms["fresh"].values, arms["reuse"].values
    ratios = sorted(b / a for a, b in zip(fresh, pooled))
    out = "normalised float32" if args.float else "uint8"
    print(f"{o.workers} workers, batch {o.batch_size}, {o.batches} batches a round, {out} batches"
          f"{', channels-last' if args.channels_last else ''}: fresh {statistics.median(fresh):.0f}, "
          f"reuse {statistics.median(pooled):.0f} images/s (medians); reuse / fresh per round "
          f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
