"""Worker processes reuse their batches' shared memory once the main process let go (``batch_pool.py``):
the same batches as fresh segments, none overwritten while any tensor still views it."""

from __future__ import annotations

import gc
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fastload.load import batch_pool
from fastload.load.batch_pool import PooledBatch, PooledCollate, slots_for
from fastload.load.loader import DataLoader
from fastload.load.transforms import collate_uint8


class Indexed(torch.utils.data.Dataset):
    """Image ``i``: every pixel of channel ``c`` is ``(i + 7 * c) % 256``, laid out planar or channels-last."""

    def __init__(self, n: int = 64, channels_last: bool = False, size: int = 8) -> None:
        self.n, self.channels_last, self.size = n, channels_last, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        img = torch.stack([torch.full((self.size, self.size), (i + 7 * c) % 256, dtype=torch.uint8)
                           for c in range(3)])
        if self.channels_last:
            img = img.permute(1, 2, 0).contiguous().permute(2, 0, 1)
        return img, i


def expected(labels: torch.Tensor, size: int = 8) -> torch.Tensor:
    return torch.stack([torch.stack([torch.full((size, size), (int(i) + 7 * c) % 256, dtype=torch.uint8)
                                     for c in range(3)]) for i in labels])


def segment(t: torch.Tensor) -> str:
    """The shared-memory file this process maps ``t``'s storage from (one per segment a worker made)."""
    addr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return f"{parts[5] if len(parts) > 5 else '?'}:{parts[4]}"
    raise AssertionError("storage not mapped")


@pytest.mark.parametrize("channels_last", [False, True])
def test_reused_segments_give_the_same_batches_and_a_held_batch_is_never_overwritten(channels_last):
    ds = Indexed(64, channels_last)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False)
    plain = [b for b in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False,
                                   reuse_batch_memory=False)]
    held, views, segments = [], [], set()
    for epoch in range(2):
        for k, (images, labels) in enumerate(loader):
            assert torch.equal(images, plain[k][0]) and torch.equal(labels, plain[k][1])
            assert images.is_contiguous(memory_format=torch.channels_last if channels_last
                                        else torch.contiguous_format)
            segments.add(segment(images))
            if epoch == 0 and k % 5 == 0:
                held.append((images, labels))  # kept to the end: its segment must not be written again
            if epoch == 0 and k % 5 == 1:
                views.append((images[1], int(labels[1])))  # a view keeps the whole segment
            del images, labels
    for images, labels in held:
        assert torch.equal(images, expected(labels))
    for image, label in views:
        assert torch.equal(image, expected(torch.tensor([label]))[0])
    # 32 batches in two epochs from far fewer segments: each worker's own, plus the ones the held batches keep
    assert len(segments) <= 2 * 2 * slots_for(None) + len(held) + len(views) < 32, len(segments)


@pytest.mark.parametrize("how", ["fork", "spawn", "file_system"])
def test_every_segment_is_free_again_once_the_batches_are_gone(how, monkeypatch):
    if how == "file_system":  # torch's other sharing strategy: segments by name, not by descriptor
        monkeypatch.setattr(torch.multiprocessing, "_sharing_strategy", "file_system")
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    loader = DataLoader(Indexed(48), batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False,
                        persistent_workers=True, multiprocessing_context="spawn" if how == "spawn" else None)
    it = iter(loader)
    pool = it._collate_fn
    assert isinstance(pool, PooledCollate)
    for images, labels in it:
        assert torch.equal(images, expected(labels))
    del images, labels
    gc.collect()
    assert pool.flags.tolist() == [0] * (2 * slots_for(None))
    kept = [batch for batch in loader]  # the persistent workers' second epoch, every batch held
    assert all(torch.equal(images, expected(labels)) for images, labels in kept)
    assert pool.flags.sum() > 0
    del kept
    gc.collect()
    assert pool.flags.tolist() == [0] * (2 * slots_for(None))


def test_with_no_room_for_a_segment_the_batch_is_made_as_collate_uint8_makes_it(in_worker, monkeypatch):
    def full(*a, **k):
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device")

    pool = PooledCollate(workers=2, slots=2)
    monkeypatch.setattr(batch_pool, "_new_segment", full)  # the pool's; collate_uint8's own still has room
    out = pool([Indexed(2)[i] for i in range(2)])
    assert type(out) is tuple and torch.equal(out[0], expected(out[1])) and pool.flags.tolist() == [0] * 4


