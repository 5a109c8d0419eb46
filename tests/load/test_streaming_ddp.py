"""torchrun --nproc_per_node=2 (gloo, CPU) over a store in SeaweedFS: one node, one shared cache."""

from __future__ import annotations

import json
from functools import partial

import pytest

import ddp
from fastload.store.cache import node_downloads
from remote_helpers import publish, sharded_store

torchrun = partial(ddp.torchrun, "ddp_remote_check.py")


@pytest.mark.slow
def test_two_ranks_remote_store_cache_and_resume(s3_server, fresh_bucket, tiny_tree, tmp_path):
    local = sharded_store(tiny_tree, tmp_path / "store", 4)
    url = s3_server.url(fresh_bucket, "tiny/")
    man = publish(local, url)
    total = sum(e.bytes for e in man.shards)
    n = man.num_samples

    # two epochs, cache big enough for the store: one download per shard, none in the warm epoch
    full = tmp_path / "full"
    full.mkdir()
    torchrun(2, url, tmp_path / "cache", full, total, "full", 1)
    ranks = [json.loads((full / f"full{r}.json").read_text()) for r in (0, 1)]
    assert {r["sampler"] for r in ranks} == {"ShardSampler"}
    for e in range(2):
        a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
        assert len(a) == len(b) == n // 2 and not set(a) & set(b) and set(a) | set(b) == set(range(n))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    assert ranks[0]["downloads"][0] == len(man.shards)  # the node's log, after both ranks' epoch: once per node
    assert ranks[0]["downloads"][1] == 0  # warm epoch
    log = node_downloads(tmp_path / "cache")
    assert sorted(d["shard"] for d in log) == sorted(e.name for e in man.shards)
    assert max(r["usage_max"] for r in ranks) <= total

    # a cache smaller than the store, read one shard at a time (window 1): each rank leases at most
    # open_shards (5) shards, so 11 shards' bytes hold both ranks' leases; the 12th shard evicts one
    small_store = sharded_store(tiny_tree, tmp_path / "store12", 12)
    url12 = s3_server.url(fresh_bucket, "tiny12/")
    man12 = publish(small_store, url12)
    small = sum(sorted(e.bytes for e in man12.shards)[1:])  # the 11 largest
    assert small < sum(e.bytes for e in man12.shards)
    bounded = tmp_path / "bounded"
    bounded.mkdir()
    torchrun(2, url12, tmp_path / "cache-small", bounded, small, "full", 0, 1)
    for r in (0, 1):
        assert json.loads((bounded / f"full{r}.json").read_text())["usage_max"] <= small

    # SIGKILL after 2 batches of epoch 0, then resume with 2 ranks (exact) and with 1 (elastic)
    kill = tmp_path / "kill"
    kill.mkdir()
    assert torchrun(2, url, tmp_path / "cache", kill, total, "kill", 0, check=False).returncode != 0
    consumed = [json.loads((kill / f"kill{r}.json").read_text())["consumed"] for r in (0, 1)]
    for r in (0, 1):
        assert consumed[r] == ranks[r]["epochs"][0][:4]
    same = tmp_path / "same"
    same.mkdir()
    (same / "state.pt").write_bytes((kill / "state.pt").read_bytes())
    torchrun(2, url, tmp_path / "cache", same, total, "resume", 0)
    for r in (0, 1):
        assert json.loads((same / f"resume{r}.json").read_text())["epochs"][0] == ranks[r]["epochs"][0][4:]
    one = tmp_path / "one"
    one.mkdir()
    (one / "state.pt").write_bytes((kill / "state.pt").read_bytes())
    torchrun(1, url, tmp_path / "cache", one, total, "resume", 0)
    rest = json.loads((one / "resume0.json").read_text())["epochs"][0]
    assert sorted(rest + consumed[0] + consumed[1]) == list(range(n))


@pytest.mark.dali
@pytest.mark.slow
def test_two_ranks_dali_by_shards_remote_store(s3_server, fresh_bucket, tiny_tree, tmp_path):
    """DALILoader (CPU) under torchrun reads a store in object storage by shards (the default for a URL):
    each rank its own run of whole shards in the ShardSampler's order, disjoint and covering, with equal
    batch counts; one download per shard per node; the cache never over its limit; a warm epoch with a
    cache that holds the store downloads nothing."""
    from fastload.load.shards import ShardSampler

    def run(url, man, cache_dir, limit, window, name):
        out = tmp_path / name
        out.mkdir()
        ddp.torchrun("ddp_dali_remote_check.py", 2, url, cache_dir, out, limit, window, timeout=600)
        ranks = ddp.rank_records(out, 2, "dali{r}.json")
        n = man.num_samples
        for e in range(2):
            a, b = ranks[0]["epochs"][e], ranks[1]["epochs"][e]
            assert len(a) == len(b) == n // 2 and sorted(a + b) == list(range(n))
            assert ranks[0]["batches"][e] == ranks[1]["batches"][e] == ranks[0]["len"] == ranks[1]["len"]
            for r in (0, 1):
                s = ShardSampler([x.count for x in man.shards], num_replicas=2, rank=r, seed=5, window=window)
                s.set_epoch(e)
                assert ranks[r]["epochs"][e] == list(s)  # its own run of whole shards
        assert max(r["usage_max"] for r in ranks) <= limit
        return ranks

    # a cache that holds the store: each shard downloaded once by the node, nothing in the warm epoch
    local = sharded_store(tiny_tree, tmp_path / "store", 4)
    url = s3_server.url(fresh_bucket, "dali4/")
    man = publish(local, url)
    total = sum(e.bytes for e in man.shards)
    ranks = run(url, man, tmp_path / "cache", total, 2, "full")
    assert ranks[0]["downloads"] == ranks[1]["downloads"]  # both read the node's one log
    assert sorted(ranks[0]["downloads"][0]) == sorted(e.name for e in man.shards)
    assert ranks[0]["downloads"][1] == []

    # a cache smaller than the store (9 of 12 shards; each rank leases window + 1 per worker, and
    # prefetches the next window), read a shard at a time: never over the limit, and the cold epoch's first
    # 12 downloads are the 12 shards, once each (DALI may start the next epoch before the log is read)
    local12 = sharded_store(tiny_tree, tmp_path / "store12", 12)
    url12 = s3_server.url(fresh_bucket, "dali12/")
    man12 = publish(local12, url12)
    limit = sum(sorted((e.bytes for e in man12.shards), reverse=True)[:9])
    assert limit < sum(e.bytes for e in man12.shards)
    ranks = run(url12, man12, tmp_path / "cache12", limit, 1, "small")
    log = [(d["shard"][6:11], d["pid"], round(d["time"] - ranks[0]["log"][0]["time"], 3)) for d in ranks[0]["log"]]
    assert sorted(ranks[0]["downloads"][0][:12]) == sorted(e.name for e in man12.shards), \
        f"rank pids {ranks[0]['pid']}, {ranks[1]['pid']}; the node's downloads (shard, pid, s): {log}"
