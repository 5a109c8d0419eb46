"""The resume seam without a loader behind it: both loaders count a segment with one rule
(``advance``), and the DALI loader's position lives in a ``DALITracker`` fed by the same events
as the DataLoader's ``ResumeTracker`` (these run without DALI; test_resume_dali.py runs the
real loader through it)."""

from __future__ import annotations

import pytest

from fastload import ResumeStateError
from fastload.load.state import DALIGlobalOrder, DALIShardOrder, DALIState, DistributedOrder
from fastload.load.tracker import DALITracker, advance


def test_advance_counts_every_rank_in_a_global_order_and_stops_at_the_rank_length() -> None:
    dist = DistributedOrder(start=4, world=3, consumed=6, shuffle=True, drop_last=False)
    assert advance(dist, 5, rank_len=10) == DistributedOrder(start=4, world=3, consumed=21, shuffle=True,
                                                             drop_last=False)
    assert advance(dist, 50, rank_len=10).consumed == 6 + 3 * 10  # padding past the end counts as read
    assert advance(DALIGlobalOrder(start=0, world=2, consumed=0), 7, rank_len=9) == \
        DALIGlobalOrder(start=0, world=2, consumed=14)


def test_advance_moves_only_the_last_segment_of_a_shard_order_and_leaves_the_saved_one_alone() -> None:
    saved = DALIShardOrder({"seed": 1, "segments": [[0, 8], [2, 3]]})
    moved = advance(saved, 4, rank_len=20)
    assert moved.sampler["segments"] == [[0, 8], [2, 7]] and moved.sampler["seed"] == 1
    assert saved.sampler["segments"] == [[0, 8], [2, 3]]
    with pytest.raises(TypeError, match="not a segment order"):
        advance(object(), 1, rank_len=1)


class FakeDALI:
    """What DALITracker reads of a DALILoader: ``resume_facts()``, ``epoch`` and ``batch_size``."""

    batch_size = 4

    def __init__(self) -> None:
        self.epoch = 0

    def resume_facts(self) -> dict:
        return {"source": "store", "length": 40, "identity": "abc", "seed": 7, "shuffle": True,
                "batch_size": self.batch_size, "world": 2, "shards": None}


def test_dali_tracker_reports_the_live_position_the_loaded_plan_and_the_epoch_boundary() -> None:
    loader, tracker = FakeDALI(), DALITracker()
    start = tracker.state_dict(loader)
    assert (start["epoch"], start["batches"], start["order"]) == (0, 0, None)

    loader.epoch = 1  # the loader counts its epoch when it starts one
    tracker.epoch_started(0, 0, DALIGlobalOrder(start=0, world=2, consumed=0), rank_len=20)
    for _ in range(3):
        tracker.batch_yielded()
    mid = tracker.state_dict(loader)
    assert (mid["epoch"], mid["batches"], mid["order"]) == (0, 3, {"start": 0, "world": 2, "consumed": 24})

    # a plan is the position until the next epoch starts, then the live epoch counts from it
    again = DALITracker()
    plan = again.check(loader, mid)
    assert isinstance(plan, DALIState) and plan.order == DALIGlobalOrder(start=0, world=2, consumed=24)
    again.load(plan)
    assert again.state_dict(loader) == mid
    assert again.take_plan() is plan and again.take_plan() is None
    again.epoch_started(0, plan.batches, DALIGlobalOrder(start=0, world=2, consumed=24), rank_len=8)
    again.batch_yielded()
    assert again.state_dict(loader)["batches"] == 4
    assert again.state_dict(loader)["order"] == {"start": 0, "world": 2, "consumed": 32}

    tracker.epoch_ended()
    end = tracker.state_dict(loader)
    assert (end["epoch"], end["batches"], end["order"]) == (1, 0, None)


def test_dali_tracker_refuses_a_state_for_another_loader_by_name() -> None:
    loader, tracker = FakeDALI(), DALITracker()
    good = tracker.state_dict(loader)
    tracker.load(tracker.check(loader, good))
    bad = dict(good, seed=8)
    with pytest.raises(ResumeStateError, match="seed"):
        tracker.check(loader, bad)
    assert tracker.state_dict(loader) == good  # the loaded plan stands
