"""The shard-ordered epoch of ``ShardSampler``, as plain numpy: ``ShardOrder``.

Owns: the arithmetic of a shard-ordered epoch (the shuffled shard stream, its cut over
ranks, the window shuffle, the segments of an elastic resume, and which shards come next),
and ``mix_seed``. ``load/shards.py`` documents the order; ``ShardSampler`` is this class
plus torch's ``Sampler`` face, the ``torch.distributed`` defaults and the prefetch calls.

Kept apart from ``shards.py`` because DALI's Python workers (spawned; ``_dali_source.py``)
compute the same order per epoch and must not import torch.

Must not: import torch, read samples or download.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fastload.errors import ResumeStateError

__all__ = ["ShardOrder", "DEFAULT_WINDOW", "mix_seed"]

DEFAULT_WINDOW = 4
SHARD_ORDER_FORMAT = "fastload.ShardSampler"
_MASK = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 over each part): cheap, well mixed, stable."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        x = z ^ (z >> 31)
    return x >> 1


class ShardOrder:
    """One rank's shard-ordered indices of a sharded store, epoch by epoch (``ShardSampler``'s core).

    Args: as ``ShardSampler``'s, with ``num_replicas`` and ``rank`` given (no defaults here).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, shard_sizes: Sequence[int], *, num_replicas: int, rank: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, window: int = DEFAULT_WINDOW) -> None:
        self.shard_sizes = [int(s) for s in shard_sizes]
        if not self.shard_sizes or min(self.shard_sizes) < 0:
            raise ValueError(f"shard_sizes must be non-negative counts of at least one shard, got {shard_sizes!r}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas - 1}]")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"Unknown value {window!r} for argument window. Valid values are integers >= 1.")
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.window = shuffle, int(seed), drop_last, window
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

    def windows(self, order: np.ndarray) -> list[tuple[int, int, list[int]]]:
        """How ``order`` is read: ``(start, end, shards to prefetch)`` per window, in order.

        A window is ``window`` shards in the order this rank first touches them; the shards to
        prefetch when it starts are the next window's. Positions after the last window (padding
        that wraps to shards read earlier) are not in any window.
        """
        shards = self.shard_of(order)
        first = np.unique(shards, return_index=True)[1]
        seq = shards[np.sort(first)].tolist()
        out, pos = [], 0
        for w0 in range(0, max(len(seq), 1), self.window):
            window = set(seq[w0:w0 + self.window])
            end = pos
            while end < len(order) and shards[end] in window:
                end += 1
            out.append((pos, end, seq[w0 + self.window:w0 + 2 * self.window]))
            pos = end
        return out

    def window_shards(self, order: np.ndarray, window: tuple[int, int, list[int]]) -> list[int]:
        """The shards a window of ``windows(order)`` reads, in the order it first touches them."""
        shards = self.shard_of(order[window[0]:window[1]])
        return shards[np.sort(np.unique(shards, return_index=True)[1])].tolist()

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
        return {"format": SHARD_ORDER_FORMAT, "seed": self.seed, "epoch": self.epoch, "shuffle": self.shuffle,
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
        if not isinstance(state, dict) or state.get("format") != SHARD_ORDER_FORMAT:
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
