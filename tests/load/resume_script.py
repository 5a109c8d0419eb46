"""Run in a fresh process by tests/load/test_resume*.py: take a loader's batches, save, resume.

    python resume_script.py CONFIG_JSON

CONFIG keys: kind ("map" | "iterable" | "store": the LMDB store at ``store`` with
``train_transform(32)``, each sample recorded as "label:crc32 of its pixels", so the crops
are compared too), backend ("processes" | "threads"; resume_backend: the resumed runs'
backend, default the same), n, batch, workers, shuffle, persistent,
generator (seed or null), seed (torch.manual_seed at start), save_at (list of k: after k
batches of epoch 0 write {"loader": state_dict(), "rng": torch RNG} to ckpt_dir/k.pt),
resume (a checkpoint path or null: load it, then finish that epoch; or a list of paths: a fresh
loader for each, in turn), epochs (epochs to run, the resumed one first), out (JSON file:
{"epochs": [[sample ids per batch...]...]}, or {"runs": [that, per checkpoint]}), and for the
kill test: log (append one line per batch), step_sleep (seconds per batch), every (checkpoint
every N batches into ckpt_dir/latest.pt, atomically).
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib

import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastload import DataLoader, LMDBImageDataset
from fastload.load.transforms import train_transform
from resumable import Indexed


class Counting(IterableDataset):
    """0..n-1, split between workers by ``i % num_workers``; Stateful (``state_dict``)."""

    def __init__(self, n: int) -> None:
        self.n, self.pos, self._start = n, 0, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self._start = self._start, 0
        for i in range(start, self.n):
            if i % nw == wid:
                self.pos = i + 1
                yield i
        self.pos = self.n

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self._start = self.pos = int(state["pos"])


def build(cfg: dict, resumed: bool) -> DataLoader:
    if cfg["kind"] == "store":
        ds = LMDBImageDataset(cfg["store"], transform=train_transform(32), on_error=cfg.get("on_error", "raise"))
    else:
        ds = Indexed(cfg["n"]) if cfg["kind"] == "map" else Counting(cfg["n"])
    gen = torch.Generator().manual_seed(cfg["generator"]) if cfg.get("generator") is not None else None
    kw = dict(shuffle=cfg.get("shuffle", False)) if cfg["kind"] != "iterable" else {}
    backend = cfg.get("backend", "processes")
    if resumed:
        backend = cfg.get("resume_backend", backend)
    return DataLoader(ds, batch_size=cfg["batch"], num_workers=cfg["workers"], generator=gen, backend=backend,
                      persistent_workers=cfg.get("persistent", False) and cfg["workers"] > 0, **kw)


def record(batch) -> list:
    if isinstance(batch, (list, tuple)):  # (images, labels) from a store
        images, labels = batch
        return [f"{int(y)}:{zlib.crc32(x.numpy().tobytes()):08x}" for x, y in zip(images, labels)]
    return [int(i) for i in batch]


def save(path: str, loader: DataLoader, step: int) -> None:
    tmp = path + ".tmp"
    torch.save({"loader": loader.state_dict(), "rng": torch.get_rng_state(), "step": step}, tmp)
    os.replace(tmp, path)


def run(cfg: dict, resume: str | None) -> list[list[list[int]]]:
    torch.manual_seed(cfg.get("seed", 0))
    loader = build(cfg, resumed=bool(resume))
    epochs: list[list[list[int]]] = []
    save_at = set(cfg.get("save_at", []))
    log = open(cfg["log"], "a") if cfg.get("log") else None
    step = 0
    if resume:
        ck = torch.load(resume, weights_only=False)
        torch.set_rng_state(ck["rng"])
        loader.load_state_dict(ck["loader"])
        step = ck["step"]
    for e in range(cfg.get("epochs", 1)):
        batches: list[list[int]] = []
        if e == 0 and 0 in save_at:
            save(f"{cfg['ckpt_dir']}/0.pt", loader, 0)
        for batch in loader:
            batches.append(record(batch))
            step += 1
            if log is not None:
                log.write(json.dumps({"step": step, "ids": batches[-1]}) + "\n")
                log.flush()
                time.sleep(cfg.get("step_sleep", 0))
            if e == 0 and len(batches) in save_at:
                save(f"{cfg['ckpt_dir']}/{len(batches)}.pt", loader, step)
            if cfg.get("every") and step % cfg["every"] == 0:
                save(f"{cfg['ckpt_dir']}/latest.pt", loader, step)
        epochs.append(batches)
    return epochs


def main(cfg: dict) -> None:
    """One run, or (``resume`` a list) one fresh loader per checkpoint, in this one new process."""
    resume = cfg.get("resume")
    if isinstance(resume, list):
        out = {"runs": [run(cfg, path) for path in resume]}
    else:
        out = {"epochs": run(cfg, resume)}
    with open(cfg["out"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
