"""Shared fixtures: tiny synthetic image trees made in tmp dirs, and the gpu/dali markers.

Nothing here touches the network; every image is generated.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fastload.datasets import DatasetSpec, make_dataset

# tests/s3.py: a real S3 server (SeaweedFS) on loopback; tests/cluster.py: a local Ray cluster on loopback;
# tests/netns.py: nodes in network namespaces on a bridge, with shaped links
pytest_plugins = ["s3", "cluster", "netns"]

TINY = DatasetSpec(num_classes=3, per_class=8, min_side=48, max_side=160, png_every=4, seed=7)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_dali = pytest.mark.skip(reason="needs nvidia-dali (pip install 'fastload[dali]')")
    has_cuda = _has_cuda()
    has_dali = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "dali" in item.keywords and not has_dali:
            item.add_marker(skip_dali)


@pytest.fixture(autouse=True)
def _no_stale_store_handles():
    """Each test starts with no read handle on a store an earlier test deleted.

    Tests open stores with raw ``lmdb.open``, which the product's ``forget_stale`` does not
    guard: a handle this process keeps on a deleted store makes py-lmdb call a new store whose
    data.mdb got the freed inode "already open in this process".
    """
    from fastload.store.reader import forget_stale

    forget_stale()
    yield


@pytest.fixture(scope="session")
def tiny_tree(tmp_path_factory) -> Path:
    """3 classes × 8 images (6 JPEG + 2 PNG each), 48..160 px. Do not modify: it is shared."""
    return make_dataset(tmp_path_factory.mktemp("tiny") / "tree", TINY, workers=1)


@pytest.fixture(scope="session")
def tiny_store(tiny_tree, tmp_path_factory) -> Path:
    """``tiny_tree`` converted with ``lossless=True``, so every sample is its source file byte for byte
    (the PNGs too) and tests can compare with the files. Do not modify: it is shared."""
    from fastload.pack.convert import ConvertOptions, convert

    dst = tmp_path_factory.mktemp("store") / "tiny.lmdb"
    convert(tiny_tree, dst, ConvertOptions(progress=False, workers=2, lossless=True))
    return dst


