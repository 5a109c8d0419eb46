"""Torch's own DataLoader iterators, with the few hooks resume needs.

Owns: subclasses of torch's ``_SingleProcessDataLoaderIter`` and
``_MultiProcessingDataLoaderIter`` that (1) report to the loader's ``ResumeTracker``
(``tracker.py``) when an epoch starts, a batch is handed out, a worker's dataset state
arrives and the epoch ends (and give back the intra-op threads the loader capped), (2) for an
iterable dataset with workers, rotate the worker cycle to the worker the saved run would have
read next and unwrap the per-worker states carried with each batch; the index wrapper that
rebuilds a resumed epoch's order; and the worker-side pieces: ``WorkerInit`` (around
``worker_init_fn``: load a worker's saved dataset state, seed each sample) and
``_tracked_fetch`` (torch's iterable fetch in a worker process, reporting the dataset's and its
iterator's state with a batch, and the state a worker ended in, as torchdata does).

Everything else, fetching, pinning, worker management, error propagation and the order of
batches, is torch's code unchanged: that is what keeps ``fastload.DataLoader`` a drop-in.

Must not: decide what a state contains or whether it fits (``state.py``, ``tracker.py``), or
touch samples.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import itertools
import queue
import random
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler, get_worker_info
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torch.utils.data._utils import fetch as _fetch_module
from torch.utils.data._utils.pin_memory import pin_memory as _pin
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from fastload.errors import ResumeStateError
from fastload.load.dataset import PlannedBatch, getitems_planned, plans_samples
from fastload.load.replay import SampleIndex, global_order, mix_seed, rng_restore, rng_snapshot, seeded_get, segment
from fastload.load.state import DistributedOrder, ReplayOrder
from fastload.load.tracker import EpochRecord, is_stateful, settle_ended

__all__ = ["SingleIter", "MultiIter", "ResumableIndex", "WorkerInit", "WithState", "EpochRecord", "is_stateful",
           "worker_rng_states", "set_worker_rng_states"]


class _Hooks:
    """Reports to the loader's ``ResumeTracker``; shared by both iterator classes.

    The tracker holds its loader by a weak reference: torch's iterators do not keep their
    loader alive, and a persistent-workers loader keeps its iterator, so a strong one would make
    a cycle, collected by whichever process runs the garbage collector next, maybe a forked worker.
    """

    _tracker: Any = None

    def __next__(self):
        try:
            data = super().__next__()
        except StopIteration:
            if self._tracker is not None:
                self._tracker.epoch_ended()
            self._give_back_threads()
            raise
        if self._tracker is not None:
            self._tracker.batch_yielded()
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
        self._tracker = loader._fl_resume
        super().__init__(loader)
        self._tracker.epoch_started(self)
        if self._tracker.seeding and self._auto_collation:
            self._dataset_fetcher = _SeededFetcher(self._dataset, self._collate_fn)


_SKIP = object()  # what _process_data returns for a worker's end-of-data report (no batch)


class MultiIter(_Hooks, _MultiProcessingDataLoaderIter):
    def __init__(self, loader) -> None:
        self._tracker = loader._fl_resume
        self._rotate = 0
        super().__init__(loader)
        init = self._worker_init_fn
        if isinstance(init, WorkerInit) and init.acks is not None:
            self._await_worker_init(init.acks)

    def _await_worker_init(self, acks) -> None:
        """Raise a worker's ``worker_init_fn`` error (or a saved state its dataset refused) from
        ``iter()``, as torchdata does, and not at the first ``next()`` as torch's iterator would:
        wait until every worker has run it (they start in parallel, and the first batch needs them
        anyway). A worker that dies or hangs there is left to torch's own reporting at ``next()``."""
        pending, waited = set(range(self._num_workers)), 0.0
        try:
            while pending:
                try:
                    worker_id, error = acks.get(timeout=MP_STATUS_CHECK_INTERVAL)
                except queue.Empty:
                    waited += MP_STATUS_CHECK_INTERVAL
                    if any(not self._workers[w].is_alive() for w in pending) or (self._timeout and waited
                                                                                 >= self._timeout):
                        return
                    continue
                if error is not None:
                    self._shutdown_workers()
                    error.reraise()
                pending.discard(worker_id)
        finally:
            acks.close()

    @property
    def _base_seed(self) -> int:
        return self.__dict__["_fl_base_seed"]

    @_base_seed.setter
    def _base_seed(self, drawn: int) -> None:
        # torch draws it (from the loader's generator) before starting the workers; a resumed
        # epoch's workers get the saved run's, so their RNG draws are the uninterrupted run's
        saved = self._tracker.saved_worker_seed() if self._tracker is not None else None
        self.__dict__["_fl_base_seed"] = drawn if saved is None else saved

    def _reset(self, loader, first_iter=False) -> None:
        self._rotate = self._tracker.epoch_started(self)
        super()._reset(loader, first_iter)

    def _try_put_index(self) -> None:
        if self._rotate:  # start the resumed epoch at the worker the saved run would have read next
            for _ in range(self._rotate):
                next(self._worker_queue_idx_cycle)
            self._rotate = 0
        super()._try_put_index()

    def _next_index(self):
        index = super()._next_index()
        t = self._tracker
        if not t.iterable or t.snapshot_every == 1 or t.live is None:
            return index
        # torchdata's rule: a worker sends its state with the batches that may be handed out
        # within num_workers steps before a snapshot step (a multiple of snapshot_every)
        n, lo = t.snapshot_every, t.live.position + 1
        hi = lo + self._num_workers * self._prefetch_factor
        want = bool(n) and -(-lo // n) * n < hi + self._num_workers
        return SnapIndex(index if index is not None else [], want, batched=index is not None)

    def _next_data(self):
        while True:
            data = super()._next_data()
            if data is not _SKIP:
                if not self._in_order and not self._tracker.iterable:
                    # a batch handed out ahead of its turn: the state says which (``ahead``)
                    self._tracker.out_of_order(self._rcvd_idx, [i for i in range(self._rcvd_idx, self._send_idx)
                                                                if i not in self._task_info])
                return data

    def _process_data(self, data, worker_idx):
        if isinstance(data, WithState):
            self._tracker.worker_state(data.worker_id, data.state, data.iter_state, data.ended,
                                       batch=data.is_batch, rng=data.rng)
            if not data.is_batch:
                super()._process_data(None, worker_idx)
                return _SKIP
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
    """Installed as a worker's ``dataset.__getitems__`` (its own copy): seed each sample.

    Under a preset that plans (``plans_samples``), a batch's samples are planned in runs and then
    rendered (``getitems_planned``), each from its own generator seeded as ``seeded_get`` seeds
    torch's: the same crops, with the record reads and draws of a run back to back (1.05x the
    images/s of one sample at a time in one thread with runs of 8, ``tools/thread_probes.py STORE runs``;
    1.05x in the loader, ``tools/channels_last_ab.py STORE --compare plan``)."""

    def __init__(self, dataset, deferred: bool = False) -> None:
        self.dataset, self.deferred = dataset, deferred
        self.planned = plans_samples(dataset)

    def __call__(self, indices):
        if self.planned and len(indices) > 1 and all(getattr(i, "seed", None) is not None for i in indices):
            if self.deferred:  # made by the collate, straight into the batch (batch_pool.PooledCollate)
                return PlannedBatch(self.dataset, [int(i) for i in indices], [i.seed for i in indices])
            return getitems_planned(self.dataset, [int(i) for i in indices], [i.seed for i in indices])
        return [seeded_get(self.dataset, i) for i in indices]


def worker_rng_states() -> dict:
    """This process's RNG states that torch seeds in each worker (its own, Python's, NumPy's), as
    plain JSON-serialisable values (no pickle: a state may come from an untrusted file)."""
    version, internal, gauss = random.getstate()
    states: dict = {"torch": base64.b64encode(bytes(torch.get_rng_state().numpy().tobytes())).decode("ascii"),
                    "random": [version, list(internal), gauss], "numpy": None}
    try:
        import numpy as np
    except ImportError:
        return states
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return states


def set_worker_rng_states(states: dict) -> None:
    """Put this process's RNGs where ``worker_rng_states()`` found them."""
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(states["torch"])), dtype=torch.uint8))
    if states.get("random") is not None:
        version, internal, gauss = states["random"]
        random.setstate((version, tuple(internal), gauss))
    if states.get("numpy") is not None:
        try:
            import numpy as np
        except ImportError:
            return
        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


