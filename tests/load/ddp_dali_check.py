"""Run under torchrun: each rank records the store indices DALILoader (CPU mode) gives it per epoch."""

import json
import sys

import torch.distributed as dist

from fastload.dali import DALILoader


def main(store: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DALILoader(store, 4, device="cpu", num_threads=1, seed=3, return_index=True, size=32)
    epochs = [[int(i) for _, _, idx in loader for i in idx] for _ in range(2)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"epochs": epochs, "len": len(loader)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
