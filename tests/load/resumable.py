"""The small datasets the resume tests share (tests/load/test_resume*.py and resume_script.py)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, IterableDataset


class Indexed(Dataset):
    """Sample ``i`` is ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stateful(IterableDataset):
    """0..n-1 split over workers (``i % num_workers``), with its position as its state."""

    def __init__(self, n: int = 24) -> None:
        self.n, self.pos, self.start = n, 0, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self.start = self.start, 0
        for i in range(start, self.n):
            if i % nw == wid:
                self.pos = i + 1
                yield torch.tensor(i)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.start = self.pos = sd["pos"]