class WorkerInit:
    """``worker_init_fn`` around the user's: load this worker's saved state, install seeding and
    (iterable datasets) the per-batch state report; with ``acks`` (a queue of the loader's
    multiprocessing context), report ``(worker_id, None or the error)`` once it has run, so that
    ``iter()`` raises what it raised."""

    def __init__(self, user_fn, saved, seeding: bool, track: bool, acks=None, persistent: bool = False,
                 collate_writes: bool = False) -> None:
        self.user_fn, self.saved, self.seeding, self.track = user_fn, saved, seeding, track
        self.acks, self.persistent, self.collate_writes = acks, persistent, collate_writes

    def __call__(self, worker_id: int) -> None:
        try:
            self._init(worker_id)
        except Exception:
            if self.acks is not None:
                self.acks.put((worker_id, ExceptionWrapper(where=f"in DataLoader worker process {worker_id}")))
            raise
        if self.acks is not None:
            self.acks.put((worker_id, None))

    def _init(self, worker_id: int) -> None:
        info = get_worker_info()
        saved = self.saved
        if saved is not None and saved.states[worker_id] is not None:
            info.dataset.load_state_dict(saved.states[worker_id])  # 1. the dataset, before iter() makes its iterator
        if self.track:
            global _TRACK
            iter_state = saved.iter_states[worker_id] if saved is not None and saved.iter_states else None
            ended = bool(saved.ended[worker_id]) if saved is not None and saved.ended else False
            _TRACK = _WorkerTrack(info.dataset, worker_id, saved.states[worker_id] if saved is not None else None,
                                  iter_state, ended, self.persistent)
            _fetch_module._IterableDatasetFetcher.fetch = _tracked_fetch  # this worker process's copy only
            _fetch_module._MapDatasetFetcher.fetch = _tracked_map_fetch
        if self.seeding:
            info.dataset.__getitems__ = _SeededGetItems(info.dataset, deferred=self.collate_writes)
        if self.user_fn is not None:
            self.user_fn(worker_id)
        if saved is not None and saved.rng and saved.rng[worker_id] is not None:
            # persistent workers resumed between epochs: the RNGs the saved run's worker ended its
            # epoch with, which its next epoch drew from (set last: that worker ran worker_init_fn
            # once, before its first epoch, not again before this one)
            set_worker_rng_states(saved.rng[worker_id])


