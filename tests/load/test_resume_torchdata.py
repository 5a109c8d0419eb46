"""fastload.DataLoader as a drop-in for torchdata's StatefulDataLoader on iterable datasets.

StatefulDataLoader's documented semantics: ``state_dict()`` / ``load_state_dict()`` operate on
the previous / next iterator; an iterable dataset (or the iterator its ``__iter__`` returns)
with ``state_dict`` / ``load_state_dict`` gets them called, per worker, instead of being fast-
forwarded; ``snapshot_every_n_steps`` sets how often workers send their state (a state taken
between snapshots resumes from the last one and reads the batches since again). So a resumed
loader yields exactly what the uninterrupted one would have, for 0 and 2 workers, and the
same as StatefulDataLoader (compared directly where torchdata is installed, the test extra).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from fastload import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def shard() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class Tutorial(IterableDataset):
    """The torchdata tutorial's shape: a per-worker shuffled shard, its position as its state,
    reset to 0 once exhausted (so the next epoch starts over)."""

    def __init__(self, n: int = 22, seed: int = 3) -> None:
        self.n, self.seed, self.i = n, seed, 0

    def __iter__(self):
        wid, nw = shard()
        arr = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed))[wid::nw]
        for idx in range(self.i, len(arr)):
            self.i += 1
            yield int(arr[idx])
        self.i = 0

    def state_dict(self) -> dict:
        return {"i": self.i}

    def load_state_dict(self, sd: dict) -> None:
        self.i = sd["i"]


class Uneven(Tutorial):
    """Worker 1's shard is a third of worker 0's: it runs out while worker 0 is mid-shard."""

    def __iter__(self):
        wid, nw = shard()
        arr = list(range(self.n)) if nw == 1 else (list(range(0, 18)) if wid == 0 else list(range(18, 24)))
        for idx in range(self.i, len(arr)):
            self.i += 1
            yield arr[idx]
        self.i = 0


class _Cursor:
    def __init__(self, n: int, wid: int, nw: int) -> None:
        self.n, self.nw, self.pos = n, nw, wid

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += self.nw
        return self.pos - self.nw

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


class IteratorState(IterableDataset):
    """No state of its own: the iterator ``__iter__`` returns has it (torchdata saves that one)."""

    def __init__(self, n: int = 22) -> None:
        self.n = n

    def __iter__(self):
        wid, nw = shard()
        return _Cursor(self.n, wid, nw)


class SelfIterating(IterableDataset):
    """Its own iterator: ``__iter__`` rewinds it, so its state must be loaded after ``iter()``."""

    def __init__(self, n: int = 22) -> None:
        self.n, self.pos, self.step = n, 0, 1

    def __iter__(self):
        wid, nw = shard()
        self.pos, self.step = wid, nw
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += self.step
        return self.pos - self.step

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.pos = sd["pos"]


DATASETS = {"tutorial": Tutorial, "uneven": Uneven, "iterator-state": IteratorState,
            "self-iterating": SelfIterating}
SLOW = pytest.mark.slow  # two worker processes per iterator: ~10-25 s a case on a shared 2-core machine


def cases(fast_with_workers: tuple[str, ...]) -> list:
    return [pytest.param(name, w, id=f"{name}-{w}w", marks=() if w == 0 or name in fast_with_workers else SLOW)
            for name in DATASETS for w in (0, 2)]


def ids(batches) -> list[list[int]]:
    return [[int(i) for i in b] for b in batches]


def resumed(cls, make_ds, workers: int, k: int, batch: int = 4, **kw) -> tuple[list, list, list, dict]:
    """Save after ``k`` batches; a new loader resumes: (head, rest of the epoch, next epoch, state)."""
    loader = cls(make_ds(), batch_size=batch, num_workers=workers, **kw)
    it = iter(loader)
    head = [next(it) for _ in range(k)]
    sd = loader.state_dict()
    del it
    fresh = cls(make_ds(), batch_size=batch, num_workers=workers, **kw)
    fresh.load_state_dict(sd)
    return ids(head), ids(fresh), ids(fresh), sd


def uninterrupted(make_ds, workers: int, batch: int = 4) -> tuple[list, list]:
    loader = DataLoader(make_ds(), batch_size=batch, num_workers=workers)
    return ids(loader), ids(loader)


@pytest.mark.parametrize("name, workers", cases(("uneven", "self-iterating")))
def test_a_stateful_iterable_resumes_exactly_at_every_batch(name, workers):
    make_ds = DATASETS[name]
    epoch0, epoch1 = uninterrupted(make_ds, workers)
    assert len(epoch0) >= 5
    for k in range(len(epoch0) + 1):
        head, rest, nxt, _ = resumed(DataLoader, make_ds, workers, k)
        assert head == epoch0[:k]
        assert head + rest == epoch0, f"k={k}: the rest of the epoch differs"
        assert nxt == epoch1, f"k={k}: the next epoch differs"


@pytest.mark.parametrize("name, workers", cases(("tutorial",)))
def test_the_same_batches_as_torchdatas_stateful_dataloader(name, workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    make_ds = DATASETS[name]
    epoch0, _ = uninterrupted(make_ds, workers)
    for k in range(len(epoch0) + 1):
        ours = resumed(DataLoader, make_ds, workers, k)[:2]
        theirs = resumed(sdl.StatefulDataLoader, make_ds, workers, k)[:2]
        if theirs[0] + theirs[1] != epoch0:
            # the one place torchdata does not continue the epoch: a worker that ran out, whose
            # dataset reset itself on the way, is read again from its reset state (its shard
            # repeats); fastload leaves it ended, as the uninterrupted run has it
            assert name in ("tutorial", "uneven") and workers == 2, f"k={k}: torchdata deviates unexpectedly"
            seen = [i for b in theirs[0] + theirs[1] for i in b]
            assert len(seen) > len(set(seen)), f"k={k}: torchdata's deviation is not the repeated shard"
            assert ours[0] + ours[1] == epoch0
            continue
        assert ours == theirs, f"k={k}"


@pytest.mark.parametrize("every", [pytest.param(None, marks=SLOW), 3])
def test_snapshot_every_n_steps_keeps_the_batches_and_counts_the_steps_since_like_torchdata(every):
    make_ds = Tutorial
    epoch0, epoch1 = uninterrupted(make_ds, 2)
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    for k in range(len(epoch0) + 1):
        head, rest, nxt, sd = resumed(DataLoader, make_ds, 2, k, snapshot_every_n_steps=every)
        assert head + rest == epoch0 and nxt == epoch1, f"k={k}"
        since = k - (k // every * every if every else 0) if sd["workers"] is not None else 0
        assert sd["workers"] is None or sd["workers"]["replay"] == since, f"k={k}"
        theirs = resumed(sdl.StatefulDataLoader, make_ds, 2, k, snapshot_every_n_steps=every)[3]
        if not theirs.get("_iterator_finished") and sd["workers"] is not None:
            assert theirs["_steps_since_snapshot"] == since, f"k={k}"


def test_snapshot_every_n_steps_is_validated_and_kept():
    assert DataLoader(Tutorial(), snapshot_every_n_steps=5).snapshot_every_n_steps == 5
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="snapshot_every_n_steps"):
            DataLoader(Tutorial(), snapshot_every_n_steps=bad)


class _OtherStateDict(IterableDataset):
    """MosaicML Streaming's shape: a ``state_dict`` that needs arguments is not torchdata's."""

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(wid, 12, n))

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict:
        raise AssertionError("called as if it were torchdata's Stateful")

    def load_state_dict(self, obj: dict) -> None:
        raise AssertionError("called as if it were torchdata's Stateful")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_whose_state_dict_means_something_else_iterates_as_with_torch(workers):
    ours = [b.tolist() for b in DataLoader(_OtherStateDict(), batch_size=4, num_workers=workers)]
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(_OtherStateDict(), batch_size=4, num_workers=workers)]
    assert ours == theirs and sorted(sum(ours, [])) == list(range(12))
