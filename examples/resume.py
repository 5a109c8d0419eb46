"""A training script that survives being killed mid-epoch: the three lines fastload adds.

    python examples/resume.py STORE CHECKPOINT [--epochs 2] [--every 20]

Kill it (Ctrl-C, SIGKILL, a preempted node) and run the same command again: it continues
from the last checkpoint with exactly the batches the uninterrupted run would have seen
next. Under ``torchrun`` the same script resumes elastically: a checkpoint saved by W
ranks can be loaded by W' ranks (rank 0 saves, every rank loads the same file).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn

from fastload import DataLoader, LMDBImageDataset, collate_uint8, prepare_batch, train_transform


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("checkpoint")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = LMDBImageDataset(a.store, transform=train_transform(64))
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers="auto", collate_fn=collate_uint8,
                        generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 64 * 64, len(ds.classes))).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch, step = 0, 0
    if os.path.exists(a.checkpoint):
        ck = torch.load(a.checkpoint, weights_only=False)
        model.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        loader.load_state_dict(ck["loader"])                                  # 1. resume the data
        epoch, step = ck["epoch"], ck["step"]
        print(f"resumed at epoch {epoch}, step {step}")
    loss = None
    while epoch < a.epochs:
        # Iterate the loader itself: its state then counts exactly the batches trained on. (A
        # DevicePrefetcher holds one batch ahead, which a state taken now would skip, unless ahead=False.)
        for batch in loader:
            images, labels = prepare_batch(batch, torch.device(device))
            loss = nn.functional.cross_entropy(model(images), labels)
            optim.zero_grad()
            loss.backward()
            optim.step()
            step += 1
            if step % a.every == 0:
                ck = {"model": model.state_dict(), "optim": optim.state_dict(),
                      "loader": loader.state_dict(),                          # 2. save the data position
                      "epoch": epoch, "step": step}
                torch.save(ck, a.checkpoint + ".tmp")
                os.replace(a.checkpoint + ".tmp", a.checkpoint)               # 3. atomically
        epoch += 1
        print(f"epoch {epoch} done at step {step}" + (f", loss {loss.item():.3f}" if loss is not None else ""))


if __name__ == "__main__":
    main()
