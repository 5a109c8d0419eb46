"""The train preset's ways of making a batch, side by side in a loader (--compare layout|slot|plan).

Planar against channels-last batches, or (``--compare slot``) the preset writing straight into the
thread pipeline's batch slot against the pipeline copying it there, or (``--compare plan``) the
thread pipeline planning runs of samples before rendering them against one sample at a time.

    python tools/channels_last_ab.py STORE [--workers 2] [--batch-size 64] [--batches 30] [--rounds 6]
                                         [--backends threads,processes] [--compare layout|slot|plan]

Per backend, two arms read the same store with the same seed, so the same samples in the
same batches with the same crops: ``train_transform(224)`` and ``train_transform(224,
channels_last=True)``, each in ``fastload.DataLoader(..., collate_fn=collate_uint8)``. Both
hand out the same ``uint8`` values (checked on the first batches before timing): one as
contiguous NCHW, one as ``torch.channels_last``. That is a GPU host's case: the batch is
copied to the device, where either layout is converted for the model in microseconds; on the
CPU the channels-last arm skips the resize kernel's planar scatter.

``--compare plan`` (per backend and layout): the train preset as shipped, whose ``plan`` and
``render`` let the thread pipeline's tasks and the worker processes' batches read and draw a run
of samples (``dataset.PLAN_RUN``) before they decode and resize them, against the same preset
without them (a subclass), each sample read, drawn, decoded and resized in turn. Same batches,
checked first; ratios planned/one by one.

``--compare slot`` (thread backend): per layout, the train preset as shipped, which resizes an
unflipped image straight into its slot of the batch buffer (``from_bytes(..., out=slot)``),
against the same preset without ``out=`` (a subclass), whose every image the pipeline copies
into its slot. Same batches, checked first; ratios slot/copied.

Discipline as ``fastload bench loader``: every arm's loader is built fresh in each round and
its iterator shut down before the next arm runs (worker processes joined, threads stopped), round ``k`` runs the
arms rotated by ``k`` places (``measure.rounds.interleave``), 4 untimed batches first.
Prints images/s per arm (median and min-max), the CPU time per image of the process tree over
the timed batches (this process and its worker processes, psutil: less moved by a noisy
neighbour than images/s), and the per-round ratios channels-last/planar of both.

Must not: be imported by the package (a tool, run by hand). Asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--backends", default="threads,processes")
    ap.add_argument("--compare", choices=("layout", "slot", "plan"), default="layout")
    args = ap.parse_args()

    import psutil
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import TrainTransform, collate_uint8, train_transform
    from fastload.measure.rounds import interleave
    from fastload.measure.stages import shutdown

    def epochs(loader):  # batches across epochs, as a training loop takes them
        while True:
            yield from loader

    # one dataset, its reader shared (LMDB opens a store once per process); each arm a copy with its preset
    base = LMDBImageDataset(args.store)

    class Copied(TrainTransform):
        """The train preset without ``out=``: the thread pipeline copies each image into its slot."""

        def from_bytes(self, data, generator=None):
            return super().from_bytes(data, generator)

    class Unplanned(TrainTransform):
        """The train preset without ``plan``/``render``: the thread pipeline takes each sample in turn."""

        plan = None
        render = None

    def make(backend: str, channels_last: bool, variant: bool = True) -> DataLoader:
        ds = copy.copy(base)
        other = Unplanned if args.compare == "plan" else Copied
        ds.transform = (train_transform if variant else other)(args.size, channels_last=channels_last)
        # persistent workers: epochs follow one another in the timed batches, the same processes measured
        return DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, backend=backend,
                          collate_fn=collate_uint8, generator=torch.Generator().manual_seed(0), drop_last=True,
                          persistent_workers=backend == "processes" and args.workers > 0)

    backends = ["threads"] if args.compare == "slot" else args.backends.split(",")
    # pairs of arms: (backend, channels_last, shipped preset); the second of each pair is compared to the first
    if args.compare != "layout":
        pairs = [((b, cl, False), (b, cl, True)) for b in backends for cl in (False, True)]
    else:
        pairs = [((b, False, True), (b, True, True)) for b in backends]
    for arm_a, arm_b in pairs:  # the same values in both arms of a pair
        la, lb = make(*arm_a), make(*arm_b)
        a, b = epochs(la), epochs(lb)
        for (x, lx), (y, ly) in itertools.islice(zip(a, b), 2):
            assert torch.equal(x, y) and torch.equal(lx, ly), "the two arms must hand out the same batches"
            assert x.is_contiguous(memory_format=torch.channels_last if arm_a[1] else torch.contiguous_format)
            assert y.is_contiguous(memory_format=torch.channels_last if arm_b[1] else torch.contiguous_format)
        for loader, it in ((la, a), (lb, b)):  # threads stopped (the epoch's iterator closed), workers joined
            it.close()
            shutdown(loader)

    me = psutil.Process()

    def cpu(procs: list) -> dict:  # per process; one that ended (a short-lived helper) is left out
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[p.pid] = t.user + t.system
        return out

    def measure(arm: tuple[str, bool, bool], _round: int) -> tuple[float, float]:
        threads = torch.get_num_threads()  # fastload.DataLoader lowers them while it iterates
        loader = make(*arm)
        it = epochs(loader)
        try:
            for _ in range(4):
                next(it)
            procs = [me, *me.children(recursive=True)]
            n, t0, c0 = 0, time.perf_counter(), cpu(procs)
            for images, _labels in itertools.islice(it, args.batches):
                n += len(images)
            rate, c1 = n / (time.perf_counter() - t0), cpu(procs)
            return rate, sum(c1[p] - c0[p] for p in c1 if p in c0) / n * 1e6
        finally:
            it.close()  # the thread iterator inside closes with it
            shutdown(loader)  # persistent worker processes joined now, not at garbage collection
            torch.set_num_threads(threads)

    arms = [arm for pair in pairs for arm in pair]
    res = interleave(arms, args.rounds, measure)
    print(f"{args.store}: batch {args.batch_size}, {args.workers} workers, {args.size}px, uint8 batches, "
          f"{args.rounds} interleaved rounds x {args.batches} batches")
    print(f"{'arm':<44}{'images/s':>10}{'min-max':>16}{'CPU us/image':>14}{'min-max':>12}")

    def med(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    labels = {"layout": ("", ""), "slot": (", copied", ", into the slot"), "plan": (", one by one", ", planned")}

    def name(arm: tuple[str, bool, bool]) -> str:
        backend, cl, shipped = arm
        return f"{backend}, {'channels-last' if cl else 'planar (NCHW)'}{labels[args.compare][shipped]}"

    for arm, got in res.items():
        rate, us = [v[0] for v in got.values], [v[1] for v in got.values]
        print(f"{name(arm):<44}{med(rate):>10.0f}{f'{min(rate):.0f}-{max(rate):.0f}':>16}{med(us):>14.0f}"
              f"{f'{min(us):.0f}-{max(us):.0f}':>12}")
    for arm_a, arm_b in pairs:
        rounds = list(zip(res[arm_b].values, res[arm_a].values))
        r = sorted(c[0] / p[0] for c, p in rounds)
        u = sorted(c[1] / p[1] for c, p in rounds if p[1] > 0) or [float("nan")]  # a run too short for CPU ticks
        what = ("channels-last / planar" if args.compare == "layout" else
                f"{'channels-last' if arm_a[1] else 'planar'}:{labels[args.compare][1][1:]} /"
                f"{labels[args.compare][0][1:]}")
        print(f"{arm_a[0]}: {what} per round: images/s {med(r):.3f} ({r[0]:.3f}-{r[-1]:.3f}), "
              f"CPU per image {med(u):.3f} ({u[0]:.3f}-{u[-1]:.3f})")


if __name__ == "__main__":
    main()
