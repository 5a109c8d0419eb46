"""What a loader state holds and how it is checked.

Owns: the state format of ``fastload.DataLoader.state_dict()`` (a plain dict of ints, strings
and the user's own sampler/dataset states: small, picklable, ``torch.save``-able, no sample data;
JSON-serialisable when the user's own states are: RNG states are base64 text, and states saved
with them as raw bytes still load) and its validation (``check_state``: every mismatch is a ``ResumeStateError`` that
names the field, the saved and the current value). What a resumed epoch is rebuilt from (the
dataset identity, per-sample augmentation seeds, the segment arithmetic of elastic resume) is
``replay.py``'s; its names are re-exported here, where ``load/dali.py`` and older code import them.

The state (``version`` 1; typed as ``LoaderState`` below, which validates every field)::

    format, version     "fastload.DataLoader", 1
    dataset             {"kind": "map" | "iterable", "len": n | None, "identity": str | None}
    epoch, batches      the epoch to resume and how many of its batches were already yielded
                        (an exhausted epoch is saved as ``epoch + 1, 0``)
    batch_size          of the loader that saved it
    seed                the order's seed: DistributedSampler.seed, or generator.initial_seed()
    generator           the loader's ``generator`` state now (so later epochs match; base64), or None
    order               how the epoch's order is rebuilt (below), or None for a fresh epoch
    sample_seed         the seed of the per-sample augmentation RNG (fastload presets), or None
    dataset_state       an iterable dataset's own ``state_dict()`` (``num_workers=0``; None when
                        the dataset is its own iterator: then ``fetcher.iter_state`` has it), or
                        a stateful map-style dataset's (``num_workers=0``, as torchdata keeps it)
    workers             {"num_workers", "states", "next", "iter_states", "ended", "replay"}:
                        per-worker dataset and iterator states (iterable, ``num_workers > 0``;
                        a stateful map-style dataset's per worker, mid-epoch)
    fetcher             {"iter_state", "ended"} (optional): an iterable dataset's iterator state
                        and whether it ran out (``num_workers=0``, mid-epoch)
    ahead               (optional) ``in_order=False``, map-style: positions past ``batches`` of
                        the epoch's batches already yielded out of order (skipped on resume)
    worker_seed         (optional) torch's base seed of the epoch's worker processes (mid-epoch,
                        ``num_workers > 0``): a resumed epoch's workers are seeded as the saved
                        run's were, so a dataset drawing from torch's RNG in them draws the same;
                        in a state taken before ``iter()`` or between epochs, the seed (and
                        ``order``, map-style) the next ``iter()`` will draw, drawn on RNG copies
    workers.rng         (optional) persistent workers between epochs: each worker's RNG states
                        (torch's base64, Python's and NumPy's lists) when its data ran out

Iterable datasets follow torchdata's ``StatefulDataLoader`` (docs/resume-compat.md): the
dataset's state is loaded before ``iter(dataset)`` and the iterator's after it; ``replay``
counts the batches handed out since the workers' last snapshot (``snapshot_every_n_steps``),
read again on resume. Fields added after version 1 first shipped (``fetcher``,
``iter_states``, ``ended``, ``replay``, ``rng["loader"]``, ``worker_seed``) are optional, so older states load.

``order`` is ``{"kind": "replay", "sampler": sampler_state | None, "rng": {...}}`` for every
non-distributed sampler: the state the epoch's order was drawn from (the sampler's own
``state_dict()`` if it has one, and torch's RNG states taken just before the sampler drew),
replayed on resume, after which the ``batches`` already yielded are skipped; or
``{"kind": "distributed", "start", "world", "consumed", "shuffle", "drop_last"}``.

The elastic rule for ``DistributedSampler`` epochs (segments of the world-independent order)
is ``replay.py``'s.

Must not: import torch's private iterator classes (``_resume_iter.py`` does), or read samples.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fastload.errors import ResumeStateError
from fastload.load._shard_order import SHARD_ORDER_FORMAT
from fastload.load.replay import (SampleIndex, dataset_identity, files_identity, global_order, mix_seed, rng_restore,
                                  rng_snapshot, segment)

__all__ = ["STATE_FORMAT", "STATE_VERSION", "check_state", "LoaderState", "DatasetFacts", "ReplayOrder",
           "DistributedOrder", "WorkerStates", "FetcherState", "dataset_identity", "mix_seed", "segment",
           "global_order", "SampleIndex", "rng_snapshot", "rng_restore", "mismatch_error", "check_dali_state",
           "files_identity", "DALI_STATE_FORMAT", "DALIState", "DALIShardOrder",
           "DALIGlobalOrder"]

STATE_FORMAT = "fastload.DataLoader"
DALI_STATE_FORMAT = "fastload.DALILoader"
STATE_VERSION = 1


def mismatch_error(field: str, saved, current, hint: str) -> ResumeStateError:
    return ResumeStateError(f"loader state does not fit this loader: {field} was {saved!r} when saved, "
                            f"is {current!r} now.\nHINT: {hint}")


# ---- the typed schema: what a state holds, each field checked when a state is loaded ----------

_CORRUPT_HINT = "HINT: the checkpoint was damaged or edited; resume from an earlier one."
_GEN_STATE_BYTES: int | None = None


def _b64(state: bytes | None) -> str | None:
    """A generator state as the state dict holds it: base64 text, so the state is JSON-serialisable."""
    return None if state is None else base64.b64encode(state).decode("ascii")


def _corrupt(path: str, problem: str, what: str = STATE_FORMAT) -> ResumeStateError:
    return ResumeStateError(f"corrupt {what} state: invalid [{path}]: {problem}.\n{_CORRUPT_HINT}")


def _check_header(sd: Any, fmt: str, returned: str) -> None:
    """A state's format and version: what kind of state this is, and that this fastload reads it."""
    if not isinstance(sd, Mapping) or sd.get("format") != fmt:
        got = type(sd).__name__ if not isinstance(sd, Mapping) else f"a dict with format={sd.get('format')!r}"
        raise ResumeStateError(f"not a {fmt} state: got {got}.\nHINT: pass what {returned}.")
    if sd.get("version") != STATE_VERSION:
        raise ResumeStateError(f"loader state version {sd.get('version')!r}; this fastload reads version "
                               f"{STATE_VERSION}.\nHINT: resume with the fastload version that saved it.")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


