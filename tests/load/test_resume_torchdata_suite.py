"""Behaviours torchdata's own ``test_state_dict.py`` found missing (tools/run_torchdata_state_tests.py).

Each test here is one class of that suite's failures, on our own tiny datasets, so CI holds
them without torchdata's test file: a state that is JSON-serialisable; a dataset or iterator
whose state is torch's RNG (resumed in the main process and in each worker, whose base seed is
kept); a map-style dataset with ``state_dict()`` / ``load_state_dict()`` (kept per worker, as
torchdata keeps it); ``load_state_dict`` on a loader whose persistent workers already run.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from fastload import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


def ident(x):
    return x


class RandomDraws(Dataset):
    """Each sample is a draw from torch's RNG; its state is that RNG (torchdata's DummyMapDataset)."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return (i, int(torch.randint(1000, (1,))))


class StatefulRandomDraws(RandomDraws):
    def state_dict(self):
        return {"g": torch.get_rng_state().tolist()}

    def load_state_dict(self, sd):
        torch.set_rng_state(torch.tensor(sd["g"], dtype=torch.uint8))


class _DrawIter:
    def __init__(self, items) -> None:
        self.items, self.i = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.items):
            raise StopIteration
        self.i += 1
        return (self.items[self.i - 1], int(torch.randint(1000, (1,))))

    def state_dict(self):
        return {"i": self.i, "g": torch.get_rng_state().tolist()}

    def load_state_dict(self, sd):
        self.i = sd["i"]
        torch.set_rng_state(torch.tensor(sd["g"], dtype=torch.uint8))


class IterRandomDraws(IterableDataset):
    """An iterable whose iterator draws from torch's RNG and keeps it in its state."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return _DrawIter(list(range(self.n))[wid::nw])


def rest_and_resumed(make_loader, k: int, via_json: bool = False):
    """The batches after the k-th of an uninterrupted epoch, and those a new loader resumes with."""
    loader = make_loader()
    it = iter(loader)
    for _ in range(k):
        next(it)
    sd = loader.state_dict()
    if via_json:
        sd = json.loads(json.dumps(sd))
    rest = list(it)
    other = make_loader()
    other.load_state_dict(sd)
    return rest, list(other)


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_is_json_serialisable_and_resumes_from_json(workers, kind):
    # the loader's own RNG states (shuffle order, generator) are base64 text, not bytes
    def make():
        if kind == "iterable":
            return DataLoader(IterRandomDraws(), batch_size=3, num_workers=workers, collate_fn=ident)
        return DataLoader(StatefulRandomDraws(), batch_size=3, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(5), collate_fn=ident)

    rest, resumed = rest_and_resumed(make, 3, via_json=True)
    assert resumed == rest and len(rest) == 5


@pytest.mark.parametrize("workers, k", [(0, 0), (0, 2), (2, 0), (2, 1), (2, 3)])
def test_an_iterator_keeping_torchs_rng_resumes_its_draws(workers, k):
    rest, resumed = rest_and_resumed(lambda: DataLoader(IterRandomDraws(), batch_size=3, num_workers=workers,
                                                        collate_fn=ident), k)
    assert resumed == rest and rest


def test_workers_drawing_from_torchs_rng_are_seeded_as_the_saved_run_was():
    # a dataset with no state of its own: the worker processes' seeds alone make its draws
    def make():
        return DataLoader(RandomDraws(), batch_size=3, num_workers=2, collate_fn=ident)

    rest, resumed = rest_and_resumed(make, 0)
    assert resumed == rest and len(rest) == 8


@pytest.mark.parametrize("workers, k", [(0, 0), (0, 3), (2, 0), (2, 1), (2, 4)])
def test_a_stateful_map_dataset_resumes_its_own_state(workers, k):
    def make():
        return DataLoader(StatefulRandomDraws(), batch_size=3, shuffle=True, num_workers=workers,
                          generator=torch.Generator().manual_seed(7), collate_fn=ident)

    rest, resumed = rest_and_resumed(make, k)
    assert resumed == rest and len(rest) == 8 - k


@pytest.mark.parametrize("kind", ["iterable", "map"])
def test_load_state_dict_on_a_running_persistent_loader_starts_from_the_state(kind):
    ds = IterRandomDraws() if kind == "iterable" else StatefulRandomDraws()
    loader = DataLoader(ds, batch_size=3, num_workers=2, persistent_workers=True, collate_fn=ident)
    it = iter(loader)
    sd = loader.state_dict()
    expected = list(it)
    next(iter(loader))  # the persistent workers run the next epoch now
    loader.load_state_dict(sd)
    assert list(loader) == expected


@pytest.mark.parametrize("k", [0, 2])
def test_a_stateful_map_dataset_saved_before_the_first_batch_keeps_the_orders_draw(k):
    # no generator: RandomSampler draws its order from torch's RNG at the first batch, after
    # the state (and the dataset's RNG in it) was taken; the resumed draws follow that draw
    def make():
        return DataLoader(StatefulRandomDraws(), batch_size=3, shuffle=True, collate_fn=ident)

    rest, resumed = rest_and_resumed(make, k)
    assert resumed == rest and len(rest) == 8 - k


def test_a_stateful_map_dataset_saved_between_epochs_gives_the_next_epoch():
    # the dataset's state (torch's RNG) is loaded before iter() draws the next epoch's order
    def make():
        return DataLoader(StatefulRandomDraws(), batch_size=3, shuffle=True, collate_fn=ident)

    loader = make()
    list(loader)
    sd = loader.state_dict()
    expected = list(loader)
    other = make()
    other.load_state_dict(sd)
    assert list(other) == expected


class EpochCounting(IterableDataset):
    """Each worker's copy counts its own epochs (persistent workers keep the copy between epochs)."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.epoch = n, 0

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield (i, self.epoch)
        self.epoch += 1

    def state_dict(self):
        return {"epoch": self.epoch}

    def load_state_dict(self, sd):
        self.epoch = sd["epoch"]


