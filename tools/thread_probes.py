"""Four probes of the thread pipeline's per-image cost, each side by side in interleaved rounds.

    python tools/thread_probes.py STORE steps   [--rounds 6]
    python tools/thread_probes.py STORE crc     [--rounds 6]   # needs: pip install zlib-ng isal
    python tools/thread_probes.py STORE threads [--rounds 6] [--counts 2,3,4]
    python tools/thread_probes.py STORE runs    [--rounds 6] [--counts 1,4,8,16]

``steps``: one thread, the same records and per-sample seeds, five loops, the first four adding one
step each to the last: the train preset on bytes already in memory; + the store read (LMDB, the
changed-store check, crc32); + the copy into a batch buffer; ``dataset.getitem`` in place of
the read and the preset; and what a thread task of the pipeline does per sample (runs of
``PLAN_RUN`` samples planned, then each rendered into its batch slot, copied only where the preset
cannot write there). Prints µs per image per loop, and per round the preset's time over each loop's:
the share of the preset's own rate (``bench loader``'s one-core ceiling) a loader could reach that
did nothing beyond that loop, no pool, batching or hand-over.

``crc``: the per-sample loop (``getitem`` into a batch slot, seeded per sample) in one and in two
threads, with the store reader's crc32 from zlib (shipped), zlib-ng and isal (the same CRC-32,
checked first; an arm whose package is missing is left out). Prints images/s and the per-round
ratios against zlib.

``threads``: ``fastload.DataLoader(..., backend="threads", collate_fn=collate_uint8)`` with each
thread count of ``--counts``, ``uint8`` batches of 64, 10 batches per arm after 2 untimed ones,
fresh loader per arm. Prints images/s, the process's CPU per image, and ratios to the first count.

``runs``: the per-sample work in one and in two threads (no pool around it), each thread taking
its samples in runs of each size of ``--counts``: the run's records read and crops drawn back to
back (``dataset.plan``), then each decoded and resized into a batch slot (``dataset.render``),
as the pipeline's tasks do with ``PLAN_RUN``; against each sample planned and rendered in turn
(``getitem``). Prints images/s and per-round ratios to ``getitem``.

Must not: be imported by the package (a tool, run by hand). Asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import types


def _med(v: list[float]) -> str:
    return f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"


def _ratio(a: list[float], b: list[float]) -> str:
    r = sorted(x / y for x, y in zip(a, b))
    return f"{statistics.median(r):.3f} ({r[0]:.3f}-{r[-1]:.3f})"


def plan_then_render(ds, indices, gen, buf) -> None:
    """What a thread task of the pipeline does for a run of samples: each planned (``dataset.plan``: the record
    read, its draws from ``gen(i)``), then each rendered into its slot of ``buf`` (``dataset.render``), copied
    only where the preset could not write there. Index ``i`` is record ``i % len(ds)``, slot ``i % len(buf)``.
    Also used by ``tools/bench_ceiling.py``."""
    n = len(ds)
    planned = [(i, ds.plan(i % n, gen(i))) for i in indices]
    for i, p in planned:
        slot = buf[i % len(buf)]
        image, _ = ds.render(i % n, p, out=slot)
        if image.data_ptr() != slot.data_ptr():
            slot.copy_(image)


def steps(store: str, rounds: int) -> None:
    import torch

    from fastload.load.dataset import PLAN_RUN, LMDBImageDataset
    from fastload.load.replay import mix_seed
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(store, transform=train_transform(224))
    n, tf, reader = len(ds), ds.transform, ds.reader
    blobs = [ds.get_bytes(i) for i in range(n)]
    buf = torch.empty(64, 3, 224, 224, dtype=torch.uint8)

    def gen(i: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix_seed(1, 0, i))

    # each loop drops its images as it goes (a list of them would cost a fresh, page-faulted tensor per image)
    def preset() -> None:
        for i in range(n):
            tf.from_bytes(blobs[i], gen(i))

    def read() -> None:
        for i in range(n):
            tf.from_bytes(reader.get(i), gen(i))

    def copy() -> None:
        for i in range(n):
            buf[i % 64].copy_(tf.from_bytes(reader.get(i), gen(i)))

    def getitem() -> None:
        for i in range(n):
            buf[i % 64].copy_(ds.getitem(i, generator=gen(i))[0])

    def planned() -> None:  # what a thread task of the pipeline does: runs of PLAN_RUN planned, then rendered
        for start in range(0, n, PLAN_RUN):
            plan_then_render(ds, range(start, min(start + PLAN_RUN, n)), gen, buf)

    loops = {"preset on bytes in memory": preset, "+ store read": read, "+ copy into the batch": copy,
             "getitem, copied": getitem, "the pipeline's per-sample work": planned}
    names = list(loops)
    res: dict[str, list[float]] = {k: [] for k in names}
    torch.set_num_threads(1)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            loops[name]()
            res[name].append((time.perf_counter() - t0) / n * 1e6)
    print(f"{store}: one thread, {n} records, {rounds} rounds (loop order rotated); us per image, median (min-max); "
          "per round, the preset's time over the loop's (the share of the preset's own rate the loop reaches)")
    first = res[names[0]]
    for name in names:
        print(f"{name:<32} {_med(res[name])}  {_ratio(first, res[name])}")


def _sample_loop(ds, n_threads: int, count: int) -> float:
    import torch

    from fastload.load.replay import mix_seed

    n = len(ds)

    def work(k: int) -> None:
        buf = torch.empty(64, 3, 224, 224, dtype=torch.uint8)
        for i in range(k, count, n_threads):
            slot = buf[i % 64]
            image, _ = ds.getitem(i % n, generator=torch.Generator().manual_seed(mix_seed(1, 0, i)), out=slot)
            if image.data_ptr() != slot.data_ptr():
                slot.copy_(image)

    ts = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return count / (time.perf_counter() - t0)


def crc(store: str, rounds: int) -> None:
    import os
    import zlib

    import torch

    import fastload.store.reader as reader_module
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    impl = {"zlib": zlib}
    try:
        from zlib_ng import zlib_ng
        impl["zlib-ng"] = types.SimpleNamespace(crc32=zlib_ng.crc32)
    except ImportError:
        print("zlib-ng not installed: left out")
    try:
        from isal import isal_zlib
        impl["isal"] = types.SimpleNamespace(crc32=isal_zlib.crc32)
    except ImportError:
        print("isal not installed: left out")
    probe = os.urandom(36_000)
    for name, m in impl.items():
        assert m.crc32(probe) == zlib.crc32(probe), f"{name} computes another checksum"
    torch.set_num_threads(1)
    ds = LMDBImageDataset(store, transform=train_transform(224))
    names = list(impl)
    res: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                reader_module.zlib = impl[name]
                for k in (1, 2):
                    res.setdefault((name, k), []).append(_sample_loop(ds, k, 400 * k))
    finally:
        reader_module.zlib = zlib
    print(f"{store}: the per-sample loop (getitem into a batch slot), {rounds} rounds; images/s, and per round "
          "against zlib")
    for k in (1, 2):
        for name in names:
            print(f"{k} thread(s), {name:<8} {_med(res[(name, k)])}  x{_ratio(res[(name, k)], res[('zlib', k)])}")


def threads(store: str, rounds: int, counts: list[int]) -> None:
    import psutil
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import collate_uint8, train_transform

    me = psutil.Process()
    rate: dict[int, list[float]] = {c: [] for c in counts}
    cpu: dict[int, list[float]] = {c: [] for c in counts}
    for r in range(rounds):
        for c in counts[r % len(counts):] + counts[:r % len(counts)]:
            ds = LMDBImageDataset(store, transform=train_transform(224))
            it = iter(DataLoader(ds, batch_size=64, shuffle=True, num_workers=c, backend="threads",
                                 collate_fn=collate_uint8, generator=torch.Generator().manual_seed(r), drop_last=True))
            next(it)
            next(it)
            t0, c0, n = time.perf_counter(), me.cpu_times(), 0
            for images, _ in it:
                n += len(images)
                if n >= 640:
                    break
            dt, c1 = time.perf_counter() - t0, me.cpu_times()
            it.close()
            rate[c].append(n / dt)
            cpu[c].append((c1.user - c0.user + c1.system - c0.system) / n * 1e6)
    print(f"{store}: thread loader, uint8 batches of 64, {rounds} rounds (order rotated), 10 batches per arm")
    for c in counts:
        print(f"{c} threads: {_med(rate[c])} images/s, CPU {_med(cpu[c])} us/image, images/s x"
              f"{_ratio(rate[c], rate[counts[0]])} of {counts[0]} threads")


def runs(store: str, rounds: int, sizes: list[int]) -> None:
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.replay import mix_seed
    from fastload.load.transforms import train_transform

    torch.set_num_threads(1)
    ds = LMDBImageDataset(store, transform=train_transform(224))
    n = len(ds)

    def gen(i: int) -> torch.Generator:
        return torch.Generator().manual_seed(mix_seed(1, 0, i))

    def work(size: int, lo: int, hi: int) -> None:
        buf = torch.empty(64, 3, 224, 224, dtype=torch.uint8)
        for start in range(lo, hi, max(1, size)):
            run = range(start, min(start + max(1, size), hi))
            if size == 0:  # getitem: each sample read, drawn, decoded and resized in turn
                for i in run:
                    slot = buf[i % 64]
                    image, _ = ds.getitem(i % n, generator=gen(i), out=slot)
                    if image.data_ptr() != slot.data_ptr():
                        slot.copy_(image)
                continue
            plan_then_render(ds, run, gen, buf)

    arms = [0, *sizes]
    res: dict[tuple[int, int], list[float]] = {}
    for r in range(rounds):
        for size in arms[r % len(arms):] + arms[:r % len(arms)]:
            for k in (1, 2):
                count = 384
                ts = [threading.Thread(target=work, args=(size, j * count, (j + 1) * count)) for j in range(k)]
                t0 = time.perf_counter()
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                res.setdefault((size, k), []).append(k * count / (time.perf_counter() - t0))
    print(f"{store}: the per-sample work, {rounds} rounds (order rotated); images/s, and per round against getitem")
    for k in (1, 2):
        for size in arms:
            name = "getitem (one by one)" if size == 0 else f"runs of {size}"
            print(f"{k} thread(s), {name:<21} {_med(res[(size, k)])}  x{_ratio(res[(size, k)], res[(0, k)])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("probe", choices=("steps", "crc", "threads", "runs"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--counts", help="thread counts (threads; default 2,3,4) or run sizes (runs; default 1,4,8,16)")
    args = ap.parse_args()
    if args.probe == "steps":
        steps(args.store, args.rounds)
    elif args.probe == "crc":
        crc(args.store, args.rounds)
    elif args.probe == "threads":
        threads(args.store, args.rounds, [int(c) for c in (args.counts or "2,3,4").split(",")])
    else:
        runs(args.store, args.rounds, [int(c) for c in (args.counts or "1,4,8,16").split(",")])


if __name__ == "__main__":
    main()
