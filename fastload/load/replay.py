"""What a resumed epoch is rebuilt from: its order, its per-sample seeds, and the dataset's identity.

Owns: the world-independent epoch order and its segments (the elastic rule below), per-sample
augmentation seeds (``SampleIndex``, ``seeded_get``; ``mix_seed`` is ``_shard_order.py``'s), snapshots of torch's RNG
states, and the dataset identity a state is checked against. Pure arithmetic over torch's own
samplers and generators: no state format (``state.py``), no iterators (``_resume_iter.py``).

Elastic rule (``DistributedSampler``, torch's own or the automatic one): the epoch's global
order ``perm`` (a function of ``seed`` and ``epoch`` only, never of the world size) is read
in *segments*. A segment starting at position ``start`` for ``W`` ranks is
``perm[start:] + perm[:pad]`` with ``pad`` the few samples (from the front of the epoch, as
DistributedSampler pads) that make its length a multiple of ``W`` (``drop_last``: the
remainder is dropped instead); rank ``r`` reads positions ``r, r + W, ...`` of it. A fresh
epoch is the segment at 0: exactly DistributedSampler's split. After every rank yielded
``k`` batches of ``b`` samples, the first ``W * k * b`` positions of the segment are
consumed (ranks move in lock-step under DDP, so rank 0's state describes every rank).
Resumed by the same ``W``: the segment continues where it stopped, so every rank yields
exactly what it would have. Resumed by ``W' != W``: a new segment starts after the unique
samples consumed, so each remaining sample is read once across the new ranks (plus the
padding, when the remainder does not divide by ``W'``). The next epoch is the plain
DistributedSampler epoch ``epoch + 1``: the same global permutation as the uninterrupted run.

Must not: read samples, or validate a state (``state.py`` does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from fastload.load._shard_order import mix_seed  # re-exported: the loaders' seeds come from here
from fastload.load.transforms import is_preset

__all__ = ["mix_seed", "SampleIndex", "seeded_get", "uses_fastload_preset", "dataset_identity", "files_identity",
           "rng_snapshot", "rng_restore", "global_order", "segment"]


class SampleIndex(int):
    """A sample index that carries the seed its sample's augmentation draws from.

    The loader hands these to its fetcher only; the dataset itself receives a plain ``int``.
    """

    seed: int

    def __new__(cls, value: int, seed: int) -> SampleIndex:
        obj = super().__new__(cls, value)
        obj.seed = seed
        return obj

    def __reduce__(self):
        return (SampleIndex, (int(self), self.seed))


def seeded_get(dataset, index) -> Any:
    """``dataset[index]`` with torch's CPU RNG seeded from the index's seed, then restored."""
    seed = getattr(index, "seed", None)
    if seed is None:
        return dataset[index]
    gen = torch.default_generator
    saved = gen.get_state()
    gen.manual_seed(seed)
    try:
        return dataset[int(index)]
    finally:
        gen.set_state(saved)


def uses_fastload_preset(dataset) -> bool:
    """True when a map-style dataset's transform is a fastload preset (it decodes from bytes)."""
    return is_preset(getattr(dataset, "transform", None))


def dataset_identity(dataset) -> str | None:
    """What makes two datasets the same beyond their length: for a fastload store, its
    checksums and labels (so a moved or copied store still matches); for an ImageFolder-like
    dataset, its relative paths and labels; else None (only the length is compared)."""
    reader = getattr(dataset, "_reader", None)
    if isinstance(getattr(reader, "identity", None), str):  # a remote store: its manifest's shard sha256s
        return reader.identity
    crc, labels = getattr(reader, "crc32", None), getattr(reader, "labels", None)
    h = hashlib.sha1()
    if crc is not None and labels is not None:
        h.update(b"store\0")
        h.update(crc.astype("<u4").tobytes())
        h.update(labels.astype("<i8").tobytes())
        return "store:" + h.hexdigest()[:20]
    samples, root = getattr(dataset, "samples", None), str(getattr(dataset, "root", "") or "")
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple):
        return files_identity(root, samples)
    return None


def files_identity(root: str, samples) -> str:
    """Identity of ``(path, label)`` pairs, paths taken relative to ``root`` (a moved tree matches)."""
    h = hashlib.sha1()
    prefix = root.rstrip("/") + "/" if root else ""
    for path, label in samples:
        path = str(path)
        h.update(f"{path[len(prefix):] if prefix and path.startswith(prefix) else path}\t{label}\n".encode())
    return "samples:" + h.hexdigest()[:20]


def rng_snapshot(generators: Mapping[str, torch.Generator]) -> dict[str, bytes]:
    return {name: bytes(g.get_state().numpy().tobytes()) for name, g in generators.items()}


def rng_restore(generators: Mapping[str, torch.Generator], states: Mapping[str, bytes]) -> None:
    for name, g in generators.items():
        if name in states:
            g.set_state(torch.frombuffer(bytearray(states[name]), dtype=torch.uint8))


def global_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's world-independent order, computed by DistributedSampler itself (one replica)."""
    s = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=False)
    s.set_epoch(epoch)
    return list(s)


def segment(perm: list[int], start: int, world: int, drop_last: bool) -> list[int]:
    """``perm[start:]`` made a multiple of ``world``: padded from the epoch's front, or cut."""
    rest = perm[start:]
    if drop_last:
        return rest[: len(rest) // world * world]
    n = len(perm)
    return rest + [perm[j % n] for j in range(-len(rest) % world)] if n else rest
