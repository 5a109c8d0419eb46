"""ShardSampler: the split over ranks, the window shuffle, exact and elastic resume, and the loader hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastload
from fastload.errors import ResumeStateError
from fastload.load.shards import ShardSampler

SIZES = [10, 10, 7, 10, 3, 10, 12, 9]
N = sum(SIZES)
STARTS = np.cumsum([0] + SIZES)


def ranks(world, **kw):
    return [ShardSampler(SIZES, num_replicas=world, rank=r, **kw) for r in range(world)]


def shard(i):
    return int(np.searchsorted(STARTS, i, side="right") - 1)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_disjoint_covering_equal(world, drop_last):
    orders = [list(s) for s in ranks(world, seed=3, drop_last=drop_last)]
    lengths = {len(o) for o in orders}
    assert len(lengths) == 1 and lengths == {len(ranks(world, drop_last=drop_last)[0])}
    flat = sum(orders, [])
    if drop_last:
        assert len(flat) == len(set(flat)) == N // world * world
    else:
        assert set(flat) == set(range(N)) and len(flat) == -(-N // world) * world
        assert len(flat) - len(set(flat)) < world  # only the padding repeats


def test_deterministic_per_seed_and_epoch():
    a, b = ShardSampler(SIZES, seed=1), ShardSampler(SIZES, seed=1)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    assert list(ShardSampler(SIZES, seed=2)) != list(a)
    assert list(ShardSampler(SIZES, shuffle=False)) == list(range(N))


def test_each_rank_reads_a_run_of_shards_window_by_window():
    for world in (2, 4):
        for s in ranks(world, seed=5, window=2):
            order = list(s)
            touched = [shard(i) for i in order]
            distinct = list(dict.fromkeys(touched))
            assert len(distinct) <= -(-len(SIZES) // world) + 2
            # once a window of 2 shards is left, none of its shards comes back
            seen_windows = []
            for sh in touched:
                if not seen_windows or sh not in seen_windows[-1]:
                    if len(seen_windows) and len(seen_windows[-1]) < 2:
                        seen_windows[-1].add(sh)
                    else:
                        seen_windows.append({sh})
            assert sum(len(w) for w in seen_windows) == len(distinct)


def test_prefetch_is_told_the_first_window_then_the_next_one():
    told = []
    s = ShardSampler(SIZES, seed=0, window=2, prefetch=told.append)
    order = list(s)
    seq = list(dict.fromkeys(shard(i) for i in order))
    # the first window's own shards before the second's (else they share a slow link and the first batch
    # waits for both), then the next window's as each window starts
    assert told == [seq[i:i + 2] for i in range(0, len(seq), 2)]


@pytest.mark.parametrize("consumed", [0, 1, 9, 20, 41])
def test_resume_same_world_exact(consumed):
    for r, s in enumerate(ranks(2, seed=7)):
        s.set_epoch(3)
        full = list(s)
        state = s.state_dict()
        t = ShardSampler(SIZES, num_replicas=2, rank=r, seed=7)
        t.resume_from(state, consumed=consumed)
        assert list(t) == full[consumed:] and len(t) == max(len(full) - consumed, 0)


@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (2, 1), (4, 3)])
def test_resume_elastic_reads_the_rest_once(old, new):
    samplers = ranks(old, seed=11)
    consumed = 6
    done = {i for s in samplers for i in list(s)[:consumed]}
    state = samplers[0].state_dict()
    resumed = [ShardSampler(SIZES, num_replicas=new, rank=r, seed=11) for r in range(new)]
    for t in resumed:
        t.resume_from(state, consumed=consumed)
    orders = [list(t) for t in resumed]
    assert len({len(o) for o in orders}) == 1
    flat = sum(orders, [])
    assert set(flat) == set(range(N)) - done
    assert len(flat) - len(set(flat)) < new  # padding only
    # a second elastic resume continues from the chain of segments
    state2 = resumed[0].state_dict()
    again = [ShardSampler(SIZES, num_replicas=old, rank=r, seed=11) for r in range(old)]
    for t in again:
        t.resume_from(state2, consumed=2)
    done2 = done | {i for o in orders for i in o[:2]}
    assert set(sum((list(t) for t in again), [])) == set(range(N)) - done2


def test_resumed_epoch_prefetches_only_needed_shards():
    s = ShardSampler(SIZES, shuffle=False, window=1)
    state = s.state_dict()
    told = []
    t = ShardSampler(SIZES, shuffle=False, window=1, prefetch=told.extend)
    t.resume_from(state, consumed=STARTS[3] + 2)  # shards 0..2 consumed, 3 partly
    order = list(t)
    assert order[0] == STARTS[3] + 2 and set(told) == set(range(3, len(SIZES)))  # 3: the rest is needed


def test_state_checked():
    s = ShardSampler(SIZES, seed=1)
    with pytest.raises(ResumeStateError, match="seed was 1 when saved, is 2 now"):
        ShardSampler(SIZES, seed=2).resume_from(s.state_dict(), consumed=0)
    with pytest.raises(ResumeStateError, match="not a fastload.ShardSampler state"):
        s.load_state_dict({"epoch": 1})
    with pytest.raises(ValueError, match="window"):
        ShardSampler(SIZES, window=0)


@pytest.fixture(scope="module")
def sharded_store(tiny_tree, tmp_path_factory):
    from fastload.pack.convert import ConvertOptions, convert

    dst = tmp_path_factory.mktemp("sharded") / "store"
    for i in range(3):
        convert(tiny_tree, dst, ConvertOptions(progress=False, workers=1, num_shards=3, shard_index=i))
    return dst


def batches(loader, n=None):
    out = []
    for i, (_x, y) in enumerate(loader):
        if n is not None and i == n:
            break
        out.append(y.tolist())
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resume_through_state_dict(sharded_store, num_workers):
    tf = fastload.eval_transform(size=32)
    ds = fastload.LMDBImageDataset(sharded_store, transform=tf)
    assert sum(ds.shard_sizes) == len(ds) and len(ds.shard_sizes) == 3

    def make(world, rank):
        return fastload.DataLoader(ds, batch_size=3, num_workers=num_workers,
                                   sampler=ShardSampler(ds, num_replicas=world, rank=rank, seed=4, window=2))

    full = [batches(make(2, r)) for r in range(2)]
    states = []
    for r in range(2):
        loader = make(2, r)
        it = iter(loader)
        for _ in range(2):
            next(it)
        states.append(loader.state_dict())
        del it
    for r in range(2):  # same world: exactly the rest
        loader = make(2, r)
        loader.load_state_dict(states[r])
        assert batches(loader) == full[r][2:]
    # elastic: one rank reads every remaining sample once (labels as a multiset)
    loader = make(1, 0)
    loader.load_state_dict(states[0])
    rest = sum(batches(loader), [])
    first = sum((sum(f[:2], []) for f in full), [])
    assert sorted(rest + first) == sorted(ds.targets)
    # and a state taken inside the elastic epoch resumes it again
    loader = make(1, 0)
    loader.load_state_dict(states[0])
    it = iter(loader)
    got = [next(it)[1].tolist()]
    sd = loader.state_dict()
    del it
    loader2 = make(1, 0)
    loader2.load_state_dict(sd)
    assert got + batches(loader2) == batches_of(rest, 3)


def batches_of(flat, b):
    return [flat[i:i + b] for i in range(0, len(flat), b)]


def test_a_users_wrapper_handing_on_its_reader_gets_the_sampler_automatically(sharded_store):
    """A user's dataset around a fastload one (returning indices, adding fields) hands on the reader it reads
    through: the loader reads it by shards as it reads the store itself (the torchrun streaming test's
    wrapper fell back to DistributedSampler when the choice stopped reading a flag)."""

    class Wrapper(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner, self.reader = inner, inner.reader

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner.targets[i]

    ds = fastload.LMDBImageDataset(sharded_store)
    ds.reader.shard_ordered = True
    loader = fastload.DataLoader(Wrapper(ds), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert isinstance(loader.sampler, ShardSampler)
    plain = fastload.DataLoader(ds.targets, batch_size=4, shuffle=True)  # no reader: torch's sampler
    assert not isinstance(plain.sampler, ShardSampler)


def test_a_reader_declaring_shard_order_gets_the_sampler_automatically(sharded_store):
    """What the loader looks at is what the dataset's reader declares (``shard_ordered``, as the
    remote reader does), not a flag on the dataset."""
    ds = fastload.LMDBImageDataset(sharded_store, transform=fastload.eval_transform(size=32))
    ds.reader.shard_ordered = True  # a local folder of shards read as a bucket's would be
    loader = fastload.DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(9))
    assert isinstance(loader.sampler, ShardSampler) and loader.sampler.seed == 9
    e0, e1 = batches(loader), batches(loader)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(ds.targets)
