"""fastload.DataLoader(backend="threads"): coverage, determinism, buffers, on_error, shutdown, errors."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import threading
import time

import lmdb
import pytest
import torch

from ddp import rank_records, torchrun
from fastload.errors import CorruptSampleError
from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.state import mix_seed
from fastload.load.threads import ThreadBatchIterator
from fastload.load.transforms import eval_transform, train_transform
from fastload.store import format as fmt
from helpers import EXIT_TIMER, RenderFails, exit_handler_seconds

N = 24  # tiny_store: 3 classes x 8


class Indexed(torch.utils.data.Dataset):
    """Any map-style dataset: the generic path (dataset[i] in threads + collate)."""

    def __init__(self, n: int = N, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"no sample {i}")
        return torch.tensor([i]), i % 3


def fast_loader(store, threads: int, seed: int | None = 7, **kw) -> DataLoader:
    ds = LMDBImageDataset(store, transform=train_transform(32))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return DataLoader(ds, batch_size=kw.pop("batch_size", 5), shuffle=kw.pop("shuffle", True), num_workers=threads,
                      generator=gen, backend=kw.pop("backend", "threads"), **kw)


def loader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fastload-loader-")]


def wait_no_loader_threads(timeout: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while loader_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    return loader_threads()


def test_every_sample_once_per_epoch_generic_path():
    loader = DataLoader(Indexed(), batch_size=5, shuffle=True, num_workers=3, backend="threads")
    assert len(loader) == 5
    epochs = []
    for _ in range(2):
        batches = list(loader)
        assert [len(b[0]) for b in batches] == [5, 5, 5, 5, 4]
        epochs.append([int(i) for images, _ in batches for i in images[:, 0]])
        assert sorted(epochs[-1]) == list(range(N))
    assert epochs[0] != epochs[1]  # reshuffled


def test_fast_path_every_sample_once_in_sampler_order(tiny_store):
    ds = LMDBImageDataset(tiny_store, transform=eval_transform(32, 36))
    loader = DataLoader(ds, batch_size=7, shuffle=False, num_workers=3, backend="threads")
    batches = list(loader)
    assert [b[0].shape for b in batches] == [(7, 3, 32, 32)] * 3 + [(3, 3, 32, 32)]
    labels = torch.cat([b[1] for b in batches])
    assert labels.dtype == torch.int64 and labels.tolist() == ds.targets
    images = torch.cat([b[0] for b in batches])
    for i in range(N):  # each slot holds exactly its sample
        assert torch.equal(images[i], ds[i][0]), i


def test_fast_path_crops_come_from_per_sample_seeds(tiny_store):
    loader = fast_loader(tiny_store, 2, shuffle=False, batch_size=8)
    it = iter(loader)
    assert isinstance(it, ThreadBatchIterator) and it.fast
    images = torch.cat([b[0] for b in it])
    ds = loader.dataset
    for i in range(N):
        gen = torch.Generator().manual_seed(mix_seed(it.sample_seed, 0, i))
        assert torch.equal(images[i], ds.getitem(i, generator=gen)[0]), i


@pytest.mark.parametrize("target_transform", [None, int], ids=["fast-path", "generic-path"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_batches_and_crops_as_worker_processes(tiny_store, shuffle, target_transform):
    """Both backends seed sample i of epoch e alike: a state saved by one resumes on the other."""
    ds = LMDBImageDataset(tiny_store, transform=train_transform(32), target_transform=target_transform)

    def run(backend, workers):
        loader = DataLoader(ds, batch_size=5, shuffle=shuffle, num_workers=workers, backend=backend,
                            generator=torch.Generator().manual_seed(5))
        return [torch.cat([x for x, _ in loader]) for _ in range(2)]

    assert iter(DataLoader(ds, batch_size=5, num_workers=1, backend="threads")).fast is (target_transform is None)
    threads, processes = run("threads", 2), run("processes", 1)
    assert threads[0].shape == (N, 3, 32, 32) and not torch.equal(threads[0], threads[1])
    assert all(torch.equal(a, b) for a, b in zip(threads, processes))


class _Tagged(LMDBImageDataset):
    """A subclass that changes what ``dataset[i]`` returns: threads must call it, as worker processes do."""

    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label + 100


def test_a_subclass_getitem_runs_in_threads_as_in_processes(tiny_store):
    ds = _Tagged(tiny_store, transform=train_transform(32))
    it = iter(DataLoader(ds, batch_size=4, num_workers=2, backend="threads"))
    assert not it.fast
    labels = torch.cat([y for _, y in it])
    assert labels.min() >= 100 and len(labels) == N


class _SpyTrain(type(train_transform(32))):
    """The train preset, counting the images it wrote into the batch buffer itself."""

    into = 0

    def from_bytes(self, data, generator=None, *, out=None):
        image = super().from_bytes(data, generator, out=out)
        if out is not None and image.data_ptr() == out.data_ptr():
            type(self).into += 1
        return image


class _OwnGetitem(LMDBImageDataset):
    """A subclass with its own getitem that knows nothing of out=: the fast path copies its images."""

    def getitem(self, index, *, generator=None):
        return super().getitem(index, generator=generator)


def test_the_fast_path_lets_the_preset_write_into_the_batch_and_copies_otherwise(tiny_store):
    def batches(ds):
        return [x.clone() for x, _ in DataLoader(ds, batch_size=5, shuffle=True, num_workers=2, backend="threads",
                                                  generator=torch.Generator().manual_seed(3))]

    _SpyTrain.into = 0
    spied = batches(LMDBImageDataset(tiny_store, transform=_SpyTrain(32)))
    assert 0 < _SpyTrain.into < N  # the unflipped ones (the flipped are copied)
    _SpyTrain.into = 0
    copied = batches(_OwnGetitem(tiny_store, transform=_SpyTrain(32)))
    assert _SpyTrain.into == 0
    reference = batches(LMDBImageDataset(tiny_store, transform=train_transform(32)))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(spied, copied, reference))


def test_the_fast_path_plans_runs_of_samples_and_redoes_a_failed_one_with_getitem(tiny_store):
    def batches(ds, threads=2):
        return [x.clone() for x, _ in DataLoader(ds, batch_size=8, shuffle=True, num_workers=threads,
                                                  backend="threads", generator=torch.Generator().manual_seed(4))]

    ds = LMDBImageDataset(tiny_store, transform=train_transform(32))
    it = iter(DataLoader(ds, batch_size=8, num_workers=2, backend="threads"))
    assert it._job.plans and it._runs(8) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # two threads: a run each
    it.close()
    assert not iter(DataLoader(_OwnGetitem(tiny_store, transform=train_transform(32)), batch_size=8,
                               num_workers=2, backend="threads"))._job.plans  # a subclass's getitem runs as is
    reference = batches(ds, threads=0)
    processes = [x for x, _ in DataLoader(ds, batch_size=8, shuffle=True, num_workers=1, backend="processes",
                                          generator=torch.Generator().manual_seed(4))]
    RenderFails.calls = 0
    redone = batches(LMDBImageDataset(tiny_store, transform=RenderFails(32)))
    assert RenderFails.calls >= N // 2
    assert all(torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
               for a, b, c, d in zip(reference, batches(ds), redone, processes))


class _CountedRender(type(train_transform(32))):
    """The train preset noting each render in a file (worker processes write it too)."""

    def __init__(self, size, note) -> None:
        super().__init__(size)
        self.note = str(note)

    def render(self, data, plan, *, out=None):
        with open(self.note, "a") as f:
            f.write("r")
        return super().render(data, plan, out=out)


class _Inverted(type(train_transform(32))):
    """A subclass that changes the pixels in from_bytes alone: its from_bytes must run, not the split."""

    def from_bytes(self, data, generator=None, *, out=None):
        image = super().from_bytes(data, generator)
        return 255 - image


@pytest.mark.parametrize("backend, workers", [("threads", 2), ("processes", 1)])
def test_a_preset_subclass_that_overrides_from_bytes_alone_is_not_planned(tiny_store, backend, workers):
    from fastload.load.transforms import preset_plans

    assert preset_plans(train_transform(32)) and not preset_plans(_Inverted(32))
    ds = LMDBImageDataset(tiny_store, transform=_Inverted(32))
    got = [x for x, _ in DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers, backend=backend,
                                    generator=torch.Generator().manual_seed(6))]
    plain = LMDBImageDataset(tiny_store, transform=train_transform(32))
    ref = [x for x, _ in DataLoader(plain, batch_size=8, shuffle=True, num_workers=0, backend="threads",
                                    generator=torch.Generator().manual_seed(6))]
    assert all(torch.equal(a, 255 - b) for a, b in zip(got, ref))


def test_worker_processes_plan_their_batches_too_with_the_same_crops(tiny_store, tmp_path):
    note = tmp_path / "renders"

    def batches(transform, backend, workers):
        ds = LMDBImageDataset(tiny_store, transform=transform)
        return [x for x, _ in DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers, backend=backend,
                                         generator=torch.Generator().manual_seed(6))]

    planned = batches(_CountedRender(32, note), "processes", 2)
    assert note.read_text().count("r") == N  # every sample of the epoch rendered from a plan
    reference = batches(train_transform(32), "threads", 0)
    RenderFails.calls = 0
    redone = batches(RenderFails(32), "processes", 1)  # every other render fails: getitem redoes it
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(reference, planned, redone))


@pytest.mark.parametrize("other", [0, 3])
def test_same_seed_same_batches_whatever_the_thread_count(tiny_store, other):
    def run(threads):
        loader = fast_loader(tiny_store, threads, seed=11)
        return [[(x.clone(), y.clone()) for x, y in loader] for _ in range(2)]

    one, many = run(1), run(other)
    for e in range(2):
        assert len(one[e]) == len(many[e]) == 5
        for (xa, ya), (xb, yb) in zip(one[e], many[e]):
            assert torch.equal(ya, yb) and torch.equal(xa, xb)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(one[0], one[1]))  # epochs differ
    other_seed = [x for x, _ in fast_loader(tiny_store, 1, seed=12)]
    assert not all(torch.equal(a[0], b) for a, b in zip(one[0], other_seed))


def test_batches_held_by_the_caller_are_never_overwritten(tiny_store):
    kept = [(x, y) for x, y in fast_loader(tiny_store, 3, shuffle=False, batch_size=4, prefetch_factor=1)]
    fresh = [(x.clone(), y) for x, y in fast_loader(tiny_store, 0, shuffle=False, batch_size=4)]
    assert len({x.data_ptr() for x, _ in kept}) == len(kept)  # all held at once: all distinct buffers
    for (xa, ya), (xb, yb) in zip(kept, fresh):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_buffers_are_reused_once_released(tiny_store):
    loader = fast_loader(tiny_store, 2, shuffle=False, batch_size=4, prefetch_factor=1)
    ptrs = []
    for x, _ in loader:
        ptrs.append(x.data_ptr())
        del x
    assert len(ptrs) == 6 and len(set(ptrs)) < len(ptrs)


def test_drop_last_and_sampler(tiny_store):
    loader = fast_loader(tiny_store, 2, batch_size=5, drop_last=True)
    assert [len(y) for _, y in loader] == [5] * 4
    sampler = torch.utils.data.SubsetRandomSampler([1, 3, 5, 7], generator=torch.Generator().manual_seed(0))
    ds = LMDBImageDataset(tiny_store, transform=train_transform(32))
    got = DataLoader(ds, batch_size=3, sampler=sampler, num_workers=2, backend="threads")
    labels = sorted(int(v) for _, y in got for v in y)
    assert labels == sorted(ds.targets[i] for i in (1, 3, 5, 7))


def writable_copy(store, tmp_path):
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(store, dst)
    return dst


def corrupt(store, index: int) -> None:
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(fmt.sample_key(index), b"\xff\xd8\xff not a jpeg")
    env.close()


def test_on_error_skip_replaces_the_bad_sample(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    corrupt(store, 4)
    ds = LMDBImageDataset(store, transform=eval_transform(32, 36), on_error="skip")
    batches = list(DataLoader(ds, batch_size=6, shuffle=False, num_workers=3, backend="threads"))
    images, labels = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert len(labels) == N and ds.skipped == 1
    good = LMDBImageDataset(tiny_store, transform=eval_transform(32, 36))
    assert torch.equal(images[4], good[5][0]) and labels[4] == good.targets[5]  # the next good sample
    assert torch.equal(images[3], good[3][0])


def test_on_error_raise_names_the_sample(tiny_store, tmp_path):
    store = writable_copy(tiny_store, tmp_path)
    corrupt(store, 4)
    ds = LMDBImageDataset(store, transform=train_transform(32))
    with pytest.raises(CorruptSampleError, match=f"sample 4 \\({ds.samples[4][0]}\\)") as info:
        list(DataLoader(ds, batch_size=6, shuffle=False, num_workers=2, backend="threads"))
    del info  # its traceback holds the iterator; once that goes, the pool goes
    gc.collect()
    assert wait_no_loader_threads() == []


def test_generic_dataset_error_reaches_the_caller():
    loader = DataLoader(Indexed(fail_at=7), batch_size=4, num_workers=2, backend="threads")
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError, match="no sample 7"):
        next(it)
    it.close()


def test_torchvision_style_transform_runs_in_threads(tiny_store):
    from torchvision.transforms import v2

    tv = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(24, antialias=True), v2.ToDtype(torch.float32, scale=True)])
    ds = LMDBImageDataset(tiny_store, transform=tv)
    loader = DataLoader(ds, batch_size=8, num_workers=2, backend="threads")
    it = iter(loader)
    assert not it.fast
    shapes = [x.shape for x, _ in it]
    assert shapes == [(8, 3, 24, 24)] * 3


def test_batch_sampler_with_uneven_batches(tiny_store):
    ds = LMDBImageDataset(tiny_store, transform=eval_transform(32, 36))
    batches = [[0, 1, 2], list(range(3, 13)), [13], list(range(14, 24))]
    got = list(DataLoader(ds, batch_sampler=batches, num_workers=2, backend="threads"))
    assert [len(y) for _, y in got] == [3, 10, 1, 10]
    images = torch.cat([x for x, _ in got])
    assert all(torch.equal(images[i], ds[i][0]) for i in range(N))


def test_batch_size_none_gives_single_samples():
    loader = DataLoader(Indexed(6), batch_size=None, num_workers=2, backend="threads")
    got = list(loader)
    assert [int(x[0]) for x, _ in got] == list(range(6))


def test_shutdown_mid_epoch_leaves_no_thread(tiny_store):
    assert wait_no_loader_threads() == []
    loader = fast_loader(tiny_store, 3, batch_size=2)
    it = iter(loader)
    next(it)
    assert len(loader_threads()) == 3
    it.close()
    assert wait_no_loader_threads() == []
    with pytest.raises(StopIteration):
        next(it)
    for i, _ in enumerate(loader):  # a for-loop left with break: the iterator is dropped
        if i == 1:
            break
    gc.collect()
    assert wait_no_loader_threads() == []
    list(loader)  # a full epoch ends its pool too
    assert wait_no_loader_threads() == []


def test_num_workers_0_decodes_in_the_calling_thread(tiny_store):
    it = iter(fast_loader(tiny_store, 0))
    assert it.threads == [] and len(list(it)) == 5 and loader_threads() == []


def test_refuses_what_threads_cannot_honour():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ValueError, match="map-style dataset"):
        DataLoader(Stream(), batch_size=2, num_workers=2, backend="threads")
    with pytest.raises(ValueError, match="worker_init_fn"):
        DataLoader(Indexed(), batch_size=2, num_workers=2, worker_init_fn=print, backend="threads")
    with pytest.raises(ValueError, match="Valid values are 'processes', 'threads'"):
        DataLoader(Indexed(), backend="thread")


@pytest.mark.slow
def test_two_ranks_shard_the_thread_pipeline(tiny_store, tmp_path):
    torchrun("ddp_threads_check.py", 2, tiny_store, tmp_path)
    ranks = rank_records(tmp_path, 2)
    assert all(r["sampler"] == "DistributedSampler" for r in ranks)
    for epoch in range(2):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b) == N // 2 and not set(a) & set(b) and sorted(a + b) == list(range(N))
        la, lb = ranks[0]["labels"][epoch], ranks[1]["labels"][epoch]  # the fast path, same shards
        targets = LMDBImageDataset(tiny_store).targets
        assert la == [targets[i] for i in a] and lb == [targets[i] for i in b]
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]


@pytest.mark.gpu
def test_pinned_batches_survive_async_copies_on_cuda(tiny_store):
    """Pinned buffers come from torch's caching host allocator: a block is handed out again
    only after the side-stream copy recorded on it has finished, so every device batch must
    equal the same batch decoded on the CPU, even while the next batches are being written."""
    from fastload.load.prefetch import DevicePrefetcher, prepare_batch

    host = fast_loader(tiny_store, 3, batch_size=4, pin_memory=True)
    first = next(iter(host))[0]
    assert first.is_pinned()
    reference = [prepare_batch((x.clone(), y), torch.device("cpu"))
                 for x, y in fast_loader(tiny_store, 0, batch_size=4, pin_memory=False)]
    for _ in range(2):  # two epochs: the second reuses the first's pinned blocks
        got = [(x.cpu(), y.cpu()) for x, y in DevicePrefetcher(fast_loader(tiny_store, 3, batch_size=4,
                                                                           pin_memory=True), "cuda")]
        assert len(got) == len(reference) == 6
        for (xa, ya), (xb, yb) in zip(got, reference):
            assert torch.equal(ya, yb) and torch.allclose(xa, xb, atol=1e-5)


def test_loader_threads_run_torch_ops_single_threaded_without_touching_the_callers(tiny_store):
    before = torch.get_num_threads()

    class Probe(Indexed):
        def __getitem__(self, i):
            return torch.tensor([torch.get_num_threads()]), 0

    seen = {int(v) for x, _ in DataLoader(Probe(), batch_size=4, num_workers=2, backend="threads",
                                          main_threads=None) for v in x[:, 0]}
    if torch.__config__.parallel_info().find("OpenMP") >= 0:
        assert seen == {1}
    assert torch.get_num_threads() == before


def test_timeout_raises_instead_of_waiting_forever():
    class Slow(Indexed):
        def __getitem__(self, i):
            time.sleep(1.0 if i == 2 else 0.0)
            return super().__getitem__(i)

    it = iter(DataLoader(Slow(), batch_size=2, num_workers=2, timeout=0.2, backend="threads"))
    next(it)
    with pytest.raises(RuntimeError, match="timed out after 0.2 seconds"):
        next(it)
    it.close()
    assert wait_no_loader_threads() == []


class Stuck(Indexed):
    """Sample 3's read never returns (a hung network file system) until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __getitem__(self, i):
        if i == 3:
            self.release.wait()
        return super().__getitem__(i)