class _Reader:
    """Reads one mapping of a state, naming every field it rejects by its path (``'order']['rng'``)."""

    def __init__(self, sd: Any, path: str, fields: tuple[str, ...], optional: tuple[str, ...] = (), *,
                 what: str = STATE_FORMAT) -> None:
        self.path, self.what = path, what
        if not isinstance(sd, Mapping):
            raise _corrupt(path, f"expected a dict, got {_describe(sd)}", what)
        self.sd = sd
        missing = [k for k in fields if k not in sd]
        if missing:
            where = f" in [{path}]" if path else ""
            raise ResumeStateError(f"corrupt {what} state: missing {missing}{where}.\n{_CORRUPT_HINT}")
        extra = sorted(str(k) for k in sd if k not in fields and k not in optional)
        if extra:
            raise _corrupt(path or "'<top>'", f"unknown fields {extra} (not written by fastload)", what)

    def _name(self, key: str) -> str:
        return f"{self.path}][{key!r}" if self.path else repr(key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.sd.get(key, default)

    def int(self, key: str, *, low: int | None = 0, none: bool = False, high: int | None = None) -> int | None:
        v = self.sd.get(key)
        if v is None and none:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise _corrupt(self._name(key), f"expected an int{' or None' if none else ''}, got {_describe(v)}",
                           self.what)
        if (low is not None and v < low) or (high is not None and v >= high):
            raise _corrupt(self._name(key), f"{v} is out of range [{low}, {high if high is not None else 'inf'})",
                           self.what)
        return v

    def bool(self, key: str) -> bool:
        v = self.sd.get(key)
        if not isinstance(v, bool):
            raise _corrupt(self._name(key), f"expected True or False, got {_describe(v)}", self.what)
        return v

    def str(self, key: str, *, none: bool = False, choices: tuple[str, ...] = ()) -> str | None:
        v = self.sd.get(key)
        if v is None and none:
            return None
        if not isinstance(v, str) or (choices and v not in choices):
            want = f"one of {list(choices)}" if choices else "a str"
            raise _corrupt(self._name(key), f"expected {want}{' or None' if none else ''}, got {_describe(v)}",
                           self.what)
        return v

    def rng(self, key: str, *, none: bool = False, path: str | None = None) -> bytes | None:
        """A CPU ``torch.Generator`` state: bytes of the right size that a generator accepts."""
        global _GEN_STATE_BYTES
        v = self.sd.get(key)
        name = path or self._name(key)
        if v is None and none:
            return None
        if isinstance(v, str):  # what to_dict writes (JSON-serialisable); bytes: states saved before
            try:
                v = base64.b64decode(v.encode("ascii"), validate=True)
            except (ValueError, UnicodeEncodeError):
                raise _corrupt(name, f"expected the base64 of a torch.Generator state, got {_describe(v)}") from None
        if not isinstance(v, (bytes, bytearray)):
            raise _corrupt(name, f"expected the base64 of a torch.Generator state, got {_describe(v)}")
        if _GEN_STATE_BYTES is None:
            _GEN_STATE_BYTES = int(torch.Generator().get_state().numel())
        if len(v) != _GEN_STATE_BYTES:
            raise _corrupt(name, f"a torch.Generator state is {_GEN_STATE_BYTES} bytes, this one is {len(v)} "
                                 "(truncated or padded)")
        try:
            torch.Generator().set_state(torch.frombuffer(bytearray(v), dtype=torch.uint8))
        except RuntimeError as exc:
            raise _corrupt(name, f"torch rejects it as a generator state ({exc})") from None
        return bytes(v)


@dataclass(frozen=True)
class DatasetFacts:
    """What the state says about the dataset: checked against the loader's at load."""

    kind: str                # "map" | "iterable"
    len: int | None
    identity: str | None

    @classmethod
    def read(cls, sd: Any) -> DatasetFacts:
        r = _Reader(sd, "'dataset'", ("kind", "len", "identity"))
        return cls(kind=r.str("kind", choices=("map", "iterable")), len=r.int("len", none=True),
                   identity=r.str("identity", none=True))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "len": self.len, "identity": self.identity}


