"""fastload.DataLoader under torchrun: 2 ranks, gloo on CPU."""

from __future__ import annotations

import pytest

from ddp import rank_records, torchrun


@pytest.mark.slow
def test_two_ranks_get_disjoint_covering_reshuffled_indices(tiny_store, tmp_path):
    torchrun("ddp_loader_check.py", 2, tiny_store, tmp_path)
    ranks = rank_records(tmp_path, 2)
    assert all(r["sampler"] == "DistributedSampler" for r in ranks)
    n = 24
    for epoch in range(3):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b) == n // 2
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(n))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1] != ranks[0]["epochs"][2]  # set_epoch reshuffles