def test_timeout_with_a_stuck_read_raises_within_the_timeout_and_names_the_sample():
    ds = Stuck()
    loader = DataLoader(ds, batch_size=2, num_workers=2, timeout=1, backend="threads")

    def first_error() -> str:
        try:
            for _ in loader:
                pass
        except RuntimeError as exc:
            return str(exc)  # leaving the handler drops the error, its traceback and the iterator
        return "no error"

    start = time.monotonic()
    err = first_error()
    elapsed = time.monotonic() - start  # until the caller can go on: dropping the iterator must not wait
    assert elapsed < 1 + 1.5, f"the caller got the timeout error and went on after {elapsed:.1f} s"
    assert "timed out after 1 seconds (samples still being read: [3])" in err and "HINT" in err
    ds.release.set()  # the stuck thread returns and ends on its own
    assert wait_no_loader_threads() == []


# a script's dataset whose sample 3 never returns (the script imports threading and torch)
STUCK_SCRIPT_DATASET = ("class Stuck(torch.utils.data.Dataset):\n"
                        "    def __len__(self): return 8\n"
                        "    def __getitem__(self, i):\n"
                        "        if i == 3: threading.Event().wait()  # never returns\n"
                        "        return torch.tensor([i])\n")


def test_a_process_whose_loader_thread_is_stuck_forever_still_exits(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(
        EXIT_TIMER +  # its exit handler runs last, after fastload's
        "import threading, torch\n"
        "from fastload.load.loader import DataLoader\n"
        + STUCK_SCRIPT_DATASET +
        "t = time.monotonic()\n"
        "try:\n"
        "    list(DataLoader(Stuck(), batch_size=2, num_workers=2, timeout=1, backend='threads'))\n"
        "except RuntimeError as exc:\n"
        "    print('raised', round(time.monotonic() - t, 1), str(exc).splitlines()[0], flush=True)\n"
        "    saved = exc  # kept, as a logger or sys.last_value would: the iterator stays alive until exit\n"
        "print('leaving', time.time(), flush=True)\n")
    out, waited = exit_handler_seconds(script)  # it exited at all (the stuck read never returns)
    assert "timed out after 1 seconds" in out
    raised_after = float(out.split()[1])
    assert raised_after < 2.5, out
    # the exit handlers (fastload's iterator finaliser among them) must not wait for the stuck thread
    assert waited < 2.0, f"the exit handlers took {waited:.1f} s"


@pytest.mark.slow  # the script runs three times (exits_cleanly): 10-18 s, in CI's slow suite
def test_a_script_that_ends_with_an_iterator_mid_epoch_exits_cleanly(tmp_path):
    # CPython ends daemon threads with pthread_exit while it finalises; a loader thread caught inside a
    # torch or decoder call then unwinds through C++ frames, and the process aborted ("terminate called
    # without an active exception", exit status 134) in 5 of 6 runs on real photos. Large images keep the
    # threads inside those calls when the script returns; the exit must stop the pool first.
    from fastload.datasets import DatasetSpec, make_dataset
    from fastload.pack.convert import ConvertOptions, convert

    tree = make_dataset(tmp_path / "tree", DatasetSpec(num_classes=2, per_class=16, min_side=700, max_side=1000,
                                                       png_every=0, seed=3), workers=1)
    store = tmp_path / "big.lmdb"
    convert(tree, store, ConvertOptions(progress=False, workers=2, lossless=True))
    script = tmp_path / "leave.py"
    script.write_text(
        "import sys, torch\n"
        "from fastload.load.dataset import LMDBImageDataset\n"
        "from fastload.load.loader import DataLoader\n"
        "from fastload.load.transforms import train_transform\n"
        "ds = LMDBImageDataset(sys.argv[1], transform=train_transform(224))\n"
        "it = iter(DataLoader(ds, batch_size=2, shuffle=True, num_workers=2, backend='threads',\n"
        "                     prefetch_factor=4))\n"
        "next(it)\n"
        "print('left with the iterator alive', flush=True)\n")
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(script), str(store)], capture_output=True, text=True, timeout=120)
        assert "left with the iterator alive" in proc.stdout, proc.stderr
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, (proc.returncode, proc.stderr)


