"""Run under torchrun: each rank records the sample indices fastload.DataLoader gives it per epoch."""

import json
import sys

import torch
import torch.distributed as dist

from fastload import DataLoader, LMDBImageDataset


class Indexed(torch.utils.data.Dataset):
    def __init__(self, store):
        self.ds = LMDBImageDataset(store)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        self.ds.get_bytes(i)  # a real read from the store in this worker
        return i


def main(store: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Indexed(store), batch_size=4, shuffle=True, num_workers=1)
    epochs = [[int(i) for batch in loader for i in batch] for _ in range(3)]
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"epochs": epochs, "sampler": type(loader.sampler).__name__}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