def test_a_state_between_epochs_of_persistent_workers_keeps_their_dataset_copies():
    def make():
        return DataLoader(EpochCounting(), batch_size=2, num_workers=2, persistent_workers=True, collate_fn=ident)

    loader = make()
    list(loader)
    sd = loader.state_dict()
    expected = list(loader)
    assert {e for batch in expected for _, e in batch} == {1}  # the workers' copies are in their 2nd epoch
    other = make()
    other.load_state_dict(sd)
    assert list(other) == expected


class InPlaceState(IterableDataset):
    """Its state_dict() returns the very dict it goes on changing (torchdata's PeriodicStateIterableDataset)."""

    def __init__(self, n: int = 40) -> None:
        self.n, self.state = n, {"step": 0, "seen": [0, 0, 0]}

    def __iter__(self):
        while self.state["step"] < self.n:
            self.state["step"] += 1
            self.state["seen"][self.state["step"] % 3] += 1
            yield (self.state["step"], list(self.state["seen"]))

    def state_dict(self):
        return self.state

    def load_state_dict(self, sd):
        self.state = {"step": sd["step"], "seen": list(sd["seen"])}


@pytest.mark.parametrize("k", [3, 9, 15])
def test_a_worker_state_is_the_one_at_its_batch_though_the_worker_reads_ahead(k):
    # the worker's queue pickles a batch later, in a thread, while the worker reads ahead and
    # changes the dict its state_dict() returned: the state is copied with the batch
    rest, resumed = rest_and_resumed(lambda: DataLoader(InPlaceState(), batch_size=1, num_workers=2,
                                                        collate_fn=ident), k)
    assert resumed == rest and rest


