"""The /dev/shm preflight: DataLoader raises with the fix before workers start; doctor reports it."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
from click.testing import CliRunner

from fastload.cli import main
from fastload.errors import SharedMemoryError
from fastload.load import workers
from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.transforms import train_transform

MB = 1_000_000


class Counting(torch.utils.data.Dataset):
    """Any other dataset: its __getitem__ must not run in the parent (CUDA, LMDB handles before fork)."""

    def __init__(self) -> None:
        self.pid, self.calls_here = os.getpid(), 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        if os.getpid() == self.pid:
            self.calls_here += 1
        return torch.zeros(3, 64, 64), i


def float_transform():
    """What a torchvision ToTensor() pipeline gives: float32 CHW images (3 x 64 x 64 here)."""
    from torchvision.transforms import v2

    return v2.Compose([v2.PILToTensor(), v2.Resize((64, 64), antialias=True), v2.ToDtype(torch.float32, scale=True)])


@pytest.fixture
def small_shm(monkeypatch):
    """A 64 MB /dev/shm with 10 MB free (Docker's default size, partly used)."""
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: (64 * MB, 10 * MB))


def test_plan_counts_workers_prefetch_and_batch_bytes(small_shm):
    plan = workers.shm_plan(2, 3, 2 * MB)
    assert plan.needed_bytes == 12 * MB and plan.free_bytes == 10 * MB and not plan.ok
    assert "TOO SMALL" in plan.explain() and "--shm-size" in plan.explain()
    assert workers.shm_plan(2, 2, 2 * MB).ok
    with pytest.raises(ValueError, match="prefetch_factor must be an integer >= 0"):
        workers.shm_plan(2, -1, MB)


def test_no_dev_shm_is_no_constraint(monkeypatch):
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: None)
    plan = workers.shm_plan(8, 2, 100 * MB)
    assert plan.ok and "not present" in plan.explain()


def test_dataloader_raises_with_the_fix_before_starting_workers(tiny_store, small_shm):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(224))  # 64 x 150 KB = 9.6 MB a batch
    loader = DataLoader(ds, batch_size=64, num_workers=2)
    before = set(multiprocessing.active_children())  # earlier tests' loaders may still be winding down
    with pytest.raises(SharedMemoryError) as info:
        iter(loader)
    msg = str(info.value)
    assert "2 workers x prefetch_factor 2 x 9.6 MB" in msg and "10 MB free" in msg
    assert "--shm-size" in msg and "backend='threads'" in msg and "HINT:" in msg
    assert set(multiprocessing.active_children()) <= before  # no worker was started to die with SIGBUS


def test_threads_backend_needs_no_shm(tiny_store, small_shm):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(224))
    batches = list(DataLoader(ds, batch_size=64, num_workers=2, backend="threads"))
    assert [b[0].shape[0] for b in batches] == [24]


def test_torchvision_style_batches_are_sized_from_one_sample(tiny_store, small_shm, monkeypatch):
    ds = LMDBImageDataset(tiny_store, transform=float_transform())
    loader = DataLoader(ds, batch_size=4, num_workers=1, prefetch_factor=2)  # 4 x 49 KB x 2: fits
    assert len(list(loader)) == 6
    big = DataLoader(ds, batch_size=8, num_workers=2, prefetch_factor=4)  # 8 x 49 KB x 8 = 3.1 MB
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: (64 * MB, 3 * MB))
    with pytest.raises(SharedMemoryError, match="2 workers x prefetch_factor 4 x 0.4 MB per batch = 3 MB"):
        iter(big)


def test_other_datasets_are_not_read_in_the_parent(monkeypatch):
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: (64 * MB, 0))
    ds = Counting()
    assert len(list(DataLoader(ds, batch_size=4, num_workers=1))) == 2  # not checked: no size known
    assert ds.calls_here == 0


def test_num_workers_0_is_not_checked(tiny_store, small_shm):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(224))
    assert len(list(DataLoader(ds, batch_size=1000))) == 1


def test_doctor_reports_shm_against_the_plan(small_shm):
    r = CliRunner().invoke(main, ["doctor", "--batch-size", "256"])
    assert r.exit_code == 0, r.output
    assert "/dev/shm: 64 MB, 10 MB free; workers need" in r.output
    # 256 x 150 KB batches: too big for 10 MB as soon as there is one worker (none on a 1-CPU machine)
    assert ("TOO SMALL" in r.output) == (workers.auto_num_workers() > 0)