class WithState:
    """A batch and the state of the worker's dataset (and of its iterator) right after producing
    it; or, with ``is_batch=False``, no batch: the worker's state when its data ran out."""

    def __init__(self, batch, worker_id: int, state, iter_state, ended: bool, is_batch: bool = True,
                 rng: dict | None = None) -> None:
        self.batch, self.worker_id, self.state, self.iter_state = batch, worker_id, state, iter_state
        self.ended, self.is_batch, self.rng = ended, is_batch, rng

    def pin_memory(self, device=None) -> WithState:  # torch's pin-memory thread calls this
        batch = _pin(self.batch, device) if self.is_batch else None
        return WithState(batch, self.worker_id, self.state, self.iter_state, self.ended, self.is_batch, self.rng)


class SnapIndex(list):
    """An iterable dataset's batch index (``[None] * batch_size``, torch's) that also says whether
    the worker should send its state with this batch (``snapshot_every_n_steps``)."""

    def __init__(self, index, snapshot: bool, batched: bool) -> None:
        super().__init__(index)
        self.snapshot, self.batched = snapshot, batched


class _WorkerTrack:
    def __init__(self, dataset, worker_id: int, saved_state, iter_state, ended: bool, persistent: bool) -> None:
        self.dataset, self.worker_id, self.iter_state = dataset, worker_id, iter_state
        self.saved_state, self.ended, self.first, self.persistent = saved_state, ended, True, persistent

    def states(self, fetcher) -> tuple[Any, Any]:
        """torchdata's rule: the dataset's state unless it is its own iterator, and the iterator's."""
        it = fetcher.dataset_iter
        ds = self.dataset.state_dict() if is_stateful(self.dataset) and it is not self.dataset else None
        # copied now: the queue pickles later, in its feeder thread, while the worker goes on
        # reading ahead and may change the objects a state_dict() returned (torchdata copies too)
        return copy.deepcopy(ds), copy.deepcopy(it.state_dict()) if is_stateful(it) else None


