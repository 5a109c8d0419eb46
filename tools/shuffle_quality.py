"""How well mixed is one rank's order? ShardSampler vs a full permutation, MosaicML Streaming, WebDataset.

For a store laid out in shards (sizes and labels; by default ImageNet-shaped: 1000 classes x
1300 images in shards of 5000, in class order, as `fastload convert` without --shuffle lays a
store out; `--convert-shuffled` for a store shuffled at conversion; `--store PATH` for a
real local store), prints, for the order one rank reads in one epoch:

* lag-1 label autocorrelation (Pearson, of the class ids of consecutive samples): 0 for a
  full permutation; near 1 when the order follows the class-sorted store;
* same-label pairs: the fraction of consecutive samples with the same label (a full
  permutation gives about 1/classes);
* shards per batch of 256: distinct shards one batch draws from (what a node must hold to
  make it), and classes per batch.

Orders compared (each from its library's code where it imports, seed fixed):
* fastload ShardSampler, default window (and --windows more);
* full permutation (a uniform shuffle of all samples: the reference for mixing, the worst
  case for reading, since every batch touches ~256 shards);
* MosaicML Streaming's default shuffle: ``py1e`` with its defaults for one node
  (num_canonical_nodes = 1, shuffle_block_size = max(4_000_000 // 1, 1 << 18)), from
  ``streaming.base.shuffle.get_shuffle``;
* WebDataset's default: shard list through ``shardshuffle=100`` (what ``shardshuffle=True``
  means in webdataset 1.0) then ``.shuffle(1000)``, both with ``webdataset.filters._shuffle``
  (bufsize, initial=100), or the same algorithm re-implemented when webdataset is missing.

Usage: python tools/shuffle_quality.py [--store PATH] [--world 1] [--windows 1,4,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import numpy as np


def layout(classes: int, per_class: int, shard: int, shuffled: bool, seed: int = 0):
    labels = np.repeat(np.arange(classes), per_class)
    if shuffled:
        labels = labels[np.random.default_rng(seed).permutation(len(labels))]
    n = len(labels)
    sizes = [min(shard, n - s) for s in range(0, n, shard)]
    return labels, sizes


def from_store(path: str):
    from fastload.store.reader import load_store_metas

    metas = load_store_metas(path)
    return np.concatenate([m.labels for m in metas]).astype(np.int64), [m.count for m in metas]


def shardshuffle_wds(items, bufsize, seed):
    try:
        from webdataset.filters import _shuffle
    except ImportError:  # the same algorithm (webdataset/filters.py _shuffle)
        def _shuffle(data, bufsize=1000, initial=100, rng=None):
            buf = []
            for sample in data:
                buf.append(sample)
                if len(buf) < bufsize:
                    try:
                        buf.append(next(data))
                    except StopIteration:
                        pass
                if len(buf) >= min(initial, bufsize):
                    k = rng.randint(0, len(buf) - 1)
                    buf[k], buf[-1] = buf[-1], buf[k]
                    yield buf.pop()
            while buf:
                k = rng.randint(0, len(buf) - 1)
                buf[k], buf[-1] = buf[-1], buf[k]
                yield buf.pop()
    return list(_shuffle(iter(items), bufsize=bufsize, initial=100, rng=random.Random(seed)))


def order_webdataset(sizes, seed, world, rank):
    starts = np.cumsum([0] + list(sizes))
    shards = shardshuffle_wds(range(len(sizes)), 100, seed)
    shards = shards[rank::world]  # split_by_node after the shard shuffle, as wds.WebDataset does
    samples = (i for s in shards for i in range(starts[s], starts[s + 1]))
    return np.array(shardshuffle_wds(samples, 1000, seed + 1))


def order_streaming(sizes, seed, world, rank):
    from streaming.base.shuffle import get_shuffle

    ids = get_shuffle("py1e", np.array(sizes, dtype=np.int64), 1, seed, 0, max(4_000_000 // 1, 1 << 18))
    per = -(-len(ids) // world)
    return ids[rank * per:(rank + 1) * per]  # one canonical node's order, split contiguously over ranks


def order_fastload(sizes, seed, world, rank, window):
    from fastload.load.shards import ShardSampler

    return np.array(list(ShardSampler(sizes, num_replicas=world, rank=rank, seed=seed, window=window)))


def quality(order: np.ndarray, labels: np.ndarray, sizes, batch: int = 256) -> dict:
    starts = np.cumsum([0] + list(sizes))
    lab = labels[order].astype(np.float64)
    ac = float(np.corrcoef(lab[:-1], lab[1:])[0, 1]) if lab.std() > 0 else float("nan")
    same = float(np.mean(lab[:-1] == lab[1:]))
    shard = np.searchsorted(starts, order, side="right") - 1
    nb = len(order) // batch
    sh = [len(np.unique(shard[i * batch:(i + 1) * batch])) for i in range(nb)]
    cl = [len(np.unique(lab[i * batch:(i + 1) * batch])) for i in range(nb)]
    return {"samples": int(len(order)), "label_autocorr": round(ac, 4), "same_label_pairs": round(same, 4),
            "shards_per_batch": round(float(np.mean(sh)), 1), "classes_per_batch": round(float(np.mean(cl)), 1)}


def main(argv=None) -> int:
    from fastload.load.shards import DEFAULT_WINDOW

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", help="a local store or folder of shards (else a synthetic layout)")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--per-class", type=int, default=1300)
    ap.add_argument("--shard", type=int, default=5000, help="samples per shard")
    ap.add_argument("--convert-shuffled", action="store_true", help="the store was shuffled at conversion")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--windows", default=f"{DEFAULT_WINDOW}", help="ShardSampler windows to show, e.g. 1,4,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.store:
        labels, sizes = from_store(a.store)
        what = a.store
    else:
        labels, sizes = layout(a.classes, a.per_class, a.shard, a.convert_shuffled, a.seed)
        what = (f"{a.classes} classes x {a.per_class}, shards of {a.shard}, "
                f"{'shuffled at conversion' if a.convert_shuffled else 'class-sorted'}")
    rows = {}
    for w in [int(x) for x in a.windows.split(",")]:
        tag = " (default)" if w == DEFAULT_WINDOW else ""
        rows[f"fastload ShardSampler window={w}{tag}"] = order_fastload(sizes, a.seed, a.world, 0, w)
    n = len(labels)
    rows["full permutation"] = np.random.default_rng(a.seed).permutation(n)[: -(-n // a.world)]
    try:
        rows["MosaicML Streaming py1e (defaults, 1 node)"] = order_streaming(sizes, a.seed, a.world, 0)
    except ImportError:
        print("streaming not installed: its row is left out", file=sys.stderr)
    rows["WebDataset shardshuffle=100 + shuffle(1000)"] = order_webdataset(sizes, a.seed, a.world, 0)
    out = {name: quality(o, labels, sizes) for name, o in rows.items()}
    print(f"store: {what}; {len(sizes)} shards; world {a.world}, rank 0's epoch 0\n")
    print(f"{'order':48s} {'lag-1 autocorr':>15s} {'same-label':>11s} {'shards/batch':>13s} {'classes/batch':>14s}")
    for name, q in out.items():
        print(f"{name:48s} {q['label_autocorr']:>15.4f} {q['same_label_pairs']:>11.4f} "
              f"{q['shards_per_batch']:>13.1f} {q['classes_per_batch']:>14.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"store": what, "world": a.world, "shards": len(sizes), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
