"""The parallel ``external_source`` callback that feeds DALI from a store.

Kept apart from ``dali.py`` because DALI's Python workers (started with ``spawn``) unpickle
it: importing this module must stay cheap (numpy and the store reader, no torch, no DALI).

Order: one global permutation of all samples per epoch, from ``(seed, epoch)``, the same
on every rank; rank ``r`` of ``w`` takes every ``w``-th sample of it, padded by wrapping
(as ``DistributedSampler`` pads) so every rank has ``ceil(n / w)`` samples and the same
number of batches. The epoch is then padded up to a whole number of batches by repeating
its first samples; the iterator trims that padding away (``last_batch_policy=PARTIAL``) or
drops the partial batch (``drop_last``).

Starting mid-epoch (``starting_at``): the pipeline's epoch 0 is epoch ``epoch_base`` from
sample ``start`` on; its later epochs are ``epoch_base + 1, ...`` from their start.
Skipped samples (``without``): a sample known to be bad is replaced by the next good index.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from fastload.store.reader import StoreReader


class StoreSource:
    """``source(sample_info) -> (encoded bytes, label, global index)`` for one rank."""

    def __init__(self, reader: StoreReader, batch_size: int, *, shuffle: bool, seed: int, rank: int = 0,
                 world: int = 1, drop_last: bool = False) -> None:
        self.reader = reader
        self.labels = reader.labels
        self.n = len(reader)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world = rank, world
        self.per_rank = math.ceil(self.n / world)
        full = self.per_rank // batch_size * batch_size
        self.epoch_samples = full if drop_last else self.per_rank  # what the user gets
        self.padded = full if drop_last else math.ceil(self.per_rank / batch_size) * batch_size
        self._order: tuple[int, np.ndarray] | None = None
        self.epoch_base, self.start = 0, 0
        self.bad: frozenset[int] = frozenset()

    def starting_at(self, epoch: int, start: int) -> StoreSource:
        """A copy whose first pipeline epoch is ``epoch`` from sample ``start`` (of this rank's order) on."""
        other = copy.copy(self)
        other.epoch_base, other.start, other._order = epoch, start, None
        return other

    def without(self, index: int) -> StoreSource:
        """A copy that replaces sample ``index`` (and earlier bad ones) by the next good index."""
        other = copy.copy(self)
        other.bad = self.bad | {int(index)}
        if len(other.bad) >= self.n:
            raise ValueError("every sample of the store is bad")
        return other

    def _replace(self, index: int) -> int:
        while index in self.bad:
            index = (index + 1) % self.n
        return index

    def order(self, epoch: int) -> np.ndarray:
        """This rank's global sample indices for ``epoch`` (length ``per_rank``)."""
        if self._order is None or self._order[0] != epoch:
            perm = (np.random.default_rng([self.seed, epoch]).permutation(self.n) if self.shuffle
                    else np.arange(self.n))
            total = self.per_rank * self.world
            if total > self.n:  # pad by wrapping so every rank gets the same count
                perm = np.concatenate([perm, perm[: total - self.n]])
            self._order = (epoch, perm[self.rank::self.world])
        return self._order[1]

    def batch_indices(self, epoch: int, iteration: int) -> list[int]:
        """The global indices that make up batch ``iteration`` of ``epoch`` on this rank."""
        order = self.order(epoch)
        lo = iteration * self.batch_size
        return [self._replace(int(order[k % self.per_rank]))
                for k in range(lo, min(lo + self.batch_size, self.padded))]

    def __call__(self, sample_info):
        e = sample_info.epoch_idx
        k = sample_info.idx_in_epoch + (self.start if e == 0 else 0)
        if k >= self.padded:
            raise StopIteration
        index = self._replace(int(self.order(self.epoch_base + e)[k % self.per_rank]))
        data = np.frombuffer(self.reader.get(index), dtype=np.uint8)
        return data, np.array([self.labels[index]], dtype=np.int64), np.array([index], dtype=np.int64)
