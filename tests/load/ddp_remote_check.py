"""Run under torchrun: ranks read a remote store through one node cache (tests/load/test_streaming_ddp.py).

argv: URL CACHE_DIR OUT LIMIT MODE NUM_WORKERS [WINDOW]; MODE is "full" (2 epochs), "kill" (SIGKILL after 2
batches of epoch 0, a state saved after each batch) or "resume" (load OUT/state.pt, finish epoch 0).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from fastload import DataLoader, LMDBImageDataset, ShardSampler
from fastload.store import cache


class Indexed(torch.utils.data.Dataset):
    """Sample indices, after a real read (crc32-checked) of each sample from the cache. It hands on the reader
    it reads through, so the loader picks the ShardSampler from what that reader declares."""

    def __init__(self, url, cache_dir, limit):
        self.ds = LMDBImageDataset(url, cache_dir=cache_dir, cache_limit=limit)
        self.reader = self.ds.reader
        self.shard_sizes = self.ds.shard_sizes

    def prefetch_shards(self, shards):
        self.ds.prefetch_shards(shards)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.ds.get_bytes(i)
        return i


def main(url, cache_dir, out, limit, mode, workers, window=None):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = Indexed(url, cache_dir, int(limit))
    sampler = None if window is None else ShardSampler(ds, seed=5, window=int(window))
    loader = DataLoader(ds, batch_size=2, shuffle=None if sampler else True, num_workers=int(workers),
                        sampler=sampler, generator=torch.Generator().manual_seed(5))
    usage_max = 0
    record = {"sampler": type(loader.sampler).__name__, "epochs": [], "downloads": []}
    if mode == "resume":
        loader.load_state_dict(torch.load(f"{out}/state.pt", weights_only=False))
    for epoch in range(2 if mode == "full" else 1):
        before = len(cache.node_downloads(cache_dir))
        dist.barrier()  # every rank has read the counter before any starts the epoch (and downloads)
        got = []
        for b, batch in enumerate(loader):
            got += [int(i) for i in batch]
            usage_max = max(usage_max, ds.ds._reader.cache.usage())
            if mode == "kill":
                if rank == 0:
                    torch.save(loader.state_dict(), f"{out}/state.tmp")
                    os.replace(f"{out}/state.tmp", f"{out}/state.pt")
                if b == 1:
                    dist.barrier()
                    with open(f"{out}/{mode}{rank}.json", "w") as f:
                        json.dump({"consumed": got}, f)
                    os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()  # every rank's epoch is over before the counters are read
        record["epochs"].append(got)
        record["downloads"].append(len(cache.node_downloads(cache_dir)) - before)
    record["usage_max"] = usage_max
    with open(f"{out}/{mode}{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