def test_stuck_iterators_alive_at_exit_share_one_exit_budget(tmp_path):
    # each live iterator's finaliser waited JOIN_TIMEOUT_S for its stuck thread: 4 iterators, 4 times as long
    script = tmp_path / "stuck4.py"
    script.write_text(
        EXIT_TIMER +  # its exit handler runs last, after fastload's
        "import threading, torch\n"
        "import fastload.exiting, fastload.load.threads\n"
        "from fastload.load.loader import DataLoader\n"
        "fastload.load.threads.JOIN_TIMEOUT_S = 1.5  # per pool\n"
        "fastload.exiting.EXIT_BUDGET_S = 1.0  # all of them\n"
        + STUCK_SCRIPT_DATASET +
        "its = [iter(DataLoader(Stuck(), batch_size=2, num_workers=2, backend='threads')) for _ in range(4)]\n"
        "time.sleep(0.5)  # every pool has a thread inside sample 3\n"
        "print('leaving', time.time(), flush=True)\n")
    out, waited = exit_handler_seconds(script)
    # one budget of 1 s for the four pools, not 4 x 1.5 s
    assert 0.8 < waited < 3.0, f"the exit handlers took {waited:.1f} s: {out}"


@pytest.mark.parametrize("backend, threads", [("threads", 2), ("threads", 0), ("processes", 2)])
def test_a_channels_last_preset_gives_channels_last_batches_of_the_same_values(tiny_store, backend, threads):
    def batches(channels_last: bool, collate):
        ds = LMDBImageDataset(tiny_store, transform=train_transform(32, channels_last=channels_last))
        return list(DataLoader(ds, batch_size=5, shuffle=True, num_workers=threads, backend=backend,
                               generator=torch.Generator().manual_seed(3), collate_fn=collate))

    from fastload.load.transforms import collate_uint8

    planar, cl = batches(False, collate_uint8), batches(True, collate_uint8)
    assert len(planar) == len(cl) == 5
    for (a, la), (b, lb) in zip(planar, cl):
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last) and not b.is_contiguous()
        assert torch.equal(a, b) and torch.equal(la, lb)
    # torch's default_collate makes contiguous batches whatever the samples' layout: so does the fast path
    for (a, _), (b, _) in zip(planar, batches(True, None)):
        assert b.is_contiguous() and torch.equal(a, b)


def test_batches_whose_storage_alone_is_held_are_never_overwritten(tiny_store):
    # torch's storage use count misses a bare storage object: the pool must see it too
    stores = [x.untyped_storage() for x, _ in fast_loader(tiny_store, 2, shuffle=False, batch_size=4,
                                                             prefetch_factor=1)]
    assert len({st.data_ptr() for st in stores}) == len(stores) == 6


def test_a_batch_shared_with_another_process_leaves_the_pool(tiny_store):
    loader = fast_loader(tiny_store, 2, shuffle=False, batch_size=4, prefetch_factor=1)
    it = iter(loader)
    first, _ = next(it)
    first.share_memory_()  # as a torch.multiprocessing queue does: another process may read it
    del first
    for _ in it:
        pass
    assert it._buffers.pool and not any(buf.is_shared() for buf, _ in it._buffers.pool)