@pytest.mark.parametrize("saved, now", [(0, 2), (2, 0), (2, 1)])
def test_a_stateful_map_datasets_state_refuses_another_worker_count(saved, now):
    from fastload import ResumeStateError

    loader = DataLoader(StatefulRandomDraws(), batch_size=3, num_workers=saved, collate_fn=ident)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    del it
    with pytest.raises(ResumeStateError, match="num_workers"):
        DataLoader(StatefulRandomDraws(), batch_size=3, num_workers=now, collate_fn=ident).load_state_dict(sd)


class Gated(Dataset):
    """Sample i in ``gates`` waits until its file exists, so with in_order=False later batches come first."""

    def __init__(self, n: int, gates: dict[int, str]) -> None:
        self.n, self.gates = n, gates

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        import os
        import time

        gate = self.gates.get(i)
        while gate is not None and not os.path.exists(gate):
            time.sleep(0.01)
        return i


def test_out_of_order_batches_are_resumed_without_loss_or_repeat(tmp_path):
    gate = tmp_path / "go"
    ds = Gated(10, {0: str(gate)})
    loader = DataLoader(ds, batch_size=None, num_workers=2, in_order=False)
    it = iter(loader)
    got = [int(next(it)) for _ in range(4)]
    assert 0 not in got  # sample 0 is held back; 4 later ones were handed out ahead of it
    sd = loader.state_dict()
    del it
    gate.touch()
    other = DataLoader(ds, batch_size=None, num_workers=2, in_order=False)
    other.load_state_dict(sd)
    rest = [int(x) for x in other]
    assert sorted(got + rest) == list(range(10))
    assert 0 in rest


def test_out_of_order_resumed_twice_hands_out_every_batch_once(tmp_path):
    gates = {0: tmp_path / "g0", 6: tmp_path / "g6"}
    ds = Gated(14, {i: str(p) for i, p in gates.items()})

    def part(sd, n, opens):
        loader = DataLoader(ds, batch_size=None, num_workers=2, in_order=False)
        if sd is not None:
            loader.load_state_dict(sd)
        if opens is not None:
            opens.touch()
        it = iter(loader)
        got = [int(next(it)) for _ in range(n)] if n else [int(x) for x in it]
        sd = loader.state_dict()
        del it
        return got, sd

    first, sd = part(None, 4, None)
    second, sd = part(sd, 4, gates[0])
    third, _ = part(sd, 0, gates[6])
    assert 0 not in first and 6 not in first + second
    assert sorted(first + second + third) == list(range(14))


class Shards(Gated):
    """Gated samples in shards of 5, as a sharded store declares them (ShardSampler resumes by position)."""

    shard_sizes = [5, 5, 5, 5]


def test_out_of_order_under_a_shard_sampler_resumes_without_loss_or_repeat(tmp_path):
    """ShardSampler resumes by position and renumbers the epoch from there: the positions yielded ahead were
    left in the old numbering, so one batch was served twice and another never."""
    from fastload import ShardSampler

    gate = tmp_path / "go"
    ds = Shards(20, {2: str(gate)})

    def make():
        return DataLoader(ds, batch_size=None, num_workers=2, in_order=False,
                          sampler=ShardSampler(ds, num_replicas=1, rank=0, shuffle=False))

    loader = make()
    it = iter(loader)
    got = [int(next(it)) for _ in range(4)]
    assert 2 not in got
    sd = loader.state_dict()
    del it
    gate.touch()
    other = make()
    other.load_state_dict(sd)
    rest = [int(x) for x in other]
    assert sorted(got + rest) == list(range(20))


def test_out_of_order_under_a_distributed_sampler_loses_nothing_on_resume(tmp_path, caplog):
    """A DistributedSampler's resume is one offset for every rank: batches yielded ahead of a held one are
    read again (said once in the log), and none is lost (before: the batches up to the handed-out count were
    skipped, the held one among them)."""
    import logging

    from torch.utils.data import DistributedSampler

    gate = tmp_path / "go"
    ds = Gated(10, {0: str(gate)})

    def make():
        return DataLoader(ds, batch_size=None, num_workers=2, in_order=False,
                          sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=False))

    loader = make()
    it = iter(loader)
    got = [int(next(it)) for _ in range(4)]
    assert 0 not in got
    with caplog.at_level(logging.WARNING, logger="fastload"):
        sd = loader.state_dict()
    assert any("read again after a resume" in r.getMessage() for r in caplog.records)
    del it
    gate.touch()
    other = make()
    other.load_state_dict(sd)
    rest = [int(x) for x in other]
    assert set(got + rest) == set(range(10)) and sorted(rest) == list(range(10))  # all of it, none lost