@dataclass(frozen=True)
class ReplayOrder:
    """A non-distributed epoch's order: the sampler's own state and torch's RNG states just
    before it drew (``rng``: ``"global"``, and ``"loader"`` / ``"sampler"`` generators)."""

    kind: ClassVar[str] = "replay"
    sampler: Any
    rng: Mapping[str, bytes]

    @classmethod
    def read(cls, sd: Any) -> ReplayOrder:
        r = _Reader(sd, "'order'", ("kind", "sampler", "rng"))
        rng = _Reader(r.get("rng"), "'order']['rng'", ("global",), optional=("loader", "sampler"))
        states = {k: rng.rng(k) for k in ("global", "loader", "sampler") if k in rng.sd}
        return cls(sampler=r.get("sampler"), rng=states)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "sampler": self.sampler, "rng": {k: _b64(v) for k, v in self.rng.items()}}


@dataclass(frozen=True)
class DistributedOrder:
    """A ``DistributedSampler`` epoch's segment (the elastic rule: ``replay.py``'s docstring)."""

    kind: ClassVar[str] = "distributed"
    start: int
    world: int
    consumed: int
    shuffle: bool
    drop_last: bool

    @classmethod
    def read(cls, sd: Any) -> DistributedOrder:
        r = _Reader(sd, "'order'", ("kind", "start", "world", "consumed", "shuffle", "drop_last"))
        return cls(start=r.int("start"), world=r.int("world", low=1), consumed=r.int("consumed"),
                   shuffle=r.bool("shuffle"), drop_last=r.bool("drop_last"))

    def to_dict(self) -> dict:
        return {"kind": self.kind, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class WorkerStates:
    """An iterable dataset's per-worker states (``num_workers > 0``) and the worker read next.

    ``states[w]``: worker ``w``'s dataset ``state_dict()`` after its last batch handed out (None:
    not read yet); ``iter_states[w]``: the same for the iterator its ``iter(dataset)`` returned,
    when that is a different, stateful object; ``ended[w]``: the worker's dataset ran out.
    ``replay``: batches handed out since these states were taken (``snapshot_every_n_steps``
    > 1), read again after loading them.
    """

    num_workers: int
    states: tuple
    next: int
    iter_states: tuple = ()
    ended: tuple = ()
    replay: int = 0
    rng: tuple = ()

    @classmethod
    def read(cls, sd: Any) -> WorkerStates:
        r = _Reader(sd, "'workers'", ("num_workers", "states", "next"),
                    optional=("iter_states", "ended", "replay", "rng"))
        n = r.int("num_workers", low=1)
        lists = {}
        for key in ("states", "iter_states", "ended", "rng"):
            v = r.get(key, None if key == "states" else [None] * n)
            if not isinstance(v, (list, tuple)) or len(v) != n:
                raise _corrupt(f"'workers']['{key}'", f"expected a list of {n} (one per worker), got {_describe(v)}")
            lists[key] = tuple(v)
        bad = [w for w, e in enumerate(lists["ended"]) if e is not None and not isinstance(e, bool)]
        if bad:
            raise _corrupt(f"'workers']['ended'][{bad[0]}", f"expected True, False or None, got "
                                                            f"{_describe(lists['ended'][bad[0]])}")
        for w, v in enumerate(lists["rng"]):
            if v is not None:
                lists["rng"] = (*lists["rng"][:w], _read_worker_rng(v, f"'workers']['rng'][{w}"), *lists["rng"][w + 1:])
        return cls(num_workers=n, states=lists["states"], next=r.int("next", high=n),
                   iter_states=lists["iter_states"], ended=lists["ended"], replay=r.int("replay") if "replay" in
                   r.sd else 0, rng=lists["rng"] if any(v is not None for v in lists["rng"]) else ())

    def to_dict(self) -> dict:
        n = self.num_workers
        sd = {"num_workers": n, "states": list(self.states), "next": self.next,
              "iter_states": list(self.iter_states or [None] * n), "ended": list(self.ended or [None] * n),
              "replay": self.replay}
        if any(v is not None for v in self.rng):
            sd["rng"] = list(self.rng)
        return sd


def _read_worker_rng(v: Any, path: str) -> dict:
    """A worker's RNG states (``worker_rng_states()``): torch's (base64), Python's and NumPy's (lists)."""
    if not isinstance(v, Mapping) or not isinstance(v.get("torch"), str):
        raise _corrupt(path, "expected {'torch': base64, 'random': [...], 'numpy': [...] | None}, "
                             f"got {_describe(v)}")
    r = _Reader(v, path, ("torch",), optional=("random", "numpy"))
    r.rng("torch")
    for key in ("random", "numpy"):
        if v.get(key) is not None and not isinstance(v[key], (list, tuple)):
            raise _corrupt(f"{path}['{key}']", f"expected a list, got {_describe(v[key])}")
    return dict(v)


@dataclass(frozen=True)
class FetcherState:
    """An iterable dataset read in this process (``num_workers=0``): its iterator's own state
    (when ``iter(dataset)`` is a different, stateful object) and whether it ran out."""

    iter_state: Any
    ended: bool

    @classmethod
    def read(cls, sd: Any) -> FetcherState | None:
        if sd is None:
            return None
        r = _Reader(sd, "'fetcher'", ("iter_state", "ended"))
        return cls(iter_state=r.get("iter_state"), ended=r.bool("ended"))

    def to_dict(self) -> dict:
        return {"iter_state": self.iter_state, "ended": self.ended}


Order = ReplayOrder | DistributedOrder


@dataclass(frozen=True)
class LoaderState:
    """A ``fastload.DataLoader`` state, typed (the module docstring lists the fields).

    ``from_dict`` validates the whole of a saved dict (types, sizes, ranges and how the fields
    fit together) and raises ``ResumeStateError`` naming the first bad field; ``to_dict`` gives
    the plain dict ``state_dict()`` returns.
    """

    dataset: DatasetFacts
    epoch: int
    batches: int
    batch_size: int | None
    seed: int | None
    generator: bytes | None
    order: Order | None
    sample_seed: int | None
    dataset_state: Any
    workers: WorkerStates | None
    fetcher: FetcherState | None = None
    worker_seed: int | None = None
    ahead: tuple[int, ...] = ()

    REQUIRED: ClassVar[tuple[str, ...]] = ("dataset", "epoch", "batches", "batch_size", "seed", "generator",
                                           "order", "sample_seed", "dataset_state", "workers")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("fetcher", "worker_seed", "ahead")

    @classmethod
    def from_dict(cls, sd: Any, *, coherent: bool = True) -> LoaderState:
        """Raises: ResumeStateError: not a loader state, another version, or a field is corrupt
        (``coherent=False``: each field alone; ``check_coherent()`` then checks them together)."""
        _check_header(sd, STATE_FORMAT, "fastload.DataLoader.state_dict() returned (e.g. checkpoint['loader'])")
        missing = [k for k in cls.REQUIRED if k not in sd]
        bad_ints = [k for k in ("epoch", "batches") if k not in missing
                    and (isinstance(sd[k], bool) or not isinstance(sd[k], int) or sd[k] < 0)]
        if missing or bad_ints:
            raise ResumeStateError(f"corrupt fastload.DataLoader state: missing {missing}, invalid {bad_ints}.\n"
                                   f"{_CORRUPT_HINT}")
        r = _Reader(sd, "", ("format", "version", *cls.REQUIRED), optional=cls.OPTIONAL)
        dataset = DatasetFacts.read(sd["dataset"])
        order_sd, order = sd["order"], None
        if order_sd is not None:
            kind = _Reader(order_sd, "'order'", ("kind",), optional=("sampler", "rng", "start", "world",
                                                                     "consumed", "shuffle", "drop_last"))
            kind = kind.str("kind", choices=("replay", "distributed"))
            order = ReplayOrder.read(order_sd) if kind == "replay" else DistributedOrder.read(order_sd)
        state = cls(dataset=dataset, epoch=sd["epoch"], batches=sd["batches"],
                    batch_size=r.int("batch_size", low=1, none=True), seed=r.int("seed", low=None, none=True),
                    generator=r.rng("generator", none=True), order=order,
                    sample_seed=r.int("sample_seed", low=None, none=True), dataset_state=sd["dataset_state"],
                    workers=WorkerStates.read(sd["workers"]) if sd["workers"] is not None else None,
                    fetcher=FetcherState.read(sd.get("fetcher")),
                    worker_seed=r.int("worker_seed", low=None, none=True), ahead=_read_ahead(sd))
        if coherent:
            state.check_coherent()
        return state

    def check_coherent(self) -> None:
        """The fields that only make sense together (a hand edit can break one and not the other)."""
        iterable = self.dataset.kind == "iterable"
        if iterable and self.order is not None:
            raise _corrupt("'order'", "an iterable dataset's state has no sampler order, this one has "
                                      f"{_describe(self.order.to_dict())}")
        if not iterable and self.batches and self.order is None:
            raise _corrupt("'order'", f"None, but {self.batches} batches of the epoch were already yielded: a "
                                      "mid-epoch state must say how the epoch's order is rebuilt")
        for name in ("fetcher",):  # a map-style dataset's own state_dict() is kept as dataset_state / workers
            if not iterable and getattr(self, name) is not None:
                raise _corrupt(f"'{name}'", "set, but only an iterable dataset's state has one")
        if self.workers is not None and (self.dataset_state is not None or self.fetcher is not None):
            raise _corrupt("'workers'", "per-worker states beside a single-process dataset state")
        if self.sample_seed is not None and self.sample_seed.bit_length() > 64:
            raise _corrupt("'sample_seed'", f"{self.sample_seed} does not fit in 64 bits")
        if isinstance(self.order, DistributedOrder) and self.dataset.len is not None \
                and self.order.start > self.dataset.len:
            raise _corrupt("'order']['start'", f"{self.order.start} is past the dataset's {self.dataset.len} samples")

    def to_dict(self) -> dict:
        sd = {"format": STATE_FORMAT, "version": STATE_VERSION, "dataset": self.dataset.to_dict(),
              "epoch": self.epoch, "batches": self.batches, "batch_size": self.batch_size, "seed": self.seed,
              "generator": _b64(self.generator), "order": self.order.to_dict() if self.order is not None else None,
              "sample_seed": self.sample_seed, "dataset_state": self.dataset_state,
              "workers": self.workers.to_dict() if self.workers is not None else None}
        if self.fetcher is not None:
            sd["fetcher"] = self.fetcher.to_dict()
        if self.worker_seed is not None:
            sd["worker_seed"] = self.worker_seed
        if self.ahead:
            sd["ahead"] = list(self.ahead)
        return sd


def _read_ahead(sd: Mapping) -> tuple[int, ...]:
    v = sd.get("ahead", [])
    if (not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v)
            or any(x < sd["batches"] for x in v)):
        raise _corrupt("'ahead'", f"expected a list of batch positions past 'batches' ({sd['batches']}), "
                                  f"got {_describe(v)}")
    return tuple(sorted(set(v)))


