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

Must not: read samples or download (the dataset does, told what comes next by ``prefetch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

from fastload.errors import ResumeStateError
from fastload.load.replay import mix_seed

__all__ = ["ShardSampler", "DEFAULT_WINDOW"]

DEFAULT_WINDOW = 4
_FORMAT = "fastload.ShardSampler"


class ShardSampler(Sampler[int]):
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
        self.shard_sizes = [int(s) for s in sizes]
        if not self.shard_sizes or min(self.shard_sizes) < 0:
            raise ValueError(f"shard_sizes must be non-negative counts of at least one shard, got {sizes!r}")
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"Unknown value {window!r} for argument window. Valid values are integers >= 1.")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.window = shuffle, int(seed), drop_last, window
        if prefetch is None and callable(getattr(shard_sizes, "prefetch_shards", None)):
            prefetch = shard_sizes.prefetch_shards
        self.prefetch = prefetch
        self.epoch = 0
        self._segments: list[list[int]] = []  # earlier segments of this epoch: [world, consumed per rank]
        self._start = 0                       # consumed per rank in the current segment when iteration starts
        self._starts = np.cumsum([0] + self.shard_sizes)

    # ---- the plan -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (call before each epoch, as with DistributedSampler)."""
        self.epoch = int(epoch)
        self._segments, self._start = [], 0

    def _stream(self) -> np.ndarray:
        k = len(self.shard_sizes)
        order = (np.random.default_rng(mix_seed(self.seed, self.epoch, 0x5A)).permutation(k)
                 if self.shuffle else np.arange(k))
        return np.concatenate([np.arange(self._starts[s], self._starts[s + 1]) for s in order])

    def _cut(self, stream: np.ndarray, world: int, segment: int) -> list[np.ndarray]:
        n = len(stream)
        per = n // world if self.drop_last else math.ceil(n / world)
        if n and per * world > n:
            stream = np.concatenate([stream, np.resize(stream, per * world - n)])  # pad from the front
        return [self._window_shuffle(stream[r * per:(r + 1) * per], segment, r) for r in range(world)]

    def _window_shuffle(self, piece: np.ndarray, segment: int, rank: int) -> np.ndarray:
        if not self.shuffle or len(piece) == 0:
            return piece
        shard = np.searchsorted(self._starts, piece, side="right") - 1
        runs = np.flatnonzero(np.diff(shard)) + 1                   # where a new shard starts
        bounds = np.concatenate([[0], runs[self.window - 1::self.window], [len(piece)]])
        out = piece.copy()
        for g, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            rng = np.random.default_rng(mix_seed(self.seed, self.epoch, segment, rank, g))
            out[lo:hi] = piece[lo:hi][rng.permutation(hi - lo)]
        return out

    def _pieces(self) -> list[np.ndarray]:
        """Every rank's order in the current segment (each rank computes all: it is cheap)."""
        return self._cut(self._remaining_stream(), self.num_replicas, len(self._segments))

    def order(self) -> np.ndarray:
        """This rank's indices for the rest of the current epoch (what ``iter()`` yields)."""
        return self._pieces()[self.rank][self._start:]

    def shard_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._starts, indices, side="right") - 1

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        shards = self.shard_of(order)
        # the shards in the order this rank first touches them, and where each window starts
        first = np.unique(shards, return_index=True)[1]
        seq = shards[np.sort(first)].tolist()
        pos = 0
        for w0 in range(0, max(len(seq), 1), self.window):
            if self.prefetch is not None:
                ahead = seq[w0 + self.window:w0 + 2 * self.window]
                if ahead:
                    self.prefetch(ahead)
            window = set(seq[w0:w0 + self.window])
            end = pos
            while end < len(order) and shards[end] in window:
                end += 1
            for i in order[pos:end].tolist():
                yield i
            pos = end
        for i in order[pos:].tolist():  # padding that wraps to shards read earlier
            yield i

    def __len__(self) -> int:
        n = self._remaining_total()
        per = n // self.num_replicas if self.drop_last else math.ceil(n / self.num_replicas)
        return max(per - self._start, 0)

    def _remaining_total(self) -> int:
        return len(self._remaining_stream()) if self._segments else int(self._starts[-1])

    def _remaining_stream(self) -> np.ndarray:
        """The epoch's stream less what earlier segments consumed (stream order kept)."""
        stream = self._stream()
        for i, (world, consumed) in enumerate(self._segments):
            pieces = self._cut(stream, world, i)
            done = np.unique(np.concatenate([p[:consumed] for p in pieces]))
            stream = stream[~np.isin(stream, done)]
        return stream

    # ---- resume -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this epoch's iteration starts: seed, epoch, settings and the segments read so far."""
        return {"format": _FORMAT, "seed": self.seed, "epoch": self.epoch, "shuffle": self.shuffle,
                "window": self.window, "drop_last": self.drop_last, "sizes": len(self.shard_sizes),
                "samples": int(self._starts[-1]),
                "segments": [list(s) for s in self._segments] + [[self.num_replicas, self._start]]}

    def load_state_dict(self, state: dict) -> None:
        """Start where ``state`` starts (``resume_from(state, consumed=0)``)."""
        self.resume_from(state, consumed=0)

    def resume_from(self, state: dict, *, consumed: int) -> None:
        """Continue the epoch of ``state`` after every rank consumed ``consumed`` more samples.

        Same world size as the last segment: each rank continues where it was. Another world
        size: a new segment of the unconsumed samples starts, cut for this world.

        Raises:
            ResumeStateError: not a ShardSampler state, or saved for another store or settings.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ResumeStateError("not a fastload.ShardSampler state.\nHINT: pass what ShardSampler.state_dict() "
                                   "(or fastload.DataLoader.state_dict()) returned.")
        for field, now in (("seed", self.seed), ("shuffle", self.shuffle), ("window", self.window),
                           ("drop_last", self.drop_last), ("sizes", len(self.shard_sizes)),
                           ("samples", int(self._starts[-1]))):
            if state.get(field) != now:
                raise ResumeStateError(f"ShardSampler state does not fit this sampler: {field} was "
                                       f"{state.get(field)!r} when saved, is {now!r} now.\nHINT: resume with "
                                       "the same store and ShardSampler settings.")
        segments = [list(s) for s in state["segments"]]
        world, start = segments[-1]
        self.epoch, self._segments = int(state["epoch"]), segments[:-1]
        n = len(self._remaining_stream())
        per = n // world if self.drop_last else math.ceil(n / world)
        start = min(start + int(consumed), per)
        if world == self.num_replicas:
            self._start = start
        else:
            self._segments.append([world, start])
            self._start = 0
