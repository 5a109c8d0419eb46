"""Torch's own DataLoader iterators, with the few hooks resume needs.

Owns: subclasses of torch's ``_SingleProcessDataLoaderIter`` and
``_MultiProcessingDataLoaderIter`` that (1) tell the loader when an epoch starts, when a
batch is handed out and when the epoch ends or the workers shut down (so the loader can
count batches and give back the intra-op threads it capped), (2) for an iterable dataset
with workers, rotate the worker cycle to the worker the saved run would have read next and
unwrap the per-worker dataset state carried with each batch; the index wrapper that
rebuilds a resumed epoch's order; and the worker-side wrappers (``worker_init_fn``,
``collate_fn``) that load per-worker states and seed each sample.

Everything else, fetching, pinning, worker management, error propagation and the order of
batches, is torch's code unchanged: that is what keeps ``fastload.DataLoader`` a drop-in.

Must not: decide what a state contains or whether it fits (``state.py``), or touch samples.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, get_worker_info
from torch.utils.data._utils.pin_memory import pin_memory as _pin
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from fastload.errors import ResumeStateError
from fastload.load.state import SampleIndex, global_order, mix_seed, rng_restore, rng_snapshot, seeded_get, segment


class EpochRecord:
    """The epoch an iterator is in: what the loader's ``state_dict()`` is built from."""

    def __init__(self, epoch: int, plan: dict | None, sample_seed: int | None, loader_generator) -> None:
        self.epoch, self.plan, self.sample_seed = epoch, plan, sample_seed
        self.loader_generator = loader_generator
        self.batches = 0            # yielded by this iterator (a resumed one counts from the resume)
        self.finished = False
        self.order: dict | None = None   # how this epoch's order is rebuilt (set at its first index)
        self.rank_len: int | None = None  # distributed: samples this rank reads in this segment
        self.worker_states: list | None = None
        self.next_worker = 0


class _Hooks:
    """Calls into the loader; shared by both iterator classes.

    The loader is held by a weak reference: torch's iterators do not keep their loader alive,
    and a persistent-workers loader keeps its iterator, so a strong one would make a cycle,
    collected by whichever process runs the garbage collector next, maybe a forked worker.
    """

    _fl_ref: Any = None

    @property
    def _fl(self):
        return self._fl_ref() if self._fl_ref is not None else None

    def __next__(self):
        try:
            data = super().__next__()
        except StopIteration:
            if self._fl is not None:
                self._fl._resume_epoch_ended(self)
            self._give_back_threads()
            raise
        if self._fl is not None:
            self._fl._resume_batch_yielded(self)
        return data

    _threads_before: int | None = None

    def restore_threads_to(self, count: int) -> None:
        """Give torch's intra-op thread count back (``count``) when this epoch ends or shuts down."""
        if self._threads_before is None:
            self._threads_before = count

    def _give_back_threads(self) -> None:
        before, self._threads_before = self._threads_before, None
        if before is not None:
            try:
                torch.set_num_threads(before)
            except Exception:  # interpreter shutdown (reached from __del__)
                pass


class SingleIter(_Hooks, _SingleProcessDataLoaderIter):
    def __init__(self, loader) -> None:
        self._fl_ref = weakref.ref(loader)
        super().__init__(loader)
        loader._resume_epoch_started(self)
        if loader._resume_seeding and self._auto_collation:
            self._dataset_fetcher = _SeededFetcher(self._dataset, self._collate_fn)


class MultiIter(_Hooks, _MultiProcessingDataLoaderIter):
    def __init__(self, loader) -> None:
        self._fl_ref = weakref.ref(loader)
        self._rotate = 0
        super().__init__(loader)

    def _reset(self, loader, first_iter=False) -> None:
        self._rotate = loader._resume_epoch_started(self)
        super()._reset(loader, first_iter)

    def _try_put_index(self) -> None:
        if self._rotate:  # start the resumed epoch at the worker the saved run would have read next
            for _ in range(self._rotate):
                next(self._worker_queue_idx_cycle)
            self._rotate = 0
        super()._try_put_index()

    def _process_data(self, data, worker_idx):
        if isinstance(data, WithState):
            if self._fl is not None:
                self._fl._resume_worker_state(data.worker_id, data.state)
            data = data.batch
        return super()._process_data(data, worker_idx)

    def _shutdown_workers(self) -> None:
        super()._shutdown_workers()
        self._give_back_threads()


