"""Run under torchrun by tests/load/test_resume_elastic.py: save mid-epoch with W ranks, resume with W'.

    torchrun --nproc_per_node=W resume_ddp.py PHASE OUT_DIR K BACKEND

PHASE "full": run epochs 0 and 1 uninterrupted. "save": take K batches of epoch 0, rank 0
writes the loader state (and every rank what it read). "resume": every rank loads rank 0's
state, finishes epoch 0, runs epoch 1. Each rank writes OUT_DIR/PHASE-rank{r}.json. BACKEND is
the loader's ``backend`` ("processes" or "threads").
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from fastload import DataLoader

N = 46


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        return i


def main(phase: str, out: str, k: int, backend: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Indexed(), batch_size=4, shuffle=True, num_workers=1,
                        generator=torch.Generator().manual_seed(17), backend=backend)
    record: dict = {"world": dist.get_world_size(), "sampler": type(loader.sampler).__name__}
    if phase == "full":
        record["epochs"] = [[int(i) for b in loader for i in b] for _ in range(2)]
    elif phase == "save":
        it = iter(loader)
        record["seen"] = [int(i) for _ in range(k) for i in next(it)]
        if rank == 0:
            torch.save({"loader": loader.state_dict()}, f"{out}/state.pt")
        del it
    else:
        loader.load_state_dict(torch.load(f"{out}/state.pt", weights_only=False)["loader"])
        record["epochs"] = [[int(i) for b in loader for i in b] for _ in range(2)]
    with open(f"{out}/{phase}-rank{rank}.json", "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
