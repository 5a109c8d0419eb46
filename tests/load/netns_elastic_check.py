"""Run under torchrun --nnodes=1:2 on nodes of tests/netns.py: one epoch of a remote store, a checkpoint
(model + loader.state_dict()) after every batch, resumed from it when torchrun restarts the workers.

argv: URL CACHE_DIR OUT CKPT_DIR. Each rank appends one JSON line per batch to OUT/log-A-R.jsonl
(A: torchrun's restart count, R: the rank): the batch's sample ids. Rank 0 saves CKPT_DIR/ckpt.pt after
every batch, once every rank has read it (a barrier, as DDP's gradient sync is one). A restarted worker
loads the checkpoint and says which it resumed from in OUT/resumed-A-R.json.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_remote_check import Indexed
from fastload import DataLoader, ShardSampler


def main(url, cache_dir, out, ckpt_dir):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out, ckpt = Path(out), Path(ckpt_dir) / "ckpt.pt"
    ds = Indexed(url, cache_dir, 1 << 30)
    loader = DataLoader(ds, batch_size=2, sampler=ShardSampler(ds, seed=11, window=2), num_workers=0,
                        generator=torch.Generator().manual_seed(11))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    initial = model.weight[0, 0].item()
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        loader.load_state_dict(saved["loader"])
        (out / f"resumed-{attempt}-{rank}.json").write_text(json.dumps(
            {"from_attempt": saved["attempt"], "from_batch": saved["batch"], "world": world}))
    with open(out / f"log-{attempt}-{rank}.jsonl", "a") as log:
        for b, batch in enumerate(loader):
            log.write(json.dumps({"batch": b, "world": world, "ids": [int(i) for i in batch]}) + "\n")
            log.flush()
            with torch.no_grad():
                model.weight.add_(1.0)  # a step: the checkpoint's model must match the loader's position
            dist.barrier()
            if rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "loader": loader.state_dict(), "attempt": attempt,
                            "batch": b}, tmp)
                os.replace(tmp, ckpt)
            time.sleep(0.3)  # a training step's time: the node dies mid-epoch, not after it
    dist.barrier()
    (out / f"done-{attempt}-{rank}.json").write_text(json.dumps({"world": world,
                                                                   "steps": round(model.weight[0, 0].item() - initial)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
