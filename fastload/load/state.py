"""What a loader state holds, how it is checked, and the elastic rule for distributed epochs.

Owns: the state format of ``fastload.DataLoader.state_dict()`` (a plain dict of ints, strings,
bytes and the user's own sampler/dataset states: small, picklable, ``torch.save``-able, no
sample data), its validation (``check_state``: every mismatch is a ``ResumeStateError`` that
names the field, the saved and the current value), the dataset identity, per-sample
augmentation seeds, and the segment arithmetic of elastic resume.

The state (``version`` 1)::

    format, version     "fastload.DataLoader", 1
    dataset             {"kind": "map" | "iterable", "len": n | None, "identity": str | None}
    epoch, batches      the epoch to resume and how many of its batches were already yielded
                        (an exhausted epoch is saved as ``epoch + 1, 0``)
    batch_size          of the loader that saved it
    seed                the order's seed: DistributedSampler.seed, or generator.initial_seed()
    generator           the loader's ``generator`` state now (so later epochs match), or None
    order               how the epoch's order is rebuilt (below), or None for a fresh epoch
    sample_seed         the seed of the per-sample augmentation RNG (fastload presets), or None
    dataset_state       an iterable dataset's own ``state_dict()`` (``num_workers=0``)
    workers             {"num_workers", "states", "next"}: per-worker dataset states
                        (iterable dataset, ``num_workers > 0``)

``order`` is ``{"kind": "replay", "sampler": sampler_state | None, "rng": {...}}`` for every
non-distributed sampler: the state the epoch's order was drawn from (the sampler's own
``state_dict()`` if it has one, and torch's RNG states taken just before the sampler drew),
replayed on resume, after which the ``batches`` already yielded are skipped; or
``{"kind": "distributed", "start", "world", "consumed", "shuffle", "drop_last"}``.

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

Must not: import torch's private iterator classes (``_resume_iter.py`` does), or read samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from fastload.errors import ResumeStateError
from fastload.load.transforms import is_preset

__all__ = ["STATE_FORMAT", "STATE_VERSION", "check_state", "dataset_identity", "mix_seed", "segment",
           "global_order", "SampleIndex", "rng_snapshot", "rng_restore", "mismatch_error", "check_dali_state",
           "files_identity", "DALI_STATE_FORMAT"]

STATE_FORMAT = "fastload.DataLoader"
DALI_STATE_FORMAT = "fastload.DALILoader"
STATE_VERSION = 1
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


def mismatch_error(field: str, saved, current, hint: str) -> ResumeStateError:
    return ResumeStateError(f"loader state does not fit this loader: {field} was {saved!r} when saved, "
                            f"is {current!r} now.\nHINT: {hint}")


def check_state(sd: Any, *, kind: str, length: int | None, identity: str | None, seed: int | None,
                batch_size: int | None, distributed: bool, num_workers: int) -> dict:
    """Validate a state against the loader about to load it; return it as a dict.

    Raises:
        ResumeStateError: not a fastload loader state, a newer version, or saved for another
            dataset (kind, length, identity), seed, sampler kind, batch size or worker count.
    """
    if not isinstance(sd, Mapping) or sd.get("format") != STATE_FORMAT:
        got = type(sd).__name__ if not isinstance(sd, Mapping) else f"a dict with format={sd.get('format')!r}"
        raise ResumeStateError(f"not a fastload.DataLoader state: got {got}.\nHINT: pass what "
                               "fastload.DataLoader.state_dict() returned (e.g. checkpoint['loader']).")
    if sd.get("version") != STATE_VERSION:
        raise ResumeStateError(f"loader state version {sd.get('version')!r}; this fastload reads version "
                               f"{STATE_VERSION}.\nHINT: resume with the fastload version that saved it.")
    required = ("dataset", "epoch", "batches", "batch_size", "seed", "generator", "order", "sample_seed",
                "dataset_state", "workers")
    missing = [k for k in required if k not in sd]
    bad_ints = [k for k in ("epoch", "batches") if k not in missing and not (isinstance(sd[k], int)
                                                                            and sd[k] >= 0)]
    if missing or bad_ints or not isinstance(sd.get("dataset"), Mapping):
        raise ResumeStateError(f"corrupt fastload.DataLoader state: missing {missing}, invalid {bad_ints}.\n"
                               "HINT: the checkpoint was damaged or edited; resume from an earlier one.")
    ds = sd["dataset"]
    if ds.get("kind") != kind:
        raise mismatch_error("the dataset kind", ds.get("kind"), kind, "build the loader over the same dataset.")
    if ds.get("len") != length:
        raise mismatch_error("the dataset length", ds.get("len"), length, "build the loader over the same dataset.")
    if ds.get("identity") != identity:
        raise mismatch_error("the dataset identity (checksums and labels)", ds.get("identity"), identity,
                   "this is a different dataset (or store) of the same length; resume with the one it "
                   "was saved with.")
    order = sd["order"]
    if order is not None and (order.get("kind") == "distributed") != distributed:
        raise mismatch_error("the sampler", order.get("kind"), "distributed" if distributed else "replay",
                   "resume under the same kind of sampler (DistributedSampler in both runs, or in neither).")
    if sd["seed"] != seed:
        raise mismatch_error("the seed", sd["seed"], seed, "pass the same seed (DistributedSampler(seed=...) or "
                   "generator=torch.Generator().manual_seed(...)) as the run that saved it.")
    if (order is not None and order.get("kind") == "replay" and sd["batches"] and sd["batch_size"] != batch_size):
        raise mismatch_error("batch_size", sd["batch_size"], batch_size, "a non-distributed epoch resumes by batch "
                   "count: use the same batch_size (DistributedSampler epochs may change it).")
    workers = sd["workers"]
    if workers is not None and workers.get("num_workers") != num_workers:
        raise mismatch_error("num_workers", workers.get("num_workers"), num_workers,
                   "an iterable dataset's state is per worker shard: resume with the same num_workers.")
    return dict(sd)


def check_dali_state(sd: Any, *, source: str, length: int, identity: str | None, seed: int, shuffle: bool,
                     batch_size: int, world: int) -> dict:
    """Validate a ``DALILoader`` state (format ``fastload.DALILoader``); return it as a dict.

    Raises:
        ResumeStateError: not such a state, a newer version, corrupt, or saved for another
            source kind, store/tree, seed, shuffle, batch size, or (folder) world size.
    """
    if not isinstance(sd, Mapping) or sd.get("format") != DALI_STATE_FORMAT:
        got = type(sd).__name__ if not isinstance(sd, Mapping) else f"a dict with format={sd.get('format')!r}"
        raise ResumeStateError(f"not a fastload.DALILoader state: got {got}.\nHINT: pass what "
                               "DALILoader.state_dict() returned.")
    if sd.get("version") != STATE_VERSION:
        raise ResumeStateError(f"loader state version {sd.get('version')!r}; this fastload reads version "
                               f"{STATE_VERSION}.\nHINT: resume with the fastload version that saved it.")
    required = ("source", "len", "identity", "seed", "shuffle", "batch_size", "epoch", "batches", "order")
    missing = [k for k in required if k not in sd]
    bad = [k for k in ("epoch", "batches") if k not in missing and not (isinstance(sd[k], int) and sd[k] >= 0)]
    if missing or bad:
        raise ResumeStateError(f"corrupt fastload.DALILoader state: missing {missing}, invalid {bad}.\n"
                               "HINT: the checkpoint was damaged or edited; resume from an earlier one.")
    hint = "build the DALILoader over the same source with the same settings as the run that saved it."
    for field, current in (("source", source), ("len", length), ("identity", identity), ("seed", seed),
                           ("shuffle", shuffle)):
        if sd[field] != current:
            raise mismatch_error(f"the {field}", sd[field], current, hint)
    if sd["batches"] and sd["batch_size"] != batch_size and source == "folder":
        raise mismatch_error("batch_size", sd["batch_size"], batch_size, "a folder epoch resumes by batch count.")
    if sd["batches"] and sd["batch_size"] != batch_size and sd["order"] is None:
        raise mismatch_error("batch_size", sd["batch_size"], batch_size, hint)
    if source == "folder" and sd["batches"] and sd.get("world", world) != world:
        raise mismatch_error("the world size", sd.get("world"), world, "DALI's file reader shards a folder "
                             "by world size: resume a folder with the same one (a store resumes elastically).")
    return dict(sd)