def test_this_torch_runs_the_finalizer_when_the_last_view_goes():
    assert batch_pool.release_is_tracked()


def test_without_reuse_every_batch_is_a_fresh_segment():
    loader = DataLoader(Indexed(32), batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False,
                        reuse_batch_memory=False)
    assert len({segment(images) for images, _ in loader}) == 8


def test_other_collates_and_the_threads_backend_are_left_alone():
    loader = DataLoader(Indexed(16), batch_size=4, num_workers=2, pin_memory=False)  # torch's default_collate
    assert len({segment(images) for images, _ in loader}) == 4
    assert loader.collate_fn is not collate_uint8 and not isinstance(loader.collate_fn, PooledCollate)
    loader = DataLoader(Indexed(16), batch_size=4, num_workers=2, collate_fn=collate_uint8, backend="threads")
    assert [torch.equal(images, expected(labels)) for images, labels in loader] == [True] * 4
    assert loader.collate_fn is collate_uint8


@pytest.fixture
def in_worker(monkeypatch):
    """``get_worker_info()`` says worker 1 of 2, in this process."""
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))


def sent(batch):
    """``batch`` as the main process receives it: what ``PooledBatch``'s pickle calls, with the segment (on its
    first batch) mapped again, a storage of its own, as ``rebuild_storage_fd`` makes it in another process
    (unpickled in this one, torch would hand back the worker's own storage object). A plain batch: its images
    mapped again."""
    images, labels = batch
    if not isinstance(batch, PooledBatch):
        fd, size = images.untyped_storage()._share_fd_cpu_()
        storage = torch.UntypedStorage._new_shared_fd_cpu(os.dup(fd), size)
        return torch.empty(0, dtype=torch.uint8).set_(storage, images.storage_offset(), images.shape,
                                                      images.stride()), labels.clone()
    rebuild, (segment, generation, shape, strides, labels, token, index) = batch.__reduce__()
    assert isinstance(labels, np.ndarray)  # by value: no shared-memory segment of their own per batch
    assert rebuild is batch_pool._received and (token, index, generation) == (batch.token, batch.index,
                                                                                batch.generation)
    if segment is not None:
        fd, size = segment._share_fd_cpu_()
        segment = torch.UntypedStorage._new_shared_fd_cpu(os.dup(fd), size)
    return rebuild(segment, generation, shape, strides, labels.copy(), token, index)


