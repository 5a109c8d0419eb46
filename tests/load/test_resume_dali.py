"""DALILoader.state_dict / load_state_dict in CPU mode: a store resumes exactly, a folder as documented."""

from __future__ import annotations

import io

import pytest
import torch

from fastload.errors import ResumeStateError
from state_damage import damage

dali = pytest.mark.dali


def loader(source, **kw):
    from fastload.dali import DALILoader, DALIOptions

    options = DALIOptions(shard_id=kw.pop("shard_id", 0), num_shards=kw.pop("num_shards", 1))
    return DALILoader(source, kw.pop("batch_size", 5), device="cpu", num_threads=1, size=32, return_index=True,
                      seed=kw.pop("seed", 1), options=options, **kw)


def epoch(ld) -> list[list[int]]:
    return [idx.tolist() for _, _, idx in ld]


def roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def resumes_exactly(make, batches: int) -> dict:
    """Stop a loader from ``make()`` after ``batches`` batches, resume a new one from its state: the rest
    of the epoch and the next epoch are the uninterrupted run's. Returns the state."""
    ref = make()
    e0, e1 = epoch(ref), epoch(ref)
    ref.close()
    ld = make()
    it = iter(ld)
    head = [next(it)[2].tolist() for _ in range(batches)]
    sd = roundtrip(ld.state_dict())
    assert sd["epoch"] == 0 and sd["batches"] == batches
    del it
    ld.close()
    resumed = make()
    resumed.load_state_dict(sd)
    assert head + epoch(resumed) == e0
    assert epoch(resumed) == e1
    resumed.close()
    return sd


@dali
def test_store_resume_mid_epoch_is_exact_and_so_is_the_next_epoch(tiny_store):
    resumes_exactly(lambda: loader(tiny_store, shuffle=True), 2)


@pytest.mark.slow
@dali
def test_store_elastic_two_shards_save_three_resume(tiny_store):
    # 24 samples: 12 per shard; 1 batch of 4 each = 8 read, 16 left over 4 new shards: 4 each, no padding
    seen, rest, lengths = save_two_resume(lambda r, w: loader(tiny_store, shuffle=True, batch_size=4, shard_id=r,
                                                                num_shards=w), 4)
    assert len(set(lengths)) == 1
    assert sorted(seen + rest) == list(range(24))


def save_two_resume(make, world: int) -> tuple[list[int], list[int], list[int]]:
    """Two ranks (``make(rank, world)``) read one batch each and save; ``world`` new ranks resume from
    rank 0's state. Returns what the two read, what the new ranks read, and each new rank's count."""
    seen, states = [], []
    for r in range(2):
        ld = make(r, 2)
        it = iter(ld)
        seen += next(it)[2].tolist()
        states.append(ld.state_dict())
        del it
        ld.close()
    assert states[0]["order"] == states[1]["order"]
    rest, lengths = [], []
    for r in range(world):
        ld = make(r, world)
        ld.load_state_dict(states[0])
        mine = [i for b in epoch(ld) for i in b]
        lengths.append(len(mine))
        rest += mine
        ld.close()
    return seen, rest, lengths


@pytest.mark.slow
@dali
def test_folder_unshuffled_resume_is_exact_and_a_shuffled_later_epoch_is_refused(tiny_tree):
    ref = loader(tiny_tree, shuffle=False)
    e0 = epoch(ref)
    ref.close()
    ld = loader(tiny_tree, shuffle=False)
    it = iter(ld)
    head = [next(it)[2].tolist() for _ in range(3)]
    sd = ld.state_dict()
    del it
    ld.close()
    resumed = loader(tiny_tree, shuffle=False)
    resumed.load_state_dict(sd)
    assert head + epoch(resumed) == e0
    resumed.close()
    shuffled = loader(tiny_tree, shuffle=True)
    with pytest.raises(ResumeStateError, match="cannot be resumed exactly.*\n.*fastload convert"):
        shuffled.load_state_dict({**sd, "shuffle": True, "epoch": 2})


@dali
def test_dali_state_from_another_seed_or_store_is_refused(tiny_store, tiny_tree):
    sd = loader(tiny_store, shuffle=True).state_dict()
    with pytest.raises(ResumeStateError, match="the seed was 1 when saved, is 2 now"):
        loader(tiny_store, shuffle=True, seed=2).load_state_dict(sd)
    with pytest.raises(ResumeStateError, match="the source was 'store' when saved, is 'folder'"):
        loader(tiny_tree, shuffle=True).load_state_dict(sd)
    with pytest.raises(ResumeStateError, match="corrupt.*missing \\['epoch'\\]"):
        loader(tiny_store, shuffle=True).load_state_dict({k: v for k, v in sd.items() if k != "epoch"})
    with pytest.raises(ResumeStateError, match="the identity"):
        loader(tiny_store, shuffle=True).load_state_dict({**sd, "identity": "store:0000"})


