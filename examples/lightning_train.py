"""Lightning: a ``LightningDataModule`` on a fastload store, resumed by Lightning's own checkpoints.

    python examples/lightning_train.py STORE CKPT_DIR [--max-steps 200] [--every 20]

Lightning saves and restores the data position itself: ``fastload.DataLoader`` has
``state_dict()`` / ``load_state_dict()``, so Lightning (>= 2.3) treats it as a stateful
dataloader, writes its state into every checkpoint and loads it back on
``trainer.fit(..., ckpt_path=...)``. Kill the script at any point and run the same command:
it resumes from the newest checkpoint in CKPT_DIR with exactly the batches the
uninterrupted run would have trained on next (same order, same crops).

``fastload profile -- python examples/lightning_train.py STORE DIR`` works on it unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn

from fastload import DataLoader, LMDBImageDataset, collate_uint8, normalize, train_transform


class StoreDataModule(L.LightningDataModule):
    """A fastload store as a Lightning data module: uint8 batches, normalised on the device."""

    def __init__(self, store: str, *, batch_size: int = 32, size: int = 64, num_workers: int | str = "auto",
                 seed: int = 0) -> None:
        super().__init__()
        self.store, self.batch_size, self.size = store, batch_size, size
        self.num_workers, self.seed = num_workers, seed
        self.dataset: LMDBImageDataset | None = None

    def setup(self, stage: str) -> None:
        self.dataset = LMDBImageDataset(self.store, transform=train_transform(self.size))

    def train_dataloader(self) -> DataLoader:
        # generator=: the order is a function of this seed, so a resumed run rebuilds it exactly
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          collate_fn=collate_uint8, generator=torch.Generator().manual_seed(self.seed),
                          persistent_workers=self.num_workers not in (0, "auto"))


class TinyClassifier(L.LightningModule):
    def __init__(self, num_classes: int, size: int, log_batches: str | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * size * size, num_classes))
        self.log_batches = log_batches  # test hook: one line per step, a fingerprint of the batch

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.log_batches:
            with open(self.log_batches, "a") as f:
                f.write(f"{self.global_step} {int(images.sum())} {labels.tolist()}\n")
        loss = nn.functional.cross_entropy(self.net(normalize(images)), labels)  # uint8 -> float on the device
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("ckpt_dir")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--workers", default="auto")
    p.add_argument("--log-batches", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    workers = a.workers if a.workers == "auto" else int(a.workers)
    data = StoreDataModule(a.store, batch_size=a.batch_size, size=a.size, num_workers=workers)
    data.setup("fit")
    model = TinyClassifier(len(data.dataset.classes), a.size, a.log_batches)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=a.ckpt_dir, every_n_train_steps=a.every, save_top_k=-1,
                                               filename="{step}")
    trainer = L.Trainer(max_steps=a.max_steps, callbacks=[ckpt], accelerator="auto", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    saved = sorted(Path(a.ckpt_dir).glob("step=*.ckpt"), key=lambda q: int(q.stem.split("=")[1]))
    trainer.fit(model, datamodule=data, ckpt_path=str(saved[-1]) if saved else None)


if __name__ == "__main__":
    main()