def check_state(sd: Any, *, kind: str, length: int | None, identity: str | None, seed: int | None,
                batch_size: int | None, distributed: bool, num_workers: int) -> LoaderState:
    """Validate a state (``LoaderState.from_dict``) and check it fits the loader about to load it.

    Raises:
        ResumeStateError: not a fastload loader state, a newer version, a corrupt field (named),
            or saved for another dataset (kind, length, identity), seed, sampler kind, batch size
            or worker count.
    """
    st = LoaderState.from_dict(sd, coherent=False)
    ds = st.dataset
    if ds.kind != kind:
        raise mismatch_error("the dataset kind", ds.kind, kind, "build the loader over the same dataset.")
    if ds.len != length:
        raise mismatch_error("the dataset length", ds.len, length, "build the loader over the same dataset.")
    if ds.identity != identity:
        raise mismatch_error("the dataset identity (checksums and labels)", ds.identity, identity,
                   "this is a different dataset (or store) of the same length; resume with the one it "
                   "was saved with.")
    st.check_coherent()
    order = st.order
    if order is not None and isinstance(order, DistributedOrder) != distributed:
        raise mismatch_error("the sampler", order.kind, "distributed" if distributed else "replay",
                   "resume under the same kind of sampler (DistributedSampler in both runs, or in neither).")
    if st.seed != seed:
        raise mismatch_error("the seed", st.seed, seed, "pass the same seed (DistributedSampler(seed=...) or "
                   "generator=torch.Generator().manual_seed(...)) as the run that saved it.")
    if isinstance(order, ReplayOrder) and st.batches and st.batch_size != batch_size:
        raise mismatch_error("batch_size", st.batch_size, batch_size, "a non-distributed epoch resumes by batch "
                   "count: use the same batch_size (DistributedSampler epochs may change it).")
    if st.workers is not None and st.workers.num_workers != num_workers:
        raise mismatch_error("num_workers", st.workers.num_workers, num_workers,
                   "an iterable dataset's state is per worker shard: resume with the same num_workers.")
    return st