@pytest.mark.gpu
@dali
def test_store_resume_in_gpu_mode_is_exact(tiny_store):
    from fastload.dali import DALILoader, DALIOptions

    def make():
        return DALILoader(tiny_store, 5, device="gpu", num_threads=1, size=32, return_index=True, seed=3,
                          shuffle=True, options=DALIOptions(shard_id=0, num_shards=1))

    ref = make()
    e0 = epoch(ref)
    ref.close()
    ld = make()
    it = iter(ld)
    first = next(it)
    assert first[0].device.type == "cuda"
    sd = ld.state_dict()
    del it
    ld.close()
    resumed = make()
    resumed.load_state_dict(sd)
    assert [first[2].tolist()] + epoch(resumed) == e0
    resumed.close()


# ---- read by shards (DALIOptions(order="shards"); the default for a store in object storage) ----

@pytest.fixture(scope="module")
def six_shards(tiny_tree, tmp_path_factory):
    from remote_helpers import sharded_store

    return sharded_store(tiny_tree, tmp_path_factory.mktemp("six") / "store", 6)  # 4 samples each


def by_shards(source, **kw):
    from fastload.dali import DALILoader, DALIOptions

    options = DALIOptions(shard_id=kw.pop("shard_id", 0), num_shards=kw.pop("num_shards", 1), order="shards",
                          window=2)
    return DALILoader(source, 4, device="cpu", num_threads=1, size=32, return_index=True, seed=1, shuffle=True,
                      options=options)


