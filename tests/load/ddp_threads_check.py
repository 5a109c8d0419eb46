"""Run under torchrun: each rank records what backend="threads" gives it per epoch (indices and labels)."""

import json
import sys

import torch
import torch.distributed as dist

from fastload import DataLoader, LMDBImageDataset, train_transform


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def main(store: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = LMDBImageDataset(store, transform=train_transform(32))
    # Two loaders over the same number of samples and the same seed: the same DistributedSampler
    # shards, so the generic path shows the indices and the fast path must give their labels.
    generic = DataLoader(Indexed(len(ds)), batch_size=4, shuffle=True, num_workers=2, backend="threads")
    fast = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, backend="threads")
    epochs, labels = [], []
    for _ in range(2):
        epochs.append([int(i) for batch in generic for i in batch])
        labels.append([int(v) for images, y in fast for v in y])
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"epochs": epochs, "labels": labels, "sampler": type(fast.sampler).__name__}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