# ---- the DALILoader's state: the same reader, mismatch rule and hints --------------------------

_DALI = DALI_STATE_FORMAT
_SHARD_ORDER_FIELDS = ("format", "seed", "epoch", "shuffle", "window", "drop_last", "sizes", "samples", "segments")


def _read_shard_order(sd: Any, path: str) -> dict:
    """A ``ShardOrder`` state inside a DALI state, each field checked (``ShardOrder.resume_from`` then
    checks that it fits the store and settings)."""
    r = _Reader(sd, path, _SHARD_ORDER_FIELDS, what=_DALI)
    out = {"format": r.str("format", choices=(SHARD_ORDER_FORMAT,)), "seed": r.int("seed", low=None),
           "epoch": r.int("epoch"), "shuffle": r.bool("shuffle"), "window": r.int("window", low=1),
           "drop_last": r.bool("drop_last"), "sizes": r.int("sizes", low=1), "samples": r.int("samples")}
    segments = sd["segments"]
    if (not isinstance(segments, (list, tuple)) or not segments
            or any(not isinstance(x, (list, tuple)) or len(x) != 2
                   or any(isinstance(v, bool) or not isinstance(v, int) for v in x) or x[0] < 1 or x[1] < 0
                   for x in segments)):
        raise _corrupt(f"{path}]['segments'", f"expected a non-empty list of [world >= 1, start >= 0] pairs, got "
                                              f"{_describe(segments)}", _DALI)
    out["segments"] = [list(x) for x in segments]
    return out