_TRACK: _WorkerTrack | None = None
_ORIG_FETCH = _fetch_module._IterableDatasetFetcher.fetch


def _tracked_fetch(self, possibly_batched_index):
    """torch's iterable fetch in a worker, reporting the dataset's state with the batch."""
    t = _TRACK
    if t is None or self.dataset is not t.dataset:
        return _ORIG_FETCH(self, possibly_batched_index)
    if isinstance(possibly_batched_index, SnapIndex) and not possibly_batched_index.batched:
        possibly_batched_index = None
    if t.first:  # a resumed worker's first fetch: 3. its iterator, made by iter() just now
        t.first = False
        if t.iter_state is not None and is_stateful(self.dataset_iter):
            self.dataset_iter.load_state_dict(t.iter_state)
        if t.ended:
            settle_ended(self, t.dataset, t.saved_state, t.iter_state)
    try:
        batch = _ORIG_FETCH(self, possibly_batched_index)
    except StopIteration:
        # torch sends the main process a bare "this worker ended"; the state it ended in (a
        # dataset may reset itself once exhausted) goes first, as torchdata records it
        if getattr(self, "_fl_end_sent", False):
            raise
        self._fl_end_sent = True
        ds, it = t.states(self)
        rng = worker_rng_states() if t.persistent else None  # what this worker's next epoch draws from
        if ds is None and it is None and rng is None:
            raise
        return WithState(None, t.worker_id, ds, it, True, is_batch=False, rng=rng)
    if getattr(possibly_batched_index, "snapshot", True) or self.ended:
        ds, it = t.states(self)
        if ds is not None or it is not None:
            return WithState(batch, t.worker_id, ds, it, bool(self.ended))
    return batch


_ORIG_MAP_FETCH = _fetch_module._MapDatasetFetcher.fetch


def _tracked_map_fetch(self, possibly_batched_index):
    """torch's map-style fetch in a worker, reporting a stateful dataset's state with the batch."""
    batch = _ORIG_MAP_FETCH(self, possibly_batched_index)
    t = _TRACK
    if t is None or self.dataset is not t.dataset:
        return batch
    return WithState(batch, t.worker_id, copy.deepcopy(t.dataset.state_dict()), None, False)  # see states()