def test_a_stateful_map_datasets_state_is_refused_where_it_cannot_be_given_back():
    from fastload import ResumeStateError

    loader = DataLoader(StatefulRandomDraws(), batch_size=3, num_workers=2, collate_fn=ident)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    del it
    with pytest.raises(ResumeStateError, match="backend='processes'"):
        DataLoader(StatefulRandomDraws(), batch_size=3, num_workers=2, backend="threads",
                   collate_fn=ident).load_state_dict(sd)


def _fail_init(worker_id):
    raise ValueError(f"worker init failed in {worker_id}")


def test_a_worker_init_fn_error_is_raised_by_iter():
    # torchdata's TestInitialState.test_init_error: torch's iterator raised it at the first next()
    loader = DataLoader(RandomDraws(), batch_size=3, num_workers=2, worker_init_fn=_fail_init, collate_fn=ident)
    with pytest.raises(ValueError, match="worker init failed in"):
        iter(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_taken_before_iter_resumes_the_draws_of_the_epoch_the_loader_then_ran(workers):
    # torchdata's TestInitialState.test_load_then_state: no generator, so iter() draws the workers'
    # base seed and the order from torch's global RNG; the state records those draws (on copies).
    # (With 0 workers a dataset drawing from torch's RNG draws from the user's, which is theirs.)
    def make():
        return DataLoader(RandomDraws() if workers else list(range(24)), batch_size=3, shuffle=True,
                          num_workers=workers, collate_fn=ident)

    loader = make()
    sd = loader.state_dict()
    expected = list(loader)
    other = make()
    it = iter(other)
    next(it)
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    torch.manual_seed(12345)  # the resuming process's global RNG is not what the saving one's was
    assert list(other) == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_a_map_state_between_epochs_without_a_generator_resumes_the_next_order(persistent):
    # torchdata's TestSnapshotEnd.test_map_shuffle: RandomSampler with no generator draws the next
    # epoch's order from torch's global RNG; fastload does not set the user's RNG, the state says
    def make():
        return DataLoader(list(range(30)), batch_size=4, shuffle=True, num_workers=2,
                          persistent_workers=persistent, collate_fn=ident)

    loader = make()
    list(loader)
    sd = loader.state_dict()
    expected = list(loader)
    other = make()
    other.load_state_dict(sd)
    torch.manual_seed(999)
    before = torch.get_rng_state()
    assert list(other) == expected
    assert torch.equal(torch.get_rng_state(), before)  # the user's global RNG was not consumed


class IterWorkerDraws(IterableDataset):
    """A stateless iterable whose workers draw from torch's RNG (torchdata's DummyIterableDataset, shuffled)."""

    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield (i, int(torch.randint(1000, (1,))), random.randrange(1000))


def test_a_state_between_epochs_of_persistent_workers_keeps_their_rng():
    # torchdata's TestSnapshotEnd.test_iterable (persistent_workers=True): the workers' RNGs go
    # on from the last epoch; a resumed loader's new workers get the RNGs they ended with
    def make():
        return DataLoader(IterWorkerDraws(), batch_size=2, num_workers=2, persistent_workers=True,
                          generator=torch.Generator().manual_seed(4), collate_fn=ident)

    loader = make()
    list(loader)
    sd = json.loads(json.dumps(loader.state_dict()))
    expected = list(loader)
    other = make()
    other.load_state_dict(sd)
    assert list(other) == expected
