"""Every field of a loader state is checked at load_state_dict: wrong type, truncated, missing.

Table-driven over real states (a shuffled map-style epoch, a DistributedSampler epoch, an
iterable dataset with workers and without), so a field added to the state without a check
shows up here: ``test_the_table_covers_every_field`` fails until it is listed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from fastload import DataLoader, ResumeStateError
from fastload.load.state import LoaderState
from resumable import Stateful
from state_damage import damage


class Indexed(Dataset):
    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


def make(kind: str) -> DataLoader:
    if kind == "map":
        return DataLoader(Indexed(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    if kind == "distributed":
        ds = Indexed()
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=3))
    if kind == "iterable-2w":
        return DataLoader(Stateful(), batch_size=4, num_workers=2)
    return DataLoader(Stateful(), batch_size=4)


def saved(kind: str) -> dict:
    loader = make(kind)
    it = iter(loader)
    next(it), next(it)
    sd = loader.state_dict()
    del it
    return sd


STATES = ("map", "distributed", "iterable-2w", "iterable-0w")
SAVED: dict[str, dict] = {}


def state_of(kind: str) -> dict:
    if kind not in SAVED:
        SAVED[kind] = saved(kind)
    return copy.deepcopy(SAVED[kind])


# path -> (the states that have it, the damage that must be refused). "missing" is absent for
# optional fields (older states lack them); the user's own states (sampler, dataset) are opaque.
TABLE: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("format",): (STATES, ("type", "missing")),
    ("version",): (STATES, ("type", "missing")),
    ("dataset",): (STATES, ("type", "missing")),
    ("dataset", "kind"): (STATES, ("type", "missing")),
    ("dataset", "len"): (STATES, ("type", "missing")),
    ("dataset", "identity"): (STATES, ("type", "missing")),
    ("epoch",): (STATES, ("type", "missing")),
    ("batches",): (STATES, ("type", "missing")),
    ("batch_size",): (STATES, ("type", "missing")),
    ("seed",): (STATES, ("type", "missing")),
    ("generator",): (STATES, ("type", "missing")),
    ("generator", ""): (("map",), ("truncated",)),
    ("order",): (STATES, ("type", "missing")),
    ("order", ""): (("map", "distributed"), ("none",)),
    ("order", "kind"): (("map", "distributed"), ("type", "missing")),
    ("order", "sampler"): (("map",), ("missing",)),
    ("order", "rng"): (("map",), ("type", "missing")),
    ("order", "rng", "global"): (("map",), ("type", "truncated", "missing")),
    ("order", "rng", "loader"): (("map",), ("type", "truncated")),
    ("order", "start"): (("distributed",), ("type", "missing")),
    ("order", "world"): (("distributed",), ("type", "missing")),
    ("order", "consumed"): (("distributed",), ("type", "missing")),
    ("order", "shuffle"): (("distributed",), ("type", "missing")),
    ("order", "drop_last"): (("distributed",), ("type", "missing")),
    ("sample_seed",): (STATES, ("type", "missing")),
    ("dataset_state",): (STATES, ("missing",)),
    ("workers",): (STATES, ("type", "missing")),
    ("workers", "num_workers"): (("iterable-2w",), ("type", "missing")),
    ("workers", "states"): (("iterable-2w",), ("type", "truncated", "missing")),
    ("workers", "next"): (("iterable-2w",), ("type", "missing")),
    ("workers", "iter_states"): (("iterable-2w",), ("type", "truncated")),
    ("workers", "ended"): (("iterable-2w",), ("type", "truncated")),
    ("workers", "replay"): (("iterable-2w",), ("type",)),
    ("worker_seed",): (("iterable-2w",), ("type",)),
    ("fetcher",): (("iterable-0w",), ("type",)),
    ("fetcher", "iter_state"): (("iterable-0w",), ("missing",)),
    ("fetcher", "ended"): (("iterable-0w",), ("type", "missing")),
}


def leaf_paths(sd, prefix=()) -> set[tuple]:
    out = set()
    for k, v in sd.items():
        out.add((*prefix, k))
        if isinstance(v, dict) and k not in ("dataset_state",) and prefix[-1:] != ("rng",):
            out |= leaf_paths(v, (*prefix, k))
    return out


STR_FIELDS = {("format",), ("dataset", "kind"), ("dataset", "identity"), ("order", "kind")}


CASES = [pytest.param(kind, path, how, id=f"{kind}-{'.'.join(map(str, path))}-{how}")
         for path, (kinds, hows) in TABLE.items() for kind in kinds for how in hows]


@pytest.mark.parametrize("kind, path, how", CASES)
def test_a_damaged_field_is_refused_at_load_naming_it(kind, path, how):
    sd = damage(state_of(kind), path, how, STR_FIELDS)
    if sd is None:
        pytest.fail(f"{kind}: the state has no {path} (the table is out of date)")
    with pytest.raises(ResumeStateError) as err:
        make(kind).load_state_dict(sd)
    msg = str(err.value)
    assert "HINT" in msg
    if path[0] in ("format", "version") or path == ("dataset", "kind"):
        return  # "not a fastload.DataLoader state", "version ...", "the dataset kind was ..."
    name = [k for k in path if k][-1]
    assert repr(name) in msg, f"{msg!r} does not name {path}"


def test_the_table_covers_every_field():
    for kind in STATES:
        listed = {tuple(k for k in p if k) for p, (kinds, _) in TABLE.items() if kind in kinds}
        present = leaf_paths(state_of(kind))
        assert present - listed == set(), f"{kind}: fields with no row in TABLE"


@pytest.mark.parametrize("kind", STATES)
def test_the_undamaged_states_load_and_optional_fields_may_be_absent(kind):
    make(kind).load_state_dict(state_of(kind))
    sd = state_of(kind)
    for key in ("fetcher",):
        sd.pop(key, None)
    if sd["workers"] is not None:
        for key in ("iter_states", "ended", "replay"):
            sd["workers"].pop(key)
    if sd["order"] is not None and sd["order"]["kind"] == "replay":
        sd["order"]["rng"].pop("loader")
    make(kind).load_state_dict(sd)  # a version-1 state written before these fields existed


@pytest.mark.parametrize("field, value, match", [  # the four from issue #21, each with its old failure
    ("generator", lambda sd: sd["generator"][:100], r"\['generator'\]: a torch.Generator state is 5056 bytes"),
    ("order.rng", lambda sd: {**sd["order"]["rng"], "global": sd["order"]["rng"]["global"][:-8]},
     r"\['order'\]\['rng'\]\['global'\]"),
    ("sample_seed", lambda sd: "abc", r"\['sample_seed'\]: expected an int or None, got str 'abc'"),
    ("order", lambda sd: None, r"\['order'\]: None, but 2 batches of the epoch were already yielded"),
])
def test_the_issue_cases_fail_at_load_not_later(field, value, match):
    sd = state_of("map")
    if "." in field:
        outer, inner = field.split(".")
        sd[outer][inner] = value(sd)
    else:
        sd[field] = value(sd)
    loader = make("map")
    with pytest.raises(ResumeStateError, match=match):
        loader.load_state_dict(sd)


def test_a_generator_state_torch_rejects_is_refused():
    sd = state_of("map")
    sd["generator"] = bytes(len(sd["generator"]))  # the right size, but no valid mt19937 state
    with pytest.raises(ResumeStateError, match=r"\['generator'\]"):
        make("map").load_state_dict(sd)


def test_unknown_fields_are_refused():
    sd = state_of("map")
    sd["bacthes"] = 3
    with pytest.raises(ResumeStateError, match=r"unknown fields \['bacthes'\]"):
        make("map").load_state_dict(sd)


def test_the_schema_round_trips():
    for kind in STATES:
        sd = state_of(kind)
        assert LoaderState.from_dict(sd).to_dict() == sd
