"""One node's reader for tools/bench_multinode.py: epochs of a remote store as rank RANK of WORLD.

    python tools/multinode_reader.py URL CACHE_DIR RANK WORLD EPOCHS OUT.json

Prints nothing; writes per epoch the seconds to the first batch (from iter()), the epoch's seconds, the
samples read and the shards this node's cache downloaded. Run inside a node's network namespace.

Must not: be imported by the package (a tool, run by hand).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from fastload import DataLoader, LMDBImageDataset, ShardSampler, collate_uint8, eval_transform
from fastload.store.cache import node_downloads


def main(url: str, cache_dir: str, rank: str, world: str, epochs: str, out: str) -> None:
    torch.set_num_threads(1)
    ds = LMDBImageDataset(url, cache_dir=cache_dir, transform=eval_transform(64, 64))
    sampler = ShardSampler(ds, num_replicas=int(world), rank=int(rank), seed=0)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, num_workers=1, collate_fn=collate_uint8)
    records = []
    for epoch in range(int(epochs)):
        sampler.set_epoch(epoch)
        before = len(node_downloads(cache_dir))
        t0 = time.perf_counter()
        first, n = None, 0
        for images, _ in loader:
            if first is None:
                first = time.perf_counter() - t0
            n += len(images)
        records.append({"first_batch_s": first, "epoch_s": time.perf_counter() - t0, "samples": n,
                        "downloads": len(node_downloads(cache_dir)) - before})
    with open(out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