def test_a_segment_is_free_again_only_when_every_tensor_on_it_is_gone(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    samples = [Indexed(4)[i] for i in range(4)]
    first = pool(samples)
    assert isinstance(first, PooledBatch) and first.index in (2, 3)  # worker 1's places
    images, labels = received = sent(first)
    assert type(received) is tuple and torch.equal(images, expected(labels))
    del first, received
    view = images[2:]
    del images
    gc.collect()
    assert pool.flags.tolist() == [0, 0, 1, 0]  # the view still holds the segment
    second = pool(samples)  # the other place
    assert second.index == 3 and pool.flags.tolist() == [0, 0, 1, 1]
    third = pool(samples)  # no place free: a fresh segment, a plain batch, nothing taken
    assert type(third) is tuple and torch.equal(third[0], expected(third[1]))
    assert torch.equal(view, expected(labels)[2:])
    del view
    gc.collect()
    assert pool.flags.tolist() == [0, 0, 0, 1]
    again = pool(samples)
    assert again.index == 2 and again[0].untyped_storage().data_ptr() == pool._segments[2].data_ptr()


def test_a_smaller_batch_goes_into_a_larger_segment_and_a_larger_one_gets_a_segment_of_its_size(in_worker):
    pool = PooledCollate(workers=2, slots=1)  # one place per worker
    full = sent(pool([Indexed(4)[i] for i in range(4)]))
    del full
    gc.collect()
    last = pool([Indexed(4)[i] for i in range(3)])  # the epoch's short last batch: the full batch's segment
    assert not last.first and pool._segments[1].nbytes() == 4 * 192
    last = sent(last)
    assert last[0].shape == (3, 3, 8, 8) and torch.equal(last[0], expected(last[1]))
    del last
    gc.collect()
    big = pool([Indexed(8)[i] for i in range(8)])  # larger than the free segment: a new one replaces it
    assert big.first and pool._segments[1].nbytes() == 8 * 192
    big = sent(big)
    assert torch.equal(big[0], expected(big[1]))


def test_a_failed_collate_gives_its_segment_back_and_raises_as_collate_uint8(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    bad = [Indexed(2)[0], (torch.zeros(3, 8, 8, dtype=torch.uint8), "not a label")]
    with pytest.raises(ValueError):
        pool(bad)
    assert pool.flags.tolist() == [0, 0, 0, 0]
    with pytest.raises(TypeError, match="collate_uint8 expects uint8 CHW tensors"):
        pool([(torch.zeros(3, 8, 8), 0)])


def test_unpickled_where_the_pool_is_unknown_the_segment_stays_taken(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    batch = pool([Indexed(2)[i] for i in range(2)])
    del batch_pool._FLAGS[pool.token]  # as in a process that did not make this pool
    images, _ = sent(batch)
    del images
    gc.collect()
    gc.collect()
    assert pool.flags.tolist()[2:] == [1, 0]  # never reused: nothing can tell when it is let go


def test_only_a_segments_first_batch_carries_it_and_later_ones_use_the_kept_mapping(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    samples = [Indexed(4)[i] for i in range(4)]
    first = pool(samples)
    assert first.first and first.generation == 1
    images, labels = sent(first)
    mapped = images.untyped_storage().data_ptr()
    assert batch_pool._KEPT[pool.token][first.index][1].data_ptr() == mapped  # this process's own mapping, kept
    del first, images
    gc.collect()
    again = pool([Indexed(8)[i] for i in range(4, 8)])  # the same place, free again
    assert again.index == 2 and not again.first and again.__reduce__()[1][0] is None  # no segment travels
    images, labels = sent(again)
    assert images.untyped_storage().data_ptr() == mapped and torch.equal(images, expected(labels))
    assert labels.tolist() == [4, 5, 6, 7]


def test_a_short_batch_in_an_empty_place_gets_a_full_segment_that_is_never_replaced(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    held = sent(pool([Indexed(4)[i] for i in range(4)]))  # held: the short batch finds only an empty place
    short = pool([Indexed(4)[i] for i in range(3)])
    assert short.index == 3 and pool._segments[3].nbytes() == 4 * 192
    short = sent(short)
    assert torch.equal(short[0], expected(short[1]))
    del short
    gc.collect()
    again = pool([Indexed(8)[i] for i in range(4, 8)])  # a full batch in the short batch's place
    assert again.index == 3 and not again.first and again.generation == 1
    assert torch.equal(held[0], expected(held[1]))


def test_a_new_segment_at_a_place_travels_again(in_worker):
    pool = PooledCollate(workers=2, slots=1)  # one place per worker: the new segment replaces the old there
    small = sent(pool([Indexed(4)[i] for i in range(3)]))
    del small
    gc.collect()
    full = pool([Indexed(4)[i] for i in range(4)])  # larger: a new segment at the same place
    assert full.index == 1 and full.first and full.generation == 2
    images, labels = sent(full)
    assert torch.equal(images, expected(labels))
    kept = batch_pool._KEPT[pool.token][full.index]
    assert kept[0] == full.generation and kept[1].nbytes() == 4 * 192


def test_a_batch_in_a_segment_this_process_never_received_is_a_named_error(in_worker):
    pool = PooledCollate(workers=2, slots=2)
    first = pool([Indexed(2)[i] for i in range(2)])
    received = sent(first)
    del first, received
    gc.collect()
    batch_pool._KEPT[pool.token].clear()  # as if the first batch had been unpickled in another process
    with pytest.raises(RuntimeError, match="reuse_batch_memory=False"):
        sent(pool([Indexed(2)[i] for i in range(2)]))


def test_the_kept_segments_go_with_their_pool():
    pool = PooledCollate(workers=1, slots=2)
    token = pool.token
    assert token in batch_pool._KEPT
    del pool
    gc.collect()
    assert token not in batch_pool._KEPT


def test_over_epochs_each_segment_travels_once(monkeypatch):
    loader = DataLoader(Indexed(32), batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False,
                        persistent_workers=True)
    it = iter(loader)  # the workers are running: what they pickle is unpickled through this module's name
    carried: list[bool] = []
    received = batch_pool._received
    monkeypatch.setattr(batch_pool, "_received", lambda segment, *a: (carried.append(segment is not None),
                                                                     received(segment, *a))[1])
    ok = [torch.equal(images, expected(labels)) for images, labels in it]
    ok += [torch.equal(images, expected(labels)) for _ in range(2) for images, labels in loader]
    assert ok == [True] * 24 and len(carried) == 24
    assert 2 <= sum(carried) <= 2 * slots_for(None)  # each worker's segments, once each


def test_outside_a_worker_it_is_collate_uint8():
    pool = PooledCollate(workers=1, slots=2)
    out = pool([Indexed(2)[i] for i in range(2)])
    assert type(out) is tuple and torch.equal(out[0], expected(out[1])) and not pool._segments


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_pinned_memory_the_segments_are_reused_and_the_batches_the_same():
    # the pin-memory thread unpickles the batch and drops it once copied: the segment is freed there
    ds = Indexed(64)
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=True)
    it = iter(loader)
    pool = it._collate_fn
    assert isinstance(pool, PooledCollate)
    for images, labels in it:
        assert images.is_pinned() and torch.equal(images, expected(labels))
    del images, labels
    gc.collect()
    assert pool.flags.tolist() == [0] * (2 * slots_for(None))  # every segment freed by the pin thread


# A preset that plans (``train_transform``; ``eval_transform`` does not) on a fastload store: the worker renders each
# image straight into its slot of the reused segment (``dataset.PlannedBatch``), with no image of its own

N = 24  # tiny_store: 3 classes x 8


def _store_batches(store, backend: str, workers: int, *, channels_last: bool = False, transform=None,
                   reuse: bool = True, on_error: str = "raise", batch_size: int = 5):
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(store, transform=transform or train_transform(32, channels_last=channels_last),
                          on_error=on_error)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers, backend=backend,
                        collate_fn=collate_uint8, pin_memory=False, reuse_batch_memory=reuse,
                        generator=torch.Generator().manual_seed(4))
    return [(x.clone(), y.clone()) for x, y in loader]


@pytest.fixture
def writes_noted(tmp_path, monkeypatch):
    """Each ``PlannedBatch.write_into`` in a (forked) worker appends a line to a file: what the test reads."""
    from fastload.load.dataset import PlannedBatch

    note = tmp_path / "writes"
    note.touch()
    original = PlannedBatch.write_into

    def noted(self, out):
        with open(note, "a") as f:
            f.write(f"{len(self)} {int(out.untyped_storage().nbytes())}\n")
        return original(self, out)

    monkeypatch.setattr(PlannedBatch, "write_into", noted)
    return note


@pytest.mark.parametrize("channels_last", [False, True], ids=["planar", "channels-last"])
def test_a_planning_preset_renders_into_the_reused_batch_with_the_same_crops(tiny_store, writes_noted,
                                                                             channels_last):
    reference = _store_batches(tiny_store, "threads", 0, channels_last=channels_last)
    fresh = _store_batches(tiny_store, "processes", 2, channels_last=channels_last, reuse=False)
    assert writes_noted.read_text() == ""  # no pool, no rendering into it: each image its own tensor
    pooled = _store_batches(tiny_store, "processes", 2, channels_last=channels_last)
    writes = writes_noted.read_text().split("\n")[:-1]
    # every batch written in place: 4 of 5 samples, and the last of 4 into a full batch's segment
    assert sorted(writes) == sorted(["5 15360"] * 4 + ["4 15360"]), writes
    assert len(pooled) == len(reference) == 5
    for (a, la), (b, lb), (c, lc) in zip(reference, fresh, pooled):
        assert torch.equal(a, c) and torch.equal(b, c) and torch.equal(la, lc) and torch.equal(lb, lc)
        assert c.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_a_bad_sample_rendered_into_the_batch_is_skipped_or_named_as_elsewhere(tiny_store, tmp_path, writes_noted):
    from fastload.errors import CorruptSampleError
    from helpers import copy_tree, put_undecodable

    store = copy_tree(tiny_store, tmp_path / "copy.lmdb")
    put_undecodable(store, 4)
    skipped = _store_batches(store, "processes", 2, on_error="skip")
    assert writes_noted.read_text().count("\n") == 5  # the bad sample too was redone into its slot
    assert all(torch.equal(a, b) and torch.equal(la, lb)
               for (a, la), (b, lb) in zip(_store_batches(store, "threads", 0, on_error="skip"), skipped))
    assert sum(len(y) for _, y in skipped) == N
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(store, transform=train_transform(32))
    loader = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=collate_uint8, pin_memory=False,
                        persistent_workers=True)
    it = iter(loader)
    pool = it._collate_fn
    with pytest.raises(CorruptSampleError, match=f"sample 4 \\({ds.samples[4][0]}\\)"):
        for _ in it:
            pass
    # batch 0 (samples 0-5) failed in worker 0 and gave its segment back; the workers' next batches (2 for worker
    # 0, 1 and 3 for worker 1) hold theirs, unreceived: once both workers have made them, worker 0 holds one
    slots, deadline = slots_for(None), time.monotonic() + 30
    while (pool.flags[:slots].sum() < 1 or pool.flags[slots:].sum() < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.flags[:slots].sum() == 1 and pool.flags[slots:].sum() == 2, pool.flags.tolist()
    del it
    gc.collect()


def test_a_planned_batch_read_as_a_list_is_what_it_writes_into_a_batch(tiny_store):
    from fastload.load.dataset import LMDBImageDataset, PlannedBatch
    from fastload.load.transforms import train_transform

    for transform in (train_transform(32), train_transform(32, channels_last=True)):
        ds = LMDBImageDataset(tiny_store, transform=transform)
        indices, seeds = list(range(3, 14)), [100 + i for i in range(11)]
        n, c, h, w, channels_last = PlannedBatch(ds, indices, seeds).layout()
        assert (n, c, h, w, channels_last) == (11, 3, 32, 32, getattr(transform, "channels_last", False))
        out = torch.empty((n, c, h, w), dtype=torch.uint8,
                          memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        labels = PlannedBatch(ds, indices, seeds).write_into(out)
        as_list = PlannedBatch(ds, indices, seeds)
        assert [int(y) for _, y in as_list] == labels == [ds.targets[i] for i in indices]
        assert torch.equal(torch.stack([x for x, _ in as_list]), out)
        assert as_list.layout() is None  # made already: a collate takes it as the list it is now


def test_a_train_transform_subclass_is_stacked_from_its_own_images_as_before(tiny_store):
    from fastload.load.transforms import TrainTransform

    class Padded(TrainTransform):  # its images are not size x size: the batch is made from them, as before
        def render(self, data, plan, *, out=None):
            return torch.nn.functional.pad(super().render(data, plan), (1, 1, 1, 1))

    pooled, fresh = (_store_batches(tiny_store, "processes", 2, transform=Padded(32), reuse=r) for r in (True, False))
    assert [tuple(x.shape) for x, _ in pooled] == [(5, 3, 34, 34)] * 4 + [(4, 3, 34, 34)]
    assert all(torch.equal(a, b) and torch.equal(la, lb) for (a, la), (b, lb) in zip(pooled, fresh))


def test_a_bad_index_in_a_planned_batch_is_the_readers_error(tiny_store):
    from fastload.load.dataset import LMDBImageDataset, PlannedBatch
    from fastload.load.transforms import train_transform

    ds = LMDBImageDataset(tiny_store, transform=train_transform(32))
    with pytest.raises(IndexError, match="index 30 out of range for 24 samples"):
        [b[0] for b in PlannedBatch(ds, [2, 30], [1, 2])]


def test_where_dev_shm_cannot_hold_every_workers_segments_each_batch_is_a_fresh_one(monkeypatch):
    from fastload.load import workers

    batch = 4 * 3 * 8 * 8 + 4 * 8  # what the loader reckons a batch of four 8 px images holds, labels included
    loader = DataLoader(Indexed(16), batch_size=4, num_workers=2, collate_fn=collate_uint8, pin_memory=False)
    loader._batch_bytes = batch
    room = 2 * slots_for(None) * batch
    monkeypatch.setattr(batch_pool, "shm_space", lambda path=workers.SHM_PATH: (1 << 30, room))
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: (1 << 30, room))
    it = iter(loader)
    assert isinstance(it._collate_fn, PooledCollate)  # room for all of them: pooled
    assert all(torch.equal(images, expected(labels)) for images, labels in it)
    monkeypatch.setattr(batch_pool, "shm_space", lambda path=workers.SHM_PATH: (1 << 30, room - 1))
    monkeypatch.setattr(workers, "shm_space", lambda path=workers.SHM_PATH: (1 << 30, room - 1))
    it = iter(loader)  # room for the batches in flight (check_shm passes), not for segments kept besides
    assert it._collate_fn is collate_uint8
    assert len({segment(images) for images, _ in it}) == 4
    assert batch_pool.pool_fits(2, 4, None) and batch_pool.pool_fits(2, 4, 10, path="/no/such/dir")
