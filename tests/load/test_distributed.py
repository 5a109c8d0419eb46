"""fastload.DataLoader under torchrun: 2 ranks, gloo on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_two_ranks_get_disjoint_covering_reshuffled_indices(tiny_store, tmp_path):
    script = Path(__file__).with_name("ddp_loader_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(tiny_store), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["sampler"] == "DistributedSampler" for r in ranks)
    n = 24
    for epoch in range(3):
        a, b = ranks[0]["epochs"][epoch], ranks[1]["epochs"][epoch]
        assert len(a) == len(b) == n // 2
        assert not set(a) & set(b)
        assert sorted(a + b) == list(range(n))
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1] != ranks[0]["epochs"][2]  # set_epoch reshuffles