def _find_distributed(index_sampler):
    if isinstance(index_sampler, DistributedSampler):
        return index_sampler, 1
    if type(index_sampler) is BatchSampler and isinstance(index_sampler.sampler, DistributedSampler):
        return index_sampler.sampler, index_sampler.batch_size
    return None, None


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
        elif plan is not None and plan.order is not None:
            it = self._replay(rec, plan)
        else:
            it = self._fresh(rec)
        yield from self._seeded(rec, it)

    def order_now(self, rec) -> ReplayOrder:
        """How an epoch whose order is drawn now is rebuilt: the sampler's state and the RNG's."""
        part = self.stateful_part()
        return ReplayOrder(sampler=part.state_dict() if part is not None else None,
                           rng=rng_snapshot(self.generators(rec.loader_generator)))

    def pending_order(self, rec) -> ReplayOrder | None:
        """``rec``'s order when its epoch started but has not drawn it yet (torch's single-process
        iterator draws at the first ``next()``), as it will be drawn; None under DistributedSampler."""
        if rec.plan is not None and rec.plan.order is not None:  # resumed: the saved order
            return rec.plan.order
        return None if _find_distributed(self.inner)[0] is not None else self.order_now(rec)

    def _fresh(self, rec):
        if rec is not None:
            rec.order = self.order_now(rec)
        yield from self.inner

    def _replay(self, rec, plan):
        gens = self.generators(rec.loader_generator)
        order, skip = plan.order, plan.batches
        user = rng_snapshot({"global": gens["global"]})
        try:  # draw the saved epoch's order from the saved RNG state
            rng_restore(gens, order.rng)
            part = self.stateful_part()
            if part is not None and order.sampler is not None:
                if callable(getattr(part, "resume_from", None)):
                    # a sampler that resumes by position (ShardSampler: elastic across world
                    # sizes, and skipping by reading would download what is skipped); from here
                    # on the epoch is described by its new state and counts batches from 0
                    per = self.inner.batch_size if type(self.inner) is BatchSampler else 1
                    part.resume_from(order.sampler, consumed=skip * per)
                    order = dataclasses.replace(order, sampler=part.state_dict())
                    # in_order=False: the positions yielded ahead, renumbered as the epoch now is (from 0)
                    ahead = tuple(p - skip for p in plan.ahead if p >= skip)
                    rec.plan, rec.base = dataclasses.replace(plan, batches=0, order=order, ahead=ahead), 0
                    rec.ahead, skip = ahead, 0
                else:
                    part.load_state_dict(order.sampler)
            it = iter(self.inner)
            first = list(itertools.islice(it, skip + 1))
            if user["global"] == order.rng.get("global"):
                # torch's RNG is exactly the one the order was drawn from (a state taken after
                # iter() and before the first batch, then a dataset state that set torch's RNG
                # loaded): the draw is the uninterrupted run's own, so it stays drawn
                user = rng_snapshot({"global": gens["global"]})
        finally:
            # torch's global RNG is the user's: given back. The loader's and the sampler's own
            # generators stay where the replay left them, i.e. where the saved run's were after
            # drawing these batches, so the rest of the epoch (RandomSampler draws again when it
            # runs out) leaves them where the uninterrupted run's are at the epoch's end, however
            # far ahead of the caller the saving run's workers or threads had read the sampler.
            rng_restore(gens, user)
        rec.order = order
        ahead = set(rec.plan.ahead) if rec.plan is not None else set()
        if not ahead:
            yield from first[skip:]
            yield from it
            return
        for pos, batch in enumerate(itertools.chain(first[skip:], it), start=skip):
            if pos not in ahead:  # yielded out of order before the state was taken
                yield batch

    def _distributed(self, rec, plan, sampler, per):
        o = plan.order if plan is not None else None
        if o is None:
            if rec is not None:
                rec.order = DistributedOrder(start=0, world=sampler.num_replicas, consumed=0,
                                             shuffle=sampler.shuffle, drop_last=sampler.drop_last)
                rec.rank_len = len(sampler)
            yield from self.inner
            return
        if sampler.epoch != plan.epoch:
            raise ResumeStateError(
                f"loader state was saved in epoch {plan.epoch} of the DistributedSampler, but its "
                f"set_epoch({sampler.epoch}) was called.\nHINT: call sampler.set_epoch({plan.epoch}) before "
                "iterating the resumed epoch (the automatic sampler does it for you).")
        for field in ("shuffle", "drop_last"):
            if getattr(o, field) != getattr(sampler, field):
                raise ResumeStateError(
                    f"loader state was saved with DistributedSampler({field}={getattr(o, field)}), this one has "
                    f"{field}={getattr(sampler, field)}.\nHINT: resume with the same {field}.")
        world = sampler.num_replicas
        perm = global_order(len(sampler.dataset), seed=sampler.seed, epoch=sampler.epoch, shuffle=sampler.shuffle)
        if world == o.world:
            start, consumed = o.start, o.consumed
        else:
            unique = len(perm) - o.start
            start, consumed = o.start + min(o.consumed, unique), 0
        mine = segment(perm, start, world, sampler.drop_last)[consumed + sampler.rank::world]
        rec.order = DistributedOrder(start=start, world=world, consumed=consumed, shuffle=sampler.shuffle,
                                     drop_last=sampler.drop_last)
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
