"""Worker processes' batch memory, two ways against each other in interleaved rounds.

    python tools/bench_batch_memory.py IMAGE_FOLDER STORE [--rounds 5] [--float] [--channels-last]
                                       [--compare reuse|render]

``fastload bench loader``'s ``fastload`` path (the ``fast`` stage: ``fastload.DataLoader`` with worker
processes, ``collate_uint8``, ``train_transform``; ``--float``: normalised by ``DevicePrefetcher`` on the
CPU), built once per arm, the two arms alternating in rotated order, each round starting its own workers.

* ``--compare reuse`` (default): ``reuse_batch_memory=False`` (``fresh``: torch's way, a new shared-memory
  segment per batch) against the default ``True`` (``reuse``: ``fastload/load/batch_pool.py``).
* ``--compare render``: both reuse their segments; ``stack``: each image made as a tensor of its own, then
  stacked into the segment (``PlannedBatch.layout`` made to say None, as before the worker rendered into
  the batch), against ``render``: the preset writes each image straight into its slot
  (``PlannedBatch.write_into``). The workers are forked, so they see the arm's setting.

The batches are the same bit for bit (``tests/load/test_batch_pool.py``). Prints each round's images/s and
the per-round ratio of the second arm over the first (median and range).

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch.multiprocessing as mp

import fastload.load.loader as loader_mod
from fastload.bench.loader import LoaderBenchOptions, _stage_path, _time, running
from fastload.load.dataset import PlannedBatch
from fastload.measure.rounds import interleave
from fastload.measure.stages import StageData

ARMS = {"reuse": ("fresh", "reuse"), "render": ("stack", "render")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("store", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--float", action="store_true", help="normalised float32 batches (default: uint8)")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--compare", choices=sorted(ARMS), default="reuse")
    args = ap.parse_args()
    if args.compare == "render" and mp.get_start_method() != "fork":
        raise SystemExit("--compare render sets the arm in this process: it needs forked workers")
    o = LoaderBenchOptions(paths=("fastload",), uint8=not args.float, rounds=args.rounds,
                           channels_last=args.channels_last)
    build = _stage_path("fast", StageData(args.data, args.store), o)
    first, second = ARMS[args.compare]
    arm_now = {"arm": second}
    init, layout = loader_mod.DataLoader.__init__, PlannedBatch.layout

    def arm_init(self, *a, **k):  # the stage builds its loader with the default; the arm decides
        k.setdefault("reuse_batch_memory", arm_now["arm"] != "fresh")
        init(self, *a, **k)

    def arm_layout(self):
        return None if arm_now["arm"] == "stack" else layout(self)

    loader_mod.DataLoader.__init__ = arm_init
    PlannedBatch.layout = arm_layout

    def measure(arm: str, k: int) -> float:
        arm_now["arm"] = arm
        with running(build()) as loader:
            v = _time(loader, o.warmup, o.batches, None, o.channels_last)
        print(f"round {k}: {arm:<6} {v:7.0f} images/s", flush=True)
        return v

    arms = interleave([first, second], o.rounds, measure)
    a, b = arms[first].values, arms[second].values
    ratios = sorted(y / x for x, y in zip(a, b))
    out = "normalised float32" if args.float else "uint8"
    print(f"{o.workers} workers, batch {o.batch_size}, {o.batches} batches a round, {out} batches"
          f"{', channels-last' if args.channels_last else ''}: {first} {statistics.median(a):.0f}, "
          f"{second} {statistics.median(b):.0f} images/s (medians); {second} / {first} per round "
          f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
