"""Hugging Face accelerate: fastload's loader, resumed by ``Accelerator.save_state`` / ``load_state``.

    python examples/accelerate_train.py STORE STATE_DIR [--max-steps 200] [--every 20]
    accelerate launch examples/accelerate_train.py STORE STATE_DIR     # the same, launched by accelerate

The model and optimizer go through ``accelerator.prepare``; the loader does not (``prepare``
would rebuild it as accelerate's own ``DataLoader``, dropping fastload's thread backend,
``num_workers="auto"`` and exact resume). Instead ``accelerator.register_for_checkpointing``
adds the loader's ``state_dict()`` to every ``save_state``, and ``load_state`` puts it back,
so a killed run continues with exactly the batches it would have trained on next. Under
several processes, shard the data with a ``DistributedSampler`` (or let fastload's loader add
one: it does under ``torch.distributed``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn
from accelerate import Accelerator

from fastload import DataLoader, LMDBImageDataset, collate_uint8, normalize, train_transform


class Progress:
    """The step counter, checkpointed with everything else (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("state_dir")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="save_state every N steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--workers", default="auto")
    p.add_argument("--log-batches", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    accelerator = Accelerator()
    ds = LMDBImageDataset(a.store, transform=train_transform(a.size))
    loader = DataLoader(ds, batch_size=a.batch_size, shuffle=True,
                        num_workers=a.workers if a.workers == "auto" else int(a.workers),
                        collate_fn=collate_uint8, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * a.size * a.size, len(ds.classes)))
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optim = accelerator.prepare(model, optim)
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)          # the data position is saved with the rest
    latest = Path(a.state_dir) / "latest"
    if latest.exists():
        accelerator.load_state(str(latest))
        accelerator.print(f"resumed at step {progress.step}")
    while progress.step < a.max_steps:
        # iterate the loader itself: its state then counts exactly the batches trained on
        for images, labels in loader:
            images, labels = images.to(accelerator.device), labels.to(accelerator.device)
            if a.log_batches:
                with open(a.log_batches, "a") as f:
                    f.write(f"{progress.step} {int(images.sum())} {labels.tolist()}\n")
            loss = nn.functional.cross_entropy(model(normalize(images)), labels)
            optim.zero_grad()
            accelerator.backward(loss)
            optim.step()
            progress.step += 1
            if progress.step % a.every == 0:
                accelerator.save_state(str(latest))
            if progress.step >= a.max_steps:
                break


if __name__ == "__main__":
    main()
