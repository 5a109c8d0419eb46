"""DALILoader.state_dict / load_state_dict in CPU mode: a store resumes exactly, a folder as documented."""

from __future__ import annotations

import io

import pytest
import torch

from fastload.errors import ResumeStateError

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


@dali
def test_store_resume_mid_epoch_is_exact_and_so_is_the_next_epoch(tiny_store):
    ref = loader(tiny_store, shuffle=True)
    e0, e1 = epoch(ref), epoch(ref)
    ref.close()
    ld = loader(tiny_store, shuffle=True)
    it = iter(ld)
    head = [next(it)[2].tolist() for _ in range(2)]
    sd = roundtrip(ld.state_dict())
    assert sd["epoch"] == 0 and sd["batches"] == 2
    del it
    ld.close()
    resumed = loader(tiny_store, shuffle=True)
    resumed.load_state_dict(sd)
    assert head + epoch(resumed) == e0
    assert epoch(resumed) == e1
    resumed.close()


@pytest.mark.slow
@dali
def test_store_elastic_two_shards_save_three_resume(tiny_store):
    seen, states = [], []
    for r in range(2):  # 24 samples: 12 per shard; 1 batch of 4 each = 8 read, 16 left
        ld = loader(tiny_store, shuffle=True, batch_size=4, shard_id=r, num_shards=2)
        it = iter(ld)
        seen += next(it)[2].tolist()
        states.append(ld.state_dict())
        del it
        ld.close()
    assert states[0]["order"] == states[1]["order"]
    rest, lengths = [], []
    for r in range(4):  # 16 left over 4 new shards: 4 each, no padding
        ld = loader(tiny_store, shuffle=True, batch_size=4, shard_id=r, num_shards=4)
        ld.load_state_dict(states[0])
        mine = [i for b in epoch(ld) for i in b]
        lengths.append(len(mine))
        rest += mine
        ld.close()
    assert len(set(lengths)) == 1
    assert sorted(seen + rest) == list(range(24))


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