class _SeededFetcher:
    """torch's map-style fetch (auto-collation), each sample under its own seed (main process)."""

    def __init__(self, dataset, collate_fn) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def fetch(self, indices):
        return self.collate_fn([seeded_get(self.dataset, i) for i in indices])


class _SeededGetItems:
    """Installed as a worker's ``dataset.__getitems__`` (its own copy): seed each sample."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __call__(self, indices):
        return [seeded_get(self.dataset, i) for i in indices]


class WorkerInit:
    """``worker_init_fn`` around the user's: load this worker's saved state, install seeding."""

    def __init__(self, user_fn, states: list | None, seeding: bool) -> None:
        self.user_fn, self.states, self.seeding = user_fn, states, seeding

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        if self.states is not None and self.states[worker_id] is not None:
            info.dataset.load_state_dict(self.states[worker_id])
        if self.seeding:
            info.dataset.__getitems__ = _SeededGetItems(info.dataset)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class WithState:
    """A batch and the state of the worker's dataset right after producing it."""

    def __init__(self, batch, worker_id: int, state) -> None:
        self.batch, self.worker_id, self.state = batch, worker_id, state

    def pin_memory(self, device=None) -> WithState:  # torch's pin-memory thread calls this
        return WithState(_pin(self.batch, device), self.worker_id, self.state)


class StateCollate:
    """``collate_fn`` around the user's, in a worker: attach the dataset's state to the batch."""

    def __init__(self, collate_fn) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples):
        batch = self.collate_fn(samples)
        info = get_worker_info()
        return WithState(batch, info.id, info.dataset.state_dict())


def _find_distributed(index_sampler):
    if isinstance(index_sampler, DistributedSampler):
        return index_sampler, 1
    if type(index_sampler) is BatchSampler and isinstance(index_sampler.sampler, DistributedSampler):
        return index_sampler.sampler, index_sampler.batch_size
    return None, None


