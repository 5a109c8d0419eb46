"""store/readers.py: one ``Reader`` seam for local and remote stores, the sampler chosen from what the
reader declares, one cache root; and what a new storage scheme takes (a reader and one
``register_scheme`` call, nothing above ``store/``)."""

from __future__ import annotations

import pytest
import torch

import fastload
from fastload.errors import RemoteStoreError
from fastload.load.shards import ShardSampler
from fastload.store import readers
from fastload.store.reader import StoreReader
from fastload.store.readers import Reader, ReaderOptions, open_store_reader, register_scheme
from fastload.store.remote_store import default_cache_dir
from helpers import jpeg_bytes, photo


class MemoryReader:
    """A tiny example of a new storage scheme: ``mem://NAME`` reads JPEGs held in this process."""

    stores: dict[str, list[tuple[bytes, int]]] = {}

    def __init__(self, url: str, options: ReaderOptions) -> None:
        self.records = self.stores[url.removeprefix("mem://")]
        self.classes = ["a", "b"]
        self.shard_ordered = options.open_shards is not None  # the test's own switch, declared per reader

    def __len__(self) -> int:
        return len(self.records)

    @property
    def shard_sizes(self) -> list[int]:
        return [2] * (len(self) // 2)

    def get(self, index: int, *, verify: bool | None = None) -> bytes:
        return self.records[index][0]

    def label(self, index: int) -> int:
        return self.records[index][1]

    def relpath(self, index: int) -> str:
        return f"{self.classes[self.label(index)]}/{index}.jpg"

    def sample_index(self):
        return [r[1] for r in self.records], [self.relpath(i) for i in range(len(self))]

    def prefetch_shards(self, shards: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def mem_scheme(monkeypatch):
    monkeypatch.setattr(readers, "_OPENERS", dict(readers._OPENERS))  # the registration ends with the test
    MemoryReader.stores["eight"] = [(jpeg_bytes(photo(40, 30, seed=i)), i % 2) for i in range(8)]
    register_scheme("mem", MemoryReader)
    yield
    MemoryReader.stores.clear()


def test_a_new_scheme_is_one_reader_and_one_registration(mem_scheme):
    """Nothing in load/ changes: the dataset, its ImageFolder attributes and the loader read it."""
    reader = open_store_reader("mem://eight")
    assert isinstance(reader, Reader) and isinstance(reader, MemoryReader)
    ds = fastload.LMDBImageDataset("mem://eight", transform=fastload.eval_transform(size=16))
    assert ds.targets == [0, 1] * 4 and ds.samples[3] == ("b/3.jpg", 1) and len(ds) == 8
    images, labels = next(iter(fastload.DataLoader(ds, batch_size=8, num_workers=0)))
    assert images.shape == (8, 3, 16, 16) and images.dtype == torch.uint8 and labels.tolist() == [0, 1] * 4


@pytest.mark.parametrize("shard_ordered", [False, True])
def test_the_loader_picks_its_sampler_from_what_the_reader_declares(mem_scheme, shard_ordered):
    ds = fastload.LMDBImageDataset("mem://eight")
    if shard_ordered:  # the same scheme, a reader that declares it reads shard by shard
        ds._reader = MemoryReader("mem://eight", ReaderOptions(open_shards=1))
    loader = fastload.DataLoader(ds, batch_size=2, shuffle=True, num_workers=0)
    assert isinstance(loader.sampler, ShardSampler) == shard_ordered


def test_a_flag_named_remote_on_another_dataset_picks_no_shard_sampler():
    """The choice comes from the reader, not from an attribute a user's own dataset may carry."""
    class Plain(torch.utils.data.Dataset):
        remote = True  # means something else to its author

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(1), i

    loader = fastload.DataLoader(Plain(), batch_size=2, shuffle=True, num_workers=0)
    assert not isinstance(loader.sampler, ShardSampler)


def test_the_local_reader_keeps_the_protocol_and_declares_random_reads(tmp_path):
    src = tmp_path / "src"
    for i in range(4):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        photo(32, 24, seed=i).save(src / f"c{i % 2}" / f"{i}.jpg")
    fastload.convert(src, tmp_path / "store")
    reader = open_store_reader(tmp_path / "store")
    assert isinstance(reader, StoreReader) and isinstance(reader, Reader) and not reader.shard_ordered
    assert reader.shard_sizes == [4] and reader.sample_index() == ([0, 0, 1, 1], ["c0/0.jpg", "c0/2.jpg",
                                                                                   "c1/1.jpg", "c1/3.jpg"])
    with pytest.raises(ValueError, match="cache_dir and cache_limit are for stores in object storage"):
        open_store_reader(tmp_path / "store", ReaderOptions(cache_limit="1GB"))


def test_a_url_of_no_registered_scheme_is_refused_not_taken_for_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RemoteStoreError, match="mem:// is not a supported scheme"):
        open_store_reader("mem://eight")
    assert not (tmp_path / "mem:").exists()
    with pytest.raises(ValueError, match="is not a URL scheme"):
        register_scheme("no scheme", MemoryReader)


def test_the_shard_cache_lives_in_the_one_cache_folder(tmp_path, monkeypatch):
    """FASTLOAD_CACHE moves the generated dataset and the shard cache alike (it moved only the first)."""
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" / "shards" == fastload.datasets.cache_dir() / "shards"
    monkeypatch.delenv("FASTLOAD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "fastload" / "shards"
