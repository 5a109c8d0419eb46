"""Is `bench loader`'s ceiling reachable? One core's decode+crop loop, alone and two at once.

    python tools/bench_ceiling.py [STORE] [--rounds 2] [--seconds 4] [--size 224]
    python tools/bench_ceiling.py [STORE] --crop-samples 4 [--rounds 4] [--seconds 1]

`fastload bench loader` reports each path as a share of a ceiling: one core's tight
``train_transform(size).from_bytes`` loop (``single_core_ceiling``) times the workers (with
float batches, plus normalising each image: ``Floors.ceiling_per_core``). That
is only a fair ceiling if the cores do not slow each other down (shared caches, memory
bandwidth, turbo clocks); since 2026-12-07 the bench measures the loop in as many processes at
once as it has workers in every round and holds the paths to that (``PresetProcesses``,
``Floors.ceiling``). This runs the same loop in one process alone, then in two
processes at once, then in two threads of one process (the thread pipeline's situation:
the decoders release the GIL), in rounds, and prints each as a share of twice the lone
figure. Then it prints the store's two floors per core and normalisation per batch
(``store_floors``: decode alone at the DCT scale or region the preset uses, the preset's
whole per-image work, their ratio per round), the figures ``bench loader`` reports every
path against. Each round also times the thread pipeline's per-sample work without the
pipeline around it (runs of samples read from the store with seeded draws, then rendered into
batch slots) in one thread and in two, and then the thread loader itself (2 threads, ``uint8``
batches), so the loader can be put against its own floor and the GIL's share seen apart from the
pipeline's. STORE defaults to a temporary store of the generated default dataset.

``--crop-samples SEEDS`` runs something else: the preset floor's loop on the store's first 256 records
(the floors' sample before) and on the floors' crops now (``floor_crops``: the store's first records,
cycled to 2,048 crops), with the crops of seeds 0..SEEDS-1, interleaved: the preset's cost moves with
its crops, and a floor measured on too few of them is a ceiling set by luck.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path


def _alone(store: str, size: int, seconds: float, out) -> None:
    from fastload.bench.loader import single_core_ceiling

    out.put(single_core_ceiling(Path(store), size, seconds))


def _two_threads(store: str, size: int, seconds: float) -> float:
    import torch

    from fastload.bench.loader import floor_records
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    torch.set_num_threads(1)
    ds = LMDBImageDataset(store)
    tf = train_transform(size)
    blobs = floor_records(ds)
    for b in blobs[:16]:
        tf.from_bytes(b)
    counts = [0, 0]

    def work(k: int) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for b in blobs[k::2]:
                tf.from_bytes(b)
            counts[k] += len(blobs[k::2])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def _sample_loop(store: str, size: int, seconds: float, n_threads: int) -> float:
    """Images/s of the thread pipeline's per-sample work alone, in ``n_threads`` threads, as its tasks do it:
    runs of ``PLAN_RUN`` samples, each read from the store (crc32 checked) with its crop drawn from its
    own seeded generator (``dataset.plan``), then each decoded, resized and written into a batch
    buffer's slot (``dataset.render(..., out=slot)``, copied when flipped), with no pool, queue or batch
    hand-over around it."""
    import torch

    from fastload.load.dataset import PLAN_RUN, LMDBImageDataset
    from fastload.load.replay import mix_seed
    from fastload.load.transforms import train_transform
    from thread_probes import plan_then_render  # tools/, the script's own folder

    torch.set_num_threads(1)
    ds = LMDBImageDataset(store, transform=train_transform(size))
    counts = [0] * n_threads

    def work(k: int) -> None:
        buf = torch.empty(64, 3, size, size, dtype=torch.uint8)
        start = k * PLAN_RUN
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            run = range(start, start + PLAN_RUN)
            plan_then_render(ds, run, lambda i: torch.Generator().manual_seed(mix_seed(1, 0, i)), buf)
            counts[k] += len(run)
            start += n_threads * PLAN_RUN

    work_threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    t0 = time.perf_counter()
    for t in work_threads:
        t.start()
    for t in work_threads:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def _thread_loader(store: str, size: int, seconds: float) -> float:
    """Images/s of ``fastload.DataLoader(..., backend="threads", num_workers=2)`` itself on the same store
    (batch 64, ``collate_uint8``), 2 batches of warm-up, then batches for ``seconds``."""
    import torch

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import collate_uint8, train_transform

    ds = LMDBImageDataset(store, transform=train_transform(size))
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, backend="threads", collate_fn=collate_uint8,
                        generator=torch.Generator().manual_seed(0), drop_last=True)
    n, t0, warm = 0, 0.0, 2
    while True:
        it = iter(loader)
        for images, _ in it:
            if warm:
                warm -= 1
                t0 = time.perf_counter()
                continue
            n += len(images)
            if time.perf_counter() - t0 >= seconds:
                it.close()
                return n / (time.perf_counter() - t0)


def _crop_samples(store: str, size: int, seconds: float, rounds: int, seeds: int) -> None:
    """The preset floor's loop on the first 256 records (the floors' sample before) and on the floors' crops
    now (``floor_crops(floor_records(...))``), each with crops drawn from seeds 0..seeds-1, interleaved rounds:
    how far one sample of crops moves the floor."""
    import statistics

    import torch

    from fastload.bench.loader import floor_crops, floor_records, preset_passes
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    torch.set_num_threads(1)
    ds = LMDBImageDataset(store)
    tf = train_transform(size)
    records = floor_records(ds)
    wide = floor_crops(records)
    samples = {"first 256 records": records[:256], f"the floors' {len(wide)} crops": wide}
    g = torch.Generator()
    for b in wide[:16]:
        tf.from_bytes(b, g)

    def loop(blobs: list[bytes], seed: int) -> float:  # each pass draws the same crops
        n, t0, t1 = preset_passes(tf, blobs, g, seconds, seed)
        return (t1 - t0) / n * 1e6

    arms = [(name, seed) for name in samples for seed in range(seeds)]
    us: dict[tuple[str, int], list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        for name, seed in arms[r % len(arms):] + arms[:r % len(arms)]:
            us[(name, seed)].append(loop(samples[name], seed))
    print(f"{store}: the preset's whole work (train_transform({size}).from_bytes), one thread, us per image, "
          f"median (min-max) of {rounds} rounds, arms rotated")
    for name in samples:
        meds = [statistics.median(us[(name, s)]) for s in range(seeds)]
        for s in range(seeds):
            v = us[(name, s)]
            print(f"  {name:26s} crops of seed {s}: {meds[s]:6.0f} ({min(v):.0f}-{max(v):.0f})")
        print(f"  {name:26s} across seeds: {min(meds):.0f}-{max(meds):.0f} ({max(meds) / min(meds) - 1:.1%} apart)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--crop-samples", type=int, metavar="SEEDS", default=0,
                    help="instead: the preset floor's loop on the first 256 records and on the floors' records, "
                         "crops from seeds 0..SEEDS-1, to see how far one sample of crops moves the floor")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = args.store
        if store is None:
            from fastload.datasets import ensure_default_dataset
            from fastload.pack.convert import ConvertOptions, convert

            store = str(Path(tmp) / "store.lmdb")
            convert(ensure_default_dataset(), store, ConvertOptions(progress=False))
        if args.crop_samples:
            _crop_samples(store, args.size, args.seconds, args.rounds, args.crop_samples)
            return
        ctx = mp.get_context("spawn")
        for r in range(args.rounds):
            q = ctx.Queue()
            p = ctx.Process(target=_alone, args=(store, args.size, args.seconds, q))
            p.start()
            one = q.get()
            p.join()
            ps = [ctx.Process(target=_alone, args=(store, args.size, args.seconds, q)) for _ in range(2)]
            for p in ps:
                p.start()
            two = [q.get(), q.get()]
            for p in ps:
                p.join()
            th = _two_threads(store, args.size, args.seconds)
            print(f"round {r + 1}: one process alone {one:.0f} images/s; two processes at once "
                  f"{two[0]:.0f} + {two[1]:.0f} = {sum(two):.0f} ({sum(two) / (2 * one):.0%} of 2x alone); "
                  f"two threads of one process {th:.0f} ({th / (2 * one):.0%})")
            s1, s2 = (_sample_loop(store, args.size, args.seconds, k) for k in (1, 2))
            loader = _thread_loader(store, args.size, args.seconds)
            print(f"         the thread pipeline's per-sample work (runs planned, rendered into batch slots): "
                  f"one thread {s1:.0f} images/s ({s1 / one:.0%} of the preset alone), two threads {s2:.0f} "
                  f"({s2 / (2 * s1):.0%} of 2x one thread, {s2 / sum(two):.0%} of two processes at once); the thread "
                  f"loader (2 threads, uint8 batches of 64) {loader:.0f} ({loader / s2:.0%} of the two threads' "
                  f"per-sample work, {loader / sum(two):.0%} of two processes at once)")
        from fastload.bench.loader import store_floors

        f = store_floors(Path(store), args.size, 64, seconds=args.seconds / 2, rounds=args.rounds)
        lo, mid, hi = f.preset_over_decode
        print(f"floors per core: decode alone {f.decode_per_core:.0f} images/s ({f.decode_us:.0f} us/image); the "
              f"preset's whole work {f.preset_per_core:.0f} images/s ({f.preset_us:.0f} us/image) = {mid:.2f}x the "
              f"decode (per round {lo:.2f}-{hi:.2f}x); normalise a batch of 64: {f.normalise_ms:.1f} ms "
              f"({f.normalise_us:.0f} us/image)")


if __name__ == "__main__":
    main()