def is_stateful(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class ResumableIndex:
    """The loader's index sampler (``batch_sampler`` or ``sampler``), replaying resumed epochs.

    A normal epoch iterates the wrapped sampler untouched, after noting what its order is
    drawn from. A resumed epoch rebuilds the saved order and skips what was already yielded;
    it runs under a copy of torch's RNG state so resuming consumes none of the user's draws.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.live: EpochRecord | None = None  # set by the loader when an epoch starts

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str):  # code that reads it._index_sampler.batch_size etc. still works
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def generators(self, loader_gen) -> dict[str, torch.Generator]:
        gens = {"global": torch.default_generator}
        for name, g in (("loader", loader_gen), ("sampler", getattr(self.sampler(), "generator", None))):
            if isinstance(g, torch.Generator) and all(g is not h for h in gens.values()):
                gens[name] = g
        return gens

    def sampler(self):
        return self.inner.sampler if type(self.inner) is BatchSampler else self.inner

    def stateful_part(self):
        for obj in (self.inner, self.sampler()):
            if is_stateful(obj):
                return obj
        return None

    def __iter__(self):
        rec = self.live
        plan = rec.plan if rec is not None else None
        dist_sampler, per = _find_distributed(self.inner)
        if dist_sampler is not None:
            it = self._distributed(rec, plan, dist_sampler, per)
        elif plan is not None and plan["order"] is not None:
            it = self._replay(rec, plan)
        else:
            it = self._fresh(rec)
        yield from self._seeded(rec, it)

    def order_now(self, rec) -> dict:
        """How an epoch whose order is drawn now is rebuilt: the sampler's state and the RNG's."""
        part = self.stateful_part()
        return {"kind": "replay", "sampler": part.state_dict() if part is not None else None,
                "rng": rng_snapshot(self.generators(rec.loader_generator))}

    def pending_order(self, rec) -> dict | None:
        """``rec``'s order when its epoch started but has not drawn it yet (torch's single-process
        iterator draws at the first ``next()``), as it will be drawn; None under DistributedSampler."""
        if rec.plan is not None and rec.plan["order"] is not None:  # resumed: the saved order
            return rec.plan["order"]
        return None if _find_distributed(self.inner)[0] is not None else self.order_now(rec)

    def _fresh(self, rec):
        if rec is not None:
            rec.order = self.order_now(rec)
        yield from self.inner

    def _replay(self, rec, plan):
        gens = self.generators(rec.loader_generator)
        order, skip = plan["order"], plan["batches"]
        user = rng_snapshot({"global": gens["global"]})
        try:  # draw the saved epoch's order from the saved RNG state
            rng_restore(gens, order["rng"])
            part = self.stateful_part()
            if part is not None and order["sampler"] is not None:
                if callable(getattr(part, "resume_from", None)):
                    # a sampler that resumes by position (ShardSampler: elastic across world
                    # sizes, and skipping by reading would download what is skipped); from here
                    # on the epoch is described by its new state and counts batches from 0
                    per = self.inner.batch_size if type(self.inner) is BatchSampler else 1
                    part.resume_from(order["sampler"], consumed=skip * per)
                    order = dict(order, sampler=part.state_dict())
                    rec.plan, skip = dict(plan, batches=0), 0
                else:
                    part.load_state_dict(order["sampler"])
            it = iter(self.inner)
            first = list(itertools.islice(it, skip + 1))
        finally:
            # torch's global RNG is the user's: given back. The loader's and the sampler's own
            # generators stay where the replay left them, i.e. where the saved run's were after
            # drawing these batches, so the rest of the epoch (RandomSampler draws again when it
            # runs out) leaves them where the uninterrupted run's are at the epoch's end, however
            # far ahead of the caller the saving run's workers or threads had read the sampler.
            rng_restore(gens, user)
        rec.order = order
        yield from first[skip:]
        yield from it

    def _distributed(self, rec, plan, sampler, per):
        o = plan["order"] if plan is not None else None
        if o is None:
            if rec is not None:
                rec.order = {"kind": "distributed", "start": 0, "world": sampler.num_replicas, "consumed": 0,
                             "shuffle": sampler.shuffle, "drop_last": sampler.drop_last}
                rec.rank_len = len(sampler)
            yield from self.inner
            return
        if sampler.epoch != plan["epoch"]:
            raise ResumeStateError(
                f"loader state was saved in epoch {plan['epoch']} of the DistributedSampler, but its "
                f"set_epoch({sampler.epoch}) was called.\nHINT: call sampler.set_epoch({plan['epoch']}) before "
                "iterating the resumed epoch (the automatic sampler does it for you).")
        for field in ("shuffle", "drop_last"):
            if o[field] != getattr(sampler, field):
                raise ResumeStateError(
                    f"loader state was saved with DistributedSampler({field}={o[field]}), this one has "
                    f"{field}={getattr(sampler, field)}.\nHINT: resume with the same {field}.")
        world = sampler.num_replicas
        perm = global_order(len(sampler.dataset), seed=sampler.seed, epoch=sampler.epoch, shuffle=sampler.shuffle)
        if world == o["world"]:
            start, consumed = o["start"], o["consumed"]
        else:
            unique = len(perm) - o["start"]
            start, consumed = o["start"] + min(o["consumed"], unique), 0
        mine = segment(perm, start, world, sampler.drop_last)[consumed + sampler.rank::world]
        rec.order = {"kind": "distributed", "start": start, "world": world, "consumed": consumed,
                     "shuffle": sampler.shuffle, "drop_last": sampler.drop_last}
        rec.rank_len = len(mine)
        if per == 1 and not isinstance(self.inner, BatchSampler):
            yield from mine
        else:
            yield from BatchSampler(mine, self.inner.batch_size, self.inner.drop_last)

    def _seeded(self, rec, it):
        if rec is None or rec.sample_seed is None:
            yield from it
            return
        base, epoch = rec.sample_seed, rec.epoch
        for item in it:
            if isinstance(item, list):
                yield [SampleIndex(i, mix_seed(base, epoch, i)) for i in item]
            else:
                yield item