@dali
def test_by_shards_is_the_shard_samplers_order_disjoint_covering_equal(six_shards):
    from fastload.load.shards import ShardSampler

    import fastload

    sizes = fastload.LMDBImageDataset(six_shards).shard_sizes
    assert sizes == [4] * 6
    got = {}
    for r in range(2):
        ld = by_shards(six_shards, shard_id=r, num_shards=2)
        assert len(ld) == 3  # 12 samples each, batches of 4
        got[r] = [sum(epoch(ld), []) for _ in range(2)]
        ld.close()
    for e in range(2):
        a, b = got[0][e], got[1][e]
        assert len(a) == len(b) == 12 and not set(a) & set(b) and sorted(a + b) == list(range(24))
        for r in range(2):  # the very order fastload.DataLoader's ShardSampler gives: 3 whole shards each
            s = ShardSampler(sizes, num_replicas=2, rank=r, seed=1, window=2)
            s.set_epoch(e)
            assert got[r][e] == list(s)
            assert len({i // 4 for i in got[r][e]}) == 3
    assert got[0][0] != got[0][1]


@dali
def test_by_shards_resume_mid_epoch_is_exact_and_so_is_the_next_epoch(six_shards):
    sd = resumes_exactly(lambda: by_shards(six_shards, shard_id=1, num_shards=2), 1)
    assert sd["shards"] == {"window": 2} and sd["order"]["sampler"]["segments"] == [[2, 4]]


@pytest.mark.slow
@dali
def test_by_shards_elastic_two_ranks_save_three_resume(six_shards):
    # 12 per rank: 1 batch of 4 each = 8 read, 16 left over 3 ranks: 6 each, 2 of them padding
    seen, rest, lengths = save_two_resume(lambda r, w: by_shards(six_shards, shard_id=r, num_shards=w), 3)
    assert lengths == [6, 6, 6]
    assert set(seen + rest) == set(range(24)) and not set(seen) & set(rest)
    assert len(rest) - len(set(rest)) == 2  # the padding only


@dali
def test_a_state_saved_in_the_other_order_is_refused(six_shards):
    from fastload.dali import DALILoader, DALIOptions

    sd = by_shards(six_shards).state_dict()
    glob = DALILoader(six_shards, 4, device="cpu", num_threads=1, size=32, seed=1, shuffle=True,
                      options=DALIOptions(shard_id=0, num_shards=1))
    with pytest.raises(ResumeStateError, match=r"the order \(None: global, else by shards\) was \{'window': 2\}"):
        glob.load_state_dict(sd)
    with pytest.raises(ResumeStateError, match="order='global'"):
        by_shards(six_shards).load_state_dict(glob.state_dict())


# ---- a hand-edited DALI state: the same table as tests/load/test_resume_state.py's ----------------

def _dali_states(tiny_store, tiny_tree, six_shards) -> dict[str, dict]:
    """A mid-epoch state of each kind: a store read globally, a store read by shards, a folder."""
    out = {}
    for kind, make in (("store", lambda: loader(tiny_store)), ("shards", lambda: by_shards(six_shards)),
                       ("folder", lambda: loader(tiny_tree))):
        ld = make()
        it = iter(ld)
        next(it)
        out[kind] = roundtrip(ld.state_dict())
        del it
        ld.close()
    return out


DALI_KINDS = ("store", "shards", "folder")
DALI_TABLE: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("format",): (DALI_KINDS, ("type", "missing")),
    ("version",): (DALI_KINDS, ("type", "missing")),
    ("source",): (DALI_KINDS, ("type", "missing")),
    ("len",): (DALI_KINDS, ("type", "missing")),
    ("identity",): (DALI_KINDS, ("type", "missing")),
    ("seed",): (DALI_KINDS, ("type", "missing")),
    ("shuffle",): (DALI_KINDS, ("type", "missing")),
    ("batch_size",): (DALI_KINDS, ("type", "missing")),
    ("world",): (DALI_KINDS, ("type",)),
    ("epoch",): (DALI_KINDS, ("type", "missing")),
    ("batches",): (DALI_KINDS, ("type", "missing")),
    ("order",): (DALI_KINDS, ("type", "missing")),
    ("order", "start"): (("store",), ("type", "missing")),
    ("order", "world"): (("store",), ("type", "missing")),
    ("order", "consumed"): (("store",), ("type", "missing")),
    ("order", "sampler"): (("shards",), ("type", "missing")),
    ("order", "sampler", "format"): (("shards",), ("type", "missing")),
    ("order", "sampler", "seed"): (("shards",), ("type", "missing")),
    ("order", "sampler", "epoch"): (("shards",), ("type", "missing")),
    ("order", "sampler", "shuffle"): (("shards",), ("type", "missing")),
    ("order", "sampler", "window"): (("shards",), ("type", "missing")),
    ("order", "sampler", "drop_last"): (("shards",), ("type", "missing")),
    ("order", "sampler", "sizes"): (("shards",), ("type", "missing")),
    ("order", "sampler", "samples"): (("shards",), ("type", "missing")),
    ("order", "sampler", "segments"): (("shards",), ("type", "truncated", "missing")),
    ("shards",): (DALI_KINDS, ("type",)),
    ("shards", "window"): (("shards",), ("type", "missing")),
}
DALI_STR = {("format",), ("source",), ("identity",), ("order", "sampler", "format")}


@pytest.fixture(scope="module")
def dali_states(tiny_store, tiny_tree, six_shards):
    pytest.importorskip("nvidia.dali")
    return _dali_states(tiny_store, tiny_tree, six_shards)


def _fresh(kind, tiny_store, tiny_tree, six_shards):
    return {"store": lambda: loader(tiny_store), "shards": lambda: by_shards(six_shards),
            "folder": lambda: loader(tiny_tree)}[kind]()


@dali
@pytest.mark.parametrize("kind, path, how", [pytest.param(k, p, h, id=f"{k}-{'.'.join(p)}-{h}")
                                             for p, (kinds, hows) in DALI_TABLE.items() for k in kinds for h in hows])
def test_a_damaged_dali_state_field_is_refused_at_load_naming_it(dali_states, kind, path, how, tiny_store,
                                                                 tiny_tree, six_shards):
    import copy

    sd = damage(copy.deepcopy(dali_states[kind]), path, how, DALI_STR)
    assert sd is not None, f"{kind}: the state has no {path} (the table is out of date)"
    ld = _fresh(kind, tiny_store, tiny_tree, six_shards)
    with pytest.raises(ResumeStateError) as err:
        ld.load_state_dict(sd)
    msg = str(err.value)
    assert "HINT" in msg
    if path[0] in ("format", "version"):
        return
    assert repr(path[-1]) in msg or f"the {path[-1]}" in msg, f"{msg!r} does not name {path}"


@dali
def test_the_dali_table_covers_every_field(dali_states):
    def paths(sd, prefix=()):
        out = set()
        for k, v in sd.items():
            out.add((*prefix, k))
            if isinstance(v, dict):
                out |= paths(v, (*prefix, k))
        return out

    for kind in DALI_KINDS:
        listed = {p for p, (kinds, _) in DALI_TABLE.items() if kind in kinds}
        assert paths(dali_states[kind]) - listed == set(), f"{kind}: fields with no row in DALI_TABLE"


@dali
def test_the_dali_state_round_trips_through_its_type(dali_states, tiny_store, tiny_tree, six_shards):
    from fastload.load.state import DALIState

    for kind in DALI_KINDS:
        sd = dali_states[kind]
        assert DALIState.from_dict(sd).to_dict() == sd
        ld = _fresh(kind, tiny_store, tiny_tree, six_shards)
        ld.load_state_dict(sd)
        assert ld.state_dict() == sd  # loaded, not yet iterated: the same state back
        ld.close()
