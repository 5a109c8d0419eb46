"""fastload.load.dataset: ImageFolder compatibility, per-process handles, errors, on_error."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from fastload.errors import CorruptSampleError, IncompleteStoreError, NotAStoreError, StoreVersionError, \
    TooManyCorruptSamplesError
from fastload.load.dataset import LMDBImageDataset
from fastload.store import format as fmt
from fastload.store import reader


def pixel_crc(img) -> int:
    return zlib.crc32(np.ascontiguousarray(np.asarray(img)).tobytes())


def writable_copy(store, tmp_path):
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(store, dst)
    return dst


def put(store, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(key, value)
    env.close()


def open_handles(store) -> int:
    key = os.path.realpath(store)
    return sum(1 for k, (pid, _) in reader._ENVS.items() if k == key and pid == os.getpid())


def test_constructor_opens_no_handle_and_pickles(tiny_store):
    reader.release(tiny_store)
    ds = LMDBImageDataset(tiny_store)
    assert open_handles(tiny_store) == 0
    ds[0]
    assert open_handles(tiny_store) == 1
    clone = pickle.loads(pickle.dumps(ds))
    other = LMDBImageDataset(tiny_store)  # a second dataset on the same store shares the handle
    assert pixel_crc(clone[3][0]) == pixel_crc(ds[3][0]) == pixel_crc(other[3][0])
    assert open_handles(tiny_store) == 1


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers_read_every_sample_once_per_epoch(tiny_store, ctx):
    ds = LMDBImageDataset(tiny_store, transform=pixel_crc)
    ds[0]  # the parent opened its handle before forking: workers must not reuse it
    expected = sorted((ds[i][0], ds[i][1]) for i in range(len(ds)))
    loader = DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context=ctx,
                        persistent_workers=True)
    for _ in range(2):
        seen = sorted((int(c), int(t)) for crcs, labels in loader for c, t in zip(crcs, labels))
        assert seen == expected


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_many_concurrent_readers(tiny_store):
    ds = LMDBImageDataset(tiny_store, transform=pixel_crc)
    loader = DataLoader(ds, batch_size=1, num_workers=6, multiprocessing_context="fork")
    assert sorted(int(c) for c, _ in loader) == sorted(ds[i][0] for i in range(len(ds)))


def test_not_a_store(tmp_path):
    with pytest.raises(NotAStoreError, match="does not exist"):
        LMDBImageDataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAStoreError, match="not a fastload store") as err:
        LMDBImageDataset(tmp_path / "empty")
    assert "SRC: your image folder" in str(err.value)


def test_an_image_folder_given_as_a_store_is_told_to_pack_it_beside_itself(tiny_tree, tmp_path):
    """The hint said `fastload convert SRC FOLDER`: followed literally with the image folder, it packed the folder
    into itself ("no class folders found"). It now names the folder as SRC and a store beside it."""
    with pytest.raises(NotAStoreError) as err:
        LMDBImageDataset(tiny_tree)
    assert f"fastload convert {tiny_tree} {tiny_tree.with_name(tiny_tree.name + '.lmdb')}" in str(err.value)


def test_incomplete_store(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.delete(fmt.META_KEY)
        txn.put(fmt.BUILD_KEY, b"{}")
    env.close()
    with pytest.raises(IncompleteStoreError, match="rerun the same `fastload convert`"):
        LMDBImageDataset(store)


def test_newer_format_version(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    env = lmdb.open(str(store), readonly=True, lock=False)
    with env.begin() as txn:
        header = json.loads(txn.get(fmt.META_KEY))
    env.close()
    header["version"] = fmt.FORMAT_VERSION + 1
    put(store, fmt.META_KEY, json.dumps(header).encode())
    with pytest.raises(StoreVersionError, match="pip install --upgrade fastload"):
        LMDBImageDataset(store)


def test_corrupt_sample_names_store_index_and_path(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    put(store, fmt.sample_key(4), b"\xff\xd8\xff garbage")
    ds = LMDBImageDataset(store)
    with pytest.raises(CorruptSampleError) as info:
        ds[4]
    assert f"sample 4 ({ds.samples[4][0]})" in str(info.value)
    assert str(store) in str(info.value)
    assert info.value.index == 4
    err = pickle.loads(pickle.dumps(info.value))  # crosses from DataLoader workers intact
    assert err.index == 4 and err.relpath == ds.samples[4][0]


def test_on_error_skip_uses_next_sample_and_counts(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    put(store, fmt.sample_key(4), b"not an image")
    ds = LMDBImageDataset(store, on_error="skip")
    img, label = ds[4]
    good = LMDBImageDataset(tiny_store)
    assert pixel_crc(img) == pixel_crc(good[5][0]) and label == good[5][1]
    assert ds.skipped == 1


def test_on_error_skip_gives_up_after_20_in_a_row(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for i in range(len(LMDBImageDataset(tiny_store))):
            txn.put(fmt.sample_key(i), b"bad")
    env.close()
    with pytest.raises(TooManyCorruptSamplesError, match="21 consecutive"):
        LMDBImageDataset(store, on_error="skip")[0]


def test_bad_on_error_value(tiny_store):
    with pytest.raises(ValueError, match="Valid values are 'raise', 'skip'"):
        LMDBImageDataset(tiny_store, on_error="ignore")


def test_torchvision_transforms_get_pil_images(tiny_store):
    from torchvision import transforms as T

    ds = LMDBImageDataset(tiny_store, transform=T.Compose([T.Resize((32, 32)), T.ToTensor()]),
                          target_transform=lambda t: t + 100)
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 100
