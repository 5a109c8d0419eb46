"""``ShardSampler``: a distributed sampler that reads a sharded store shard by shard.

Owns: the epoch's order when a store is read as shards (a remote store through the node
cache, or a local folder of shards on NFS or disks), its split over ranks, and its exact and
elastic resume.

The epoch (a function of ``seed``, ``epoch`` and the world size only):

1. The shards are put in a random order (the same on every rank) and their samples laid end
   to end: the epoch's *stream*.
2. The stream is cut into ``world`` contiguous pieces of equal length (padded from its front
   like ``DistributedSampler``, or cut with ``drop_last``). Rank ``r`` reads piece ``r``: a run
   of whole shards, with at most one shard shared with each neighbour. So every rank yields the
   same number of samples (DDP never waits on a rank with fewer batches), and a node downloads
   a shard once per epoch.
3. Inside a rank, the piece is read ``window`` shards at a time; the samples of those shards
   are shuffled together. ``tools/shuffle_quality.py`` measures what this does to the order
   (docs/streaming.md has the figures).

Resume (through ``fastload.DataLoader.state_dict()``, or ``state_dict()`` / ``resume_from``
directly): the state is ``seed, epoch, shuffle, window, drop_last`` and the list of
*segments* the epoch was read in, ``[world, consumed per rank]``. Resumed by the same world
size, each rank continues at its position. Resumed by another, the samples not yet consumed
(in stream order, so still grouped by shard) become a new stream that is cut for the new
ranks as above: every remaining sample is read once, and shards already consumed are never
downloaded again.

The arithmetic lives in ``_shard_order.py`` (``ShardOrder``, torch-free: DALI's spawned workers
compute the same order); this module adds torch's ``Sampler`` face, the ``torch.distributed``
defaults and the prefetch calls.

Must not: read samples or download (the dataset does, told what comes next by ``prefetch``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler

from fastload.load._shard_order import DEFAULT_WINDOW, ShardOrder

__all__ = ["ShardSampler", "DEFAULT_WINDOW"]


class ShardSampler(ShardOrder, Sampler[int]):
    """Shard-ordered, shuffled, evenly split sample indices for one rank.

    Args:
        shard_sizes: samples per shard, in store order (``dataset.shard_sizes``), or a dataset
            that has that attribute.
        num_replicas, rank: the world; default from ``torch.distributed`` (1, 0 without it).
        shuffle: shuffle the shard order and the samples inside each window (default True);
            False reads the store in order.
        seed: the same on every rank.
        drop_last: cut the stream to a multiple of the world size instead of padding it.
        window: shards whose samples are shuffled together (default ``DEFAULT_WINDOW``); a
            node's cache must hold ``window`` (+ the prefetched ones) shards per rank.
        prefetch: called with the shard numbers this rank reads after the current window
            (the next window's), when a window starts; the dataset downloads them meanwhile.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, shard_sizes: Sequence[int] | Any, *, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 window: int = DEFAULT_WINDOW, prefetch: Callable[[list[int]], None] | None = None) -> None:
        sizes = getattr(shard_sizes, "shard_sizes", shard_sizes)
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(sizes, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, window=window)
        if prefetch is None and callable(getattr(shard_sizes, "prefetch_shards", None)):
            prefetch = shard_sizes.prefetch_shards
        self.prefetch = prefetch

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        end = 0
        windows = self.windows(order)
        if self.prefetch is not None and windows:
            # the first window's own shards first, then (as each window starts) the next window's: told
            # only the next one, the downloads of the first window (by the readers, as they need them)
            # shared the link with the second's, and on a slow link the first batch waited for both
            self.prefetch(self.window_shards(order, windows[0]))
        for start, end, ahead in windows:
            if self.prefetch is not None and ahead:
                self.prefetch(ahead)
            yield from order[start:end].tolist()
        yield from order[end:].tolist()  # padding that wraps to shards read earlier
