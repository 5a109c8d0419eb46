"""Run under torchrun: DALILoader (CPU) reads a store in object storage by shards through one node cache
(tests/load/test_streaming_ddp.py).

argv: URL CACHE_DIR OUT LIMIT WINDOW. Each rank writes OUT/dali{rank}.json: its indices per epoch (2 epochs),
its batch count, the node's downloads during each epoch (read after every rank's epoch is over), the
largest cache usage seen after any batch, and the node's download log. The ranks synchronise after every
batch, as DDP's gradient all-reduce does.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from fastload.dali import DALILoader, DALIOptions
from fastload.store import cache


def main(url: str, cache_dir: str, out: str, limit: str, window: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DALILoader(url, 2, train=False, shuffle=True, device="cpu", num_threads=1, size=32, seed=5,
                        return_index=True, options=DALIOptions(window=int(window), cache_dir=cache_dir,
                                                               cache_limit=int(limit), prefetch_queue_depth=1))
    record = {"len": len(loader), "epochs": [], "batches": [], "downloads": [], "usage_max": 0}
    try:
        for _epoch in range(2):
            dist.barrier()  # every rank is here (no loop or prefetch of this epoch begun) when the log is read
            before = len(cache.node_downloads(cache_dir))
            dist.barrier()  # and every rank has read it before any starts the epoch
            got, batches = [], 0
            for _x, _y, index in loader:
                dist.all_reduce(torch.ones(1))  # DDP's gradient sync: no rank runs more than a step ahead
                got += index.tolist()
                batches += 1
                record["usage_max"] = max(record["usage_max"], loader._reader.cache.usage())
            dist.barrier()  # every rank's epoch is over before the node's log is read
            record["epochs"].append(got)
            record["batches"].append(batches)
            record["downloads"].append([d["shard"] for d in cache.node_downloads(cache_dir)[before:]])
    finally:
        loader.close()
    record["pid"], record["log"] = os.getpid(), cache.node_downloads(cache_dir)
    with open(f"{out}/dali{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
