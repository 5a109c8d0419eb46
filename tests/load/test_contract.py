"""One batch contract for every loader path: (images float NCHW normalised, labels int64 1-D) on the device."""

from __future__ import annotations

import pytest
import torch

from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.prefetch import DevicePrefetcher
from fastload.load.transforms import collate_uint8, train_transform

dali, gpu = pytest.mark.dali, pytest.mark.gpu
PATHS = [
    ("dataloader+prefetch", "cpu"),
    pytest.param("dataloader+prefetch", "cuda", marks=gpu),
    ("threads+prefetch", "cpu"),
    pytest.param("threads+prefetch", "cuda", marks=gpu),
    pytest.param("dali", "cpu", marks=dali),
    pytest.param("dali", "cuda", marks=[dali, gpu]),
]


def make(path: str, device: str, store, size: int = 40, batch_size: int = 6):
    if path == "dali":
        from fastload.dali import DALILoader

        return DALILoader(store, batch_size, size=size, device="gpu" if device == "cuda" else "cpu", num_threads=1)
    ds = LMDBImageDataset(store, transform=train_transform(size))
    backend = "threads" if path == "threads+prefetch" else "processes"
    return DevicePrefetcher(DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=1 if backend ==
                                       "processes" else 2, collate_fn=collate_uint8, backend=backend), device)


@pytest.mark.parametrize("path, device", PATHS)
def test_batch_contract(path, device, tiny_store):
    loader = make(path, device, tiny_store)
    assert len(loader) == 4  # 24 samples in batches of 6
    total, means = 0, []
    for images, labels in loader:
        assert images.device.type == device and labels.device.type == device
        assert images.dtype == torch.float32 and images.dim() == 4 and images.shape[1:] == (3, 40, 40)
        assert labels.dtype == torch.int64 and labels.dim() == 1 and len(labels) == images.shape[0]
        assert 0 <= labels.min() and labels.max() < 3
        assert -2.2 <= images.min() and images.max() <= 2.7  # ImageNet-normalised 0..255
        means.append(images.mean().item())
        total += len(labels)
    assert total == 24
    assert abs(sum(means) / len(means)) < 1.0
