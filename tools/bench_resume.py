"""What taking a loader state costs: ``state_dict()`` alone, and a loop that checkpoints every N steps.

    python tools/bench_resume.py [--workers 2] [--batch-size 32] [--batches 40] [--rounds 5] [--every 1 10]

Builds a small synthetic store (``fastload.datasets``, in a temporary directory), then:

1. ``state_dict()`` cost mid-epoch (map-style, fastload preset, shuffled), in microseconds
   (median and 90th percentile of 2,000 calls), with ``torch.save`` to memory and the size;
2. images/s of the same training-shaped loop (load a batch, normalise it) that never takes
   a state vs one that takes ``state_dict()`` + ``torch.save`` every N steps, in interleaved
   rounds (every path once per round, so a slow moment of the machine hits all alike);
   reported per path as the median over rounds, and as the ratio to "never" with the
   lowest and highest per-round ratio (the spread).

Every path reads the same samples with the same transform into the same batches; the only
difference is the checkpointing. Prints one table; no figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import io
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def build(store: Path, workers: int, batch_size: int):
    from fastload import DataLoader, LMDBImageDataset
    from fastload.load.transforms import collate_uint8, train_transform

    ds = LMDBImageDataset(store, transform=train_transform(96))
    return DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate_uint8,
                      persistent_workers=workers > 0, generator=torch.Generator().manual_seed(0))


def state_cost(loader) -> dict:
    it = iter(loader)
    next(it)
    times, saves = [], []
    for _ in range(2000):
        t = time.perf_counter()
        sd = loader.state_dict()
        times.append(time.perf_counter() - t)
    for _ in range(200):
        t = time.perf_counter()
        torch.save(loader.state_dict(), io.BytesIO())
        saves.append(time.perf_counter() - t)
    del it
    q = statistics.quantiles(times, n=10)
    return {"state_dict_us_median": statistics.median(times) * 1e6, "state_dict_us_p90": q[-1] * 1e6,
            "with_torch_save_us_median": statistics.median(saves) * 1e6, "bytes": len(pickle.dumps(sd))}


def timed_epoch_slice(loader, batches: int, every: int) -> float:
    from fastload.load.transforms import normalize

    it = iter(loader)
    next(it)  # warm-up: workers started, first batch in
    n, t = 0, time.perf_counter()
    for step in range(1, batches + 1):
        try:
            images, _ = next(it)
        except StopIteration:
            break
        normalize(images)
        n += len(images)
        if every and step % every == 0:
            torch.save({"loader": loader.state_dict()}, io.BytesIO())
    dt = time.perf_counter() - t
    del it
    return n / dt


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=40, help="timed batches per path per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--every", type=int, nargs="+", default=[1, 10], help="checkpoint every N steps")
    p.add_argument("--images", type=int, default=2048, help="images in the synthetic store")
    a = p.parse_args(argv)
    from fastload.datasets import DatasetSpec, make_dataset
    from fastload.pack.convert import ConvertOptions, convert

    with tempfile.TemporaryDirectory() as tmp:
        per_class = max(1, a.images // 8)
        tree = make_dataset(Path(tmp) / "tree", DatasetSpec(num_classes=8, per_class=per_class, min_side=96,
                                                            max_side=256, png_every=0, seed=1))
        store = Path(tmp) / "bench.lmdb"
        convert(tree, store, ConvertOptions(progress=False))
        cost = state_cost(build(store, a.workers, a.batch_size))
        print(f"state_dict() mid-epoch: median {cost['state_dict_us_median']:.1f} us, "
              f"p90 {cost['state_dict_us_p90']:.1f} us; + torch.save: median "
              f"{cost['with_torch_save_us_median']:.1f} us; {cost['bytes']} bytes")
        paths = {"never": 0, **{f"every {n}": n for n in a.every}}
        loaders = {name: build(store, a.workers, a.batch_size) for name in paths}
        rates: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(a.rounds):
            for name, every in paths.items():
                rates[name].append(timed_epoch_slice(loaders[name], a.batches, every))
        print(f"{'path':<12} {'images/s (median)':>18} {'vs never':>9} {'ratio spread':>16}")
        for name in paths:
            ratios = [r / b for r, b in zip(rates[name], rates["never"])]
            print(f"{name:<12} {statistics.median(rates[name]):>18.1f} {statistics.median(ratios):>9.3f} "
                  f"{min(ratios):>7.3f}..{max(ratios):<7.3f}")


if __name__ == "__main__":
    sys.exit(main())
