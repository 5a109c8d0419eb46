"""Elastic resume under torchrun: 2 ranks (gloo, CPU) save mid-epoch, 3 ranks resume."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from ddp import rank_records
from ddp import torchrun as _torchrun

N = 46


def torchrun(nproc: int, *args: str) -> None:
    _torchrun("resume_ddp.py", nproc, *args)


def ranks(out: Path, phase: str, world: int) -> list[dict]:
    return rank_records(out, world, phase + "-rank{r}.json")


def interleave(per_rank: list[list[int]]) -> list[int]:
    """The global order DistributedSampler split: position p is rank p % W's (p // W)-th sample."""
    world = len(per_rank)
    return [per_rank[p % world][p // world] for p in range(sum(map(len, per_rank)))]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_two_ranks_save_three_ranks_resume(tmp_path, backend):
    k = 2  # 2 ranks x 2 batches x 4 = 16 of 46 read; the other 30 split evenly over 3 ranks
    torchrun(2, "full", str(tmp_path), "0", backend)
    torchrun(2, "save", str(tmp_path), str(k), backend)
    torchrun(3, "resume", str(tmp_path), "0", backend)
    full, saved, resumed = ranks(tmp_path, "full", 2), ranks(tmp_path, "save", 2), ranks(tmp_path, "resume", 3)
    assert all(r["sampler"] == "DistributedSampler" for r in full + saved + resumed)
    seen = [i for r in saved for i in r["seen"]]
    rest = [i for r in resumed for i in r["epochs"][0]]
    assert len(seen) == 16 and len(rest) == N - 16
    assert sorted(seen + rest) == list(range(N))  # coverage exact, no duplicates
    assert len({len(r["epochs"][0]) for r in resumed}) == 1  # the new ranks stay in step
    full_order = interleave([r["epochs"][0] for r in full])[:N]
    assert interleave([r["seen"] for r in saved]) == full_order[:16]
    # the next epoch: the same global permutation as the uninterrupted run, split 3 ways
    next_full = interleave([r["epochs"][1] for r in full])[:N]
    next_resumed = interleave([r["epochs"][1] for r in resumed])[:N]
    assert next_resumed == next_full
    ref = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=17)
    ref.set_epoch(1)
    assert next_full == list(ref)
