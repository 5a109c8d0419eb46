"""The parallel ``external_source`` callback that feeds DALI from a store.

Kept apart from ``dali.py`` because DALI's Python workers (started with ``spawn``) unpickle
it: importing this module must stay cheap (numpy and the store reader, no torch, no DALI). A
remote store's reader (``RemoteStoreReader``) pickles without its leases and threads: each
spawned worker leases shards from the node cache itself (one download per shard per node).

Order, global (``shards=None``): one global permutation of all samples per epoch, from
``(seed, epoch)``, the same on every rank; rank ``r`` of ``w`` takes every ``w``-th sample of
it, padded by wrapping (as ``DistributedSampler`` pads) so every rank has ``ceil(n / w)``
samples and the same number of batches.
Order, by shards (``shards``: a ``ShardOrder``, the ``ShardSampler``'s arithmetic): the
rank's run of whole shards, shuffled ``window`` shards at a time; also ``ceil(n / w)``
samples per rank. Each rank then touches only its own shards, each once per epoch.
The epoch is then padded up to a whole number of batches by repeating its first samples;
the iterator trims that padding away (``last_batch_policy=PARTIAL``) or drops the partial
batch (``drop_last``).

Resume (``DALILoader.load_state_dict``): a pipeline built to resume mid-epoch reads, in its
first epoch, the list of global indices this rank has left (``resume``; computed by the
loader with the elastic rule of ``fastload.load.state``), and from its second epoch on the
plain per-epoch order of epoch ``epoch_offset + epoch_idx``.
Skipped samples (``without``): a sample known to be bad is replaced by the next good index.

Must not: import torch or DALI (the spawned workers import this module), or hold a store
handle of its own (``StoreReader`` opens one per process).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from fastload.load._shard_order import ShardOrder
from fastload.store.reader import StoreReader


class StoreSource:
    """``source(sample_info) -> (encoded bytes, label, global index)`` for one rank."""

    def __init__(self, reader: StoreReader, batch_size: int, *, shuffle: bool, seed: int, rank: int = 0,
                 world: int = 1, drop_last: bool = False, shards: ShardOrder | None = None) -> None:
        self.reader = reader
        self.labels = getattr(reader, "labels", None)  # a remote store's labels live in its shards: read per sample
        self.n = len(reader)
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.rank, self.world = rank, world
        self.per_rank = math.ceil(self.n / world)
        full = self.per_rank // batch_size * batch_size
        self.epoch_samples = full if drop_last else self.per_rank  # what the user gets
        self.padded = full if drop_last else math.ceil(self.per_rank / batch_size) * batch_size
        self._order: tuple[int, np.ndarray] | None = None
        self.epoch_offset = 0                 # the real epoch of this pipeline's epoch 0
        self.first: np.ndarray | None = None  # a resumed epoch 0: this rank's remaining indices
        self.first_padded = 0
        self.bad: frozenset[int] = frozenset()
        self.shards = shards  # read shard by shard (its num_replicas, rank, shuffle and seed are ours)

    def resume(self, epoch: int, remaining) -> int:
        """Make the pipeline's first epoch ``remaining`` (epoch ``epoch``); return its sample count."""
        self.epoch_offset = epoch
        self.first = np.asarray(remaining, dtype=np.int64)
        m, b = len(self.first), self.batch_size
        full = m // b * b
        self.first_padded = full if self.drop_last else math.ceil(m / b) * b
        return full if self.drop_last else m

    def shard_order(self, epoch: int, state: dict | None = None) -> ShardOrder:
        """A fresh ``ShardOrder`` at the start of ``epoch``, or where ``state`` (its ``state_dict()``) is."""
        plan = copy.copy(self.shards)
        plan.set_epoch(epoch)
        if state is not None:
            plan.resume_from(state, consumed=0)
        return plan

    def global_order(self, epoch: int) -> np.ndarray:
        """All ``n`` indices of ``epoch`` in order, before the split between ranks."""
        return (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                else np.arange(self.n))

    def without(self, index: int) -> StoreSource:
        """A copy that replaces sample ``index`` (and earlier bad ones) by the next good index."""
        other = copy.copy(self)
        other.bad = self.bad | {int(index)}
        if len(other.bad) >= self.n:
            raise ValueError("every sample of the store is bad")
        return other

    def replace(self, index: int) -> int:
        """``index``, or the next good index when it is known to be bad."""
        while index in self.bad:
            index = (index + 1) % self.n
        return index

    def order(self, epoch: int) -> np.ndarray:
        """This rank's global sample indices for ``epoch`` (length ``per_rank``)."""
        if self._order is None or self._order[0] != epoch:
            if self.shards is not None:
                self._order = (epoch, self.shard_order(epoch).order())
                return self._order[1]
            perm = self.global_order(epoch)
            total = self.per_rank * self.world
            if total > self.n:  # pad by wrapping so every rank gets the same count
                perm = np.concatenate([perm, perm[: total - self.n]])
            self._order = (epoch, perm[self.rank::self.world])
        return self._order[1]

    def __call__(self, sample_info):
        k = sample_info.idx_in_epoch
        if self.first is not None and sample_info.epoch_idx == 0:
            if k >= self.first_padded:
                raise StopIteration
            index = self.replace(int(self.first[k % len(self.first)]))
        else:
            if k >= self.padded:
                raise StopIteration
            index = self.replace(int(self.order(sample_info.epoch_idx + self.epoch_offset)[k % self.per_rank]))
        data = np.frombuffer(self.reader.get(index), dtype=np.uint8)
        label = self.labels[index] if self.labels is not None else self.reader.label(index)
        return data, np.array([label], dtype=np.int64), np.array([index], dtype=np.int64)