@dataclass(frozen=True)
class DALIShardOrder:
    """A shard-ordered DALI epoch: the ``ShardOrder``'s own state (its segments, the last one advanced)."""

    sampler: Mapping[str, Any]

    def to_dict(self) -> dict:
        return {"sampler": {**self.sampler, "segments": [list(x) for x in self.sampler["segments"]]}}


@dataclass(frozen=True)
class DALIGlobalOrder:
    """A globally ordered DALI epoch's segment: the same elastic rule as ``DistributedOrder``."""

    start: int
    world: int
    consumed: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DALIState:
    """A ``fastload.DALILoader`` state, typed: read by the same field reader as ``LoaderState`` (every
    field checked, the bad one named), checked against the loader with the same mismatch rule.

    ``shards``: how the loader orders an epoch (None: one global permutation; ``{"window": w}``: by
    shards); a state without the field was saved by a loader that ordered globally. ``world``: absent
    in states saved before it was written (a folder's world size is then not checked).
    """

    source: str                      # "store" | "folder"
    len: int
    identity: str | None
    seed: int
    shuffle: bool
    batch_size: int
    epoch: int
    batches: int
    order: DALIShardOrder | DALIGlobalOrder | None
    world: int | None = None
    shards: Mapping[str, int] | None = None

    REQUIRED: ClassVar[tuple[str, ...]] = ("source", "len", "identity", "seed", "shuffle", "batch_size", "epoch",
                                           "batches", "order")
    OPTIONAL: ClassVar[tuple[str, ...]] = ("world", "shards")

    @classmethod
    def from_dict(cls, sd: Any) -> DALIState:
        """Raises: ResumeStateError: not a DALILoader state, another version, or a field is corrupt (named)."""
        _check_header(sd, _DALI, "DALILoader.state_dict() returned")
        r = _Reader(sd, "", ("format", "version", *cls.REQUIRED), optional=cls.OPTIONAL, what=_DALI)
        shards = sd.get("shards")
        if shards is not None:
            shards = {"window": _Reader(shards, "'shards'", ("window",), what=_DALI).int("window", low=1)}
        order_sd, order = sd["order"], None
        if order_sd is not None and shards is not None:  # by shards: the ShardOrder's own state
            _Reader(order_sd, "'order'", ("sampler",), what=_DALI)
            order = DALIShardOrder(_read_shard_order(order_sd["sampler"], "'order']['sampler'"))
        elif order_sd is not None:
            o = _Reader(order_sd, "'order'", ("start", "world", "consumed"), what=_DALI)
            order = DALIGlobalOrder(start=o.int("start"), world=o.int("world", low=1), consumed=o.int("consumed"))
        return cls(source=r.str("source", choices=("store", "folder")), len=r.int("len"),
                   identity=r.str("identity", none=True), seed=r.int("seed", low=None), shuffle=r.bool("shuffle"),
                   batch_size=r.int("batch_size", low=1), epoch=r.int("epoch"), batches=r.int("batches"),
                   order=order, world=r.int("world", low=1, none=True), shards=shards)

    def to_dict(self) -> dict:
        return {"format": _DALI, "version": STATE_VERSION, "source": self.source, "len": self.len,
                "identity": self.identity, "seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size,
                "world": self.world, "epoch": self.epoch, "batches": self.batches,
                "order": self.order.to_dict() if self.order is not None else None,
                "shards": dict(self.shards) if self.shards is not None else None}


def check_dali_state(sd: Any, *, source: str, length: int, identity: str | None, seed: int, shuffle: bool,
                     batch_size: int, world: int, shards: dict | None = None) -> DALIState:
    """Validate a ``DALILoader`` state (``DALIState.from_dict``) and check it fits the loader about to load it.

    Raises:
        ResumeStateError: not such a state, a newer version, a corrupt field (named), or saved for another
            source kind, store/tree, seed, shuffle, order (global or by shards, window), batch size, or
            (folder) world size.
    """
    st = DALIState.from_dict(sd)
    hint = "build the DALILoader over the same source with the same settings as the run that saved it."
    for field, saved, current in (("source", st.source, source), ("len", st.len, length),
                                  ("identity", st.identity, identity), ("seed", st.seed, seed),
                                  ("shuffle", st.shuffle, shuffle)):
        if saved != current:
            raise mismatch_error(f"the {field}", saved, current, hint)
    if st.shards != shards:
        raise mismatch_error("the order (None: global, else by shards)", st.shards, shards,
                             "build the DALILoader with the same DALIOptions(order=..., window=...) as the run that "
                             "saved it (a store in object storage is read by shards unless order='global').")
    if st.batches and st.batch_size != batch_size and (source == "folder" or st.order is None):
        raise mismatch_error("batch_size", st.batch_size, batch_size,
                             "a folder epoch resumes by batch count." if source == "folder" else hint)
    if source == "folder" and st.batches and st.world is not None and st.world != world:
        raise mismatch_error("the world size", st.world, world, "DALI's file reader shards a folder "
                             "by world size: resume a folder with the same one (a store resumes elastically).")
    return st
