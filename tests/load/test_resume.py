"""fastload.DataLoader.state_dict / load_state_dict: exact resume in a new process, kill -9, errors."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler, Sampler

from fastload import DataLoader, LMDBImageDataset, ResumeStateError
from fastload.load.transforms import collate_uint8, train_transform
from resumable import Indexed, Stateful

SCRIPT = Path(__file__).with_name("resume_script.py")
ROOT = Path(__file__).resolve().parents[2]


def run_script(cfg: dict, timeout: float = 120) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(cfg)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(cfg["out"]).read_text())


CASES = [  # kind, workers (threads with backend="threads"), shuffle, saving backend, resuming backend
    pytest.param("map", 0, False, "processes", "processes", id="map-0w", marks=pytest.mark.slow),
    pytest.param("map", 0, True, "processes", "processes", id="map-0w-shuffle"),
    pytest.param("iterable", 0, False, "processes", "processes", id="iterable-0w"),
    pytest.param("map", 2, True, "processes", "processes", id="map-2w-shuffle"),
    pytest.param("map", 2, False, "processes", "processes", id="map-2w", marks=pytest.mark.slow),
    pytest.param("iterable", 2, False, "processes", "processes", id="iterable-2w", marks=pytest.mark.slow),
    pytest.param("map", 2, True, "threads", "threads", id="threads-map-2t-shuffle"),
    pytest.param("map", 0, False, "threads", "threads", id="threads-map-0t", marks=pytest.mark.slow),
    pytest.param("store", 2, True, "threads", "threads", id="threads-store-2t-shuffle"),
    pytest.param("store", 2, True, "threads", "processes", id="threads-to-processes-store"),
    pytest.param("store", 2, False, "processes", "threads", id="processes-to-threads-store", marks=pytest.mark.slow),
    pytest.param("store", 1, True, "processes", "processes", id="store-1w-shuffle", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind, workers, shuffle, backend, resume_backend", CASES)
def test_resume_in_a_new_process_equals_the_uninterrupted_run(tmp_path, tiny_store, kind, workers, shuffle,
                                                              backend, resume_backend):
    n = 24 if kind == "store" else 22  # the store: tiny_store's 24 samples, crops compared as well
    base = dict(kind=kind, n=n, batch=4, workers=workers, shuffle=shuffle, ckpt_dir=str(tmp_path),
                store=str(tiny_store), backend=backend, resume_backend=resume_backend)
    n_batches = 6  # 22 or 24 samples in batches of 4 (iterable, 2 workers: 3 + 3 batches, one partial each)
    full = run_script({**base, "save_at": [0, 2, 3, n_batches], "epochs": 2, "out": str(tmp_path / "full.json")})
    epoch0, epoch1 = full["epochs"]
    assert len(epoch0) == n_batches and sum(map(len, epoch0)) == n
    if kind != "store":
        assert sorted(i for b in epoch0 for i in b) == list(range(n))
    ks = (0, 2, 3, n_batches)
    # seed 999: the resuming process's own RNG must not matter; the checkpoint restores it
    runs = run_script({**base, "resume": [str(tmp_path / f"{k}.pt") for k in ks], "seed": 999, "epochs": 2,
                       "out": str(tmp_path / "rest.json")})["runs"]
    for k, rest in zip(ks, runs):
        assert epoch0[:k] + rest[0] == epoch0, f"k={k}"
        assert rest[1] == epoch1, f"k={k}: the next epoch differs"
    if shuffle or kind == "store":
        assert epoch0 != epoch1  # reshuffled, or (store) new crops


@pytest.mark.slow
def test_persistent_workers_resume_exactly(tmp_path):
    base = dict(kind="map", n=22, batch=4, workers=2, shuffle=True, persistent=True, ckpt_dir=str(tmp_path))
    full = run_script({**base, "save_at": [3], "epochs": 2, "out": str(tmp_path / "full.json")})
    rest = run_script({**base, "resume": str(tmp_path / "3.pt"), "seed": 5, "epochs": 2,
                       "out": str(tmp_path / "rest.json")})
    assert full["epochs"][0][:3] + rest["epochs"][0] == full["epochs"][0]
    assert rest["epochs"][1] == full["epochs"][1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_sigkill_after_checkpoint_then_restart_covers_the_epoch_once(tmp_path, backend):
    log = tmp_path / "log.jsonl"
    base = dict(kind="map", n=40, batch=4, workers=2, shuffle=True, generator=3, ckpt_dir=str(tmp_path),
                log=str(log), every=3, step_sleep=0.15, backend=backend)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cfg = {**base, "out": str(tmp_path / "first.json")}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(cfg)], env=env, start_new_session=True)
    ckpt = tmp_path / "latest.pt"
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:  # killed after its second checkpoint (step 6), mid-epoch
            lines = log.read_text().splitlines() if log.exists() else []
            if ckpt.exists() and len(lines) >= 7:
                break
            assert proc.poll() is None, "the training script ended before it could be killed"
            time.sleep(0.05)
        else:
            pytest.fail("the training script never reached its second checkpoint")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    first = [json.loads(line) for line in log.read_text().splitlines()]
    step = torch.load(ckpt, weights_only=False)["step"]
    assert 6 <= step < 10 and len(first) > step  # killed mid-epoch, after the checkpoint, with work lost
    log.unlink()
    run_script({**base, "resume": str(ckpt), "step_sleep": 0, "every": 0, "out": str(tmp_path / "second.json")})
    second = [json.loads(line) for line in log.read_text().splitlines()]
    kept = [i for rec in first[:step] for i in rec["ids"]]
    redone = [i for rec in second for i in rec["ids"]]
    assert sorted(kept + redone) == list(range(40))  # the epoch, each sample once after the checkpoint
    assert [rec["step"] for rec in second] == list(range(step + 1, 11))
    uninterrupted = run_script({**base, "log": None, "every": 0, "step_sleep": 0,
                                "out": str(tmp_path / "u.json")})["epochs"][0]
    assert [i for b in uninterrupted for i in b] == kept + redone  # and in the same order


# ---- in-process: samplers, augmentation, elastic arithmetic, errors -------------------------

# the loader's own arguments per backend: what a test builds runs once on each
BACKENDS = [pytest.param({}, id="processes"), pytest.param({"backend": "threads", "num_workers": 2}, id="threads")]
PAIRS = [pytest.param(a, b, id=f"{a}-to-{b}") for a in ("processes", "threads") for b in ("processes", "threads")]

def ids(batches) -> list[list[int]]:
    return [[int(i) for i in b] for b in batches]


def roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class EveryThird(Sampler[int]):
    """A custom sampler with its own state: a rotating offset that advances every epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.offset = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        start, self.offset = self.offset, self.offset + 1
        yield from ((start + 3 * i) % self.n for i in range(self.n))

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, sd: dict) -> None:
        self.offset = sd["offset"]


@pytest.mark.parametrize("bk", BACKENDS)
def test_custom_stateful_sampler_resumes_in_its_second_epoch(bk):
    def make():
        return DataLoader(Indexed(20), batch_size=3, sampler=EveryThird(20), **bk)

    ref = make()
    e0, e1, e2 = ids(ref), ids(ref), ids(ref)
    assert e0 != e1
    loader = make()
    ids(loader)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(4)]
    sd = roundtrip(loader.state_dict())
    fresh = make()
    fresh.load_state_dict(sd)
    assert head + ids(fresh) == e1
    assert ids(fresh) == e2


def test_index_sampler_still_reads_like_the_batch_sampler():
    loader = DataLoader(Indexed(10), batch_size=3, drop_last=True)
    it = iter(loader)
    assert it._index_sampler.batch_size == 3 and it._index_sampler.drop_last is True
    assert len(it._index_sampler) == len(loader) == 3


@pytest.mark.parametrize("bk", BACKENDS)
def test_state_is_small_and_picklable_and_holds_no_samples(bk):
    loader = DataLoader(Indexed(10_000), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1), **bk)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    assert sd["epoch"] == 0 and sd["batches"] == 1
    # RNG states only (three, ~6.7 KB each as base64 text): the order of 10,000 samples (>40 KB) is not in it
    assert len(pickle.dumps(sd)) < 24_000
    assert roundtrip(sd) == sd


@pytest.fixture(scope="module")
def store_with_a_bad_sample(tiny_store, tmp_path_factory):
    """``tiny_store`` with sample 4 undecodable (its checksum matching: damage, not bit rot)."""
    from helpers import put_undecodable

    dst = shutil.copytree(tiny_store, tmp_path_factory.mktemp("bad") / "bad.lmdb")
    put_undecodable(dst, 4)
    return dst


@pytest.mark.parametrize("saved_by, resumed_by", PAIRS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_preset_augmentation_depends_on_seed_epoch_index_not_on_workers_backend_or_resume(
        tiny_store, store_with_a_bad_sample, saved_by, resumed_by, on_error):
    store = tiny_store if on_error == "raise" else store_with_a_bad_sample  # skip: sample 5 stands in for 4
    ds = LMDBImageDataset(store, transform=train_transform(32), on_error=on_error)

    def make(workers, batch, backend):
        return DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=collate_uint8, shuffle=True,
                          generator=torch.Generator().manual_seed(11), backend=backend)

    ref = make(0, 4, saved_by)
    ref0, ref1 = (torch.cat([im for im, _ in ref]) for _ in range(2))
    any_worker = make(2, 4, resumed_by)
    assert torch.equal(ref0, torch.cat([im for im, _ in any_worker]))  # any worker or thread draws the same crop
    assert not torch.equal(ref0, ref1)  # epoch 1 draws new crops
    loader = make(0, 4, saved_by)
    it = iter(loader)
    head = [next(it)[0] for _ in range(2)]
    resumed = make(2, 4, resumed_by)
    resumed.load_state_dict(roundtrip(loader.state_dict()))
    assert torch.equal(torch.cat(head + [im for im, _ in resumed]), ref0)
    assert torch.equal(torch.cat([im for im, _ in resumed]), ref1)  # and the epoch after
    if on_error == "skip":
        assert ds.skipped > 0


@pytest.mark.parametrize("saved_by, resumed_by", PAIRS)
@pytest.mark.parametrize("workers", [0, 2])
def test_state_before_the_first_batch_resumes_that_epoch(saved_by, resumed_by, workers):
    """iter() called, next() not yet: the epoch's order (and the generator it drew from) is kept."""
    def make(backend):
        return DataLoader(Indexed(23), batch_size=4, shuffle=True, num_workers=workers, backend=backend,
                          generator=torch.Generator().manual_seed(2))

    def state_after_iter(loader) -> dict:
        it = iter(loader)
        sd = roundtrip(loader.state_dict())
        del it
        assert sd["batches"] == 0
        return sd

    ref = make(saved_by)
    whole = [ids(ref) for _ in range(3)]
    resumed = make(resumed_by)
    resumed.load_state_dict(state_after_iter(make(saved_by)))
    again = make(resumed_by)  # a resumed loader's state before its first batch is that state again
    again.load_state_dict(state_after_iter(resumed))
    assert [ids(again) for _ in range(3)] == whole
    between = make(saved_by)
    ids(between)
    resumed = make(resumed_by)  # saved between epochs, resumed, iter() but no next()
    resumed.load_state_dict(roundtrip(between.state_dict()))
    again = make(resumed_by)
    again.load_state_dict(state_after_iter(resumed))
    assert [ids(again) for _ in range(2)] == whole[1:]


@pytest.mark.parametrize("saved_by, resumed_by", PAIRS)
def test_state_counts_the_batches_received_not_those_read_ahead(saved_by, resumed_by):
    """The saving run's workers or threads have read the sampler further (to its end, where
    RandomSampler draws from the generator again) than the resuming run will have: neither the
    rest of the epoch nor the next one may depend on it."""
    def make(backend, workers, prefetch):
        return DataLoader(Indexed(23), batch_size=4, shuffle=True, num_workers=workers, backend=backend,
                          prefetch_factor=prefetch, generator=torch.Generator().manual_seed(3))

    ref = make(saved_by, 0, None)
    whole = ids(ref) + ids(ref)
    loader = make(saved_by, 2, 4)  # takes indices 4 (threads) or 8 (processes) batches ahead: to the end
    it = iter(loader)
    head = ids(next(it) for _ in range(2))
    sd = roundtrip(loader.state_dict())
    assert sd["batches"] == 2
    del it
    resumed = make(resumed_by, 0, None)  # reads nothing ahead
    resumed.load_state_dict(sd)
    assert head + ids(resumed) + ids(resumed) == whole


def dist_loader(n, world, rank, batch, seed=0, epoch=0, drop_last=False, bk=None):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    return DataLoader(Indexed(n), batch_size=batch, sampler=s, **(bk or {})), s


@pytest.mark.parametrize("n, world, new_world, k, batch", [
    (46, 2, 3, 2, 4), (46, 2, 2, 3, 4), (50, 4, 1, 1, 3), (37, 3, 2, 2, 5), (46, 2, 3, 0, 4), (46, 2, 5, 6, 4),
])
@pytest.mark.parametrize("bk", BACKENDS)
def test_elastic_resume_covers_the_rest_of_the_epoch_once(n, world, new_world, k, batch, bk):
    seen, states = [], []
    for r in range(world):
        loader, _ = dist_loader(n, world, r, batch, bk=bk)
        it = iter(loader)
        seen += [i for _ in range(min(k, len(loader))) for i in next(it).tolist()]
        states.append(roundtrip(loader.state_dict()))
    assert all(s["order"] == states[0]["order"] for s in states)  # rank 0's state describes all ranks
    unique_seen = set(seen)
    rest, per_rank = [], []
    for r in range(new_world):
        loader, _ = dist_loader(n, new_world, r, batch, bk=bk)
        loader.load_state_dict(states[0])
        mine = [i for b in loader for i in b.tolist()]
        per_rank.append(len(mine))
        rest += mine
    assert len(set(per_rank)) == 1  # every rank the same number of samples: DDP stays in step
    assert unique_seen | set(rest) == set(range(n))
    remaining = set(range(n)) - unique_seen
    assert set(rest) >= remaining  # none lost
    pad = -len(remaining) % new_world if new_world != world else len(seen) + len(rest) - n
    assert len(rest) == len(remaining) + pad  # none repeated, but for DistributedSampler-style padding
    if pad == 0:
        assert len(set(rest)) == len(rest) and not set(rest) & unique_seen
    if new_world == world:  # same world: exactly the uninterrupted run, rank by rank
        for r in range(world):
            loader, _ = dist_loader(n, world, r, batch, bk=bk)
            whole = [i for b in loader for i in b.tolist()]
            resumed, _ = dist_loader(n, world, r, batch, bk=bk)
            resumed.load_state_dict(states[0])
            assert whole[min(k, len(loader)) * batch:] == [i for b in resumed for i in b.tolist()]


@pytest.mark.parametrize("bk", BACKENDS)
def test_elastic_next_epoch_is_the_uninterrupted_permutation(bk):
    loader, sampler = dist_loader(46, 2, 0, 4, bk=bk)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    new, s3 = dist_loader(46, 3, 1, 4, bk=bk)
    new.load_state_dict(sd)
    list(new)
    s3.set_epoch(1)
    ref = DistributedSampler(range(46), num_replicas=3, rank=1, shuffle=True, seed=0)
    ref.set_epoch(1)
    assert [i for b in new for i in b.tolist()] == list(ref)


@pytest.mark.parametrize("bk", BACKENDS)
def test_resumed_distributed_epoch_checks_set_epoch(bk):
    loader, _ = dist_loader(46, 2, 0, 4, epoch=3, bk=bk)
    it = iter(loader)
    next(it)
    other, _ = dist_loader(46, 2, 0, 4, epoch=4, bk=bk)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ResumeStateError, match=r"set_epoch\(3\)"):
        next(iter(other))
    unshuffled = DataLoader(Indexed(46), batch_size=4, sampler=DistributedSampler(
        range(46), num_replicas=2, rank=0, shuffle=False, seed=0), **bk)
    unshuffled.sampler.set_epoch(3)
    unshuffled.load_state_dict(loader.state_dict())
    with pytest.raises(ResumeStateError, match="shuffle=True"):
        next(iter(unshuffled))


@pytest.mark.parametrize("bk", BACKENDS)
def test_loaded_state_reads_back_unchanged_until_iteration(bk):
    loader = DataLoader(Indexed(20), batch_size=4, shuffle=True, **bk)
    it = iter(loader)
    next(it)
    sd = loader.state_dict()
    fresh = DataLoader(Indexed(20), batch_size=4, shuffle=True, **bk)
    fresh.load_state_dict(sd)
    assert fresh.state_dict() == sd


class Named(Indexed):
    def __init__(self, names: list[str]) -> None:
        super().__init__(len(names))
        self.root = "/data"
        self.samples = [(f"/data/{x}", 0) for x in names]


@pytest.mark.parametrize("change, match", [
    (lambda sd: {**sd, "format": "something"}, "not a fastload.DataLoader state"),
    (lambda sd: [1, 2], "not a fastload.DataLoader state"),
    (lambda sd: {**sd, "version": 99}, "version 99"),
    (lambda sd: {k: v for k, v in sd.items() if k != "epoch"}, r"corrupt.*missing \['epoch'\]"),
    (lambda sd: {**sd, "batches": -3}, r"corrupt.*invalid \['batches'\]"),
    (lambda sd: {**sd, "dataset": {**sd["dataset"], "len": 21}}, "dataset length was 21 when saved, is 20"),
    (lambda sd: {**sd, "seed": 5}, "the seed was 5 when saved, is 1 now"),
    (lambda sd: {**sd, "dataset": {**sd["dataset"], "kind": "iterable"}}, "dataset kind"),
])
@pytest.mark.parametrize("bk", BACKENDS)
def test_corrupt_or_mismatched_state_is_a_clear_error(change, match, bk):
    loader = DataLoader(Indexed(20), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), **bk)
    it = iter(loader)
    next(it)
    fresh = DataLoader(Indexed(20), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), **bk)
    with pytest.raises(ResumeStateError, match=match):
        fresh.load_state_dict(change(loader.state_dict()))


@pytest.mark.parametrize("bk", BACKENDS)
def test_other_dataset_same_length_other_batch_size_other_sampler_are_refused(bk):
    a = DataLoader(Named(["a.jpg", "b.jpg", "c.jpg"]), batch_size=1, **bk)
    it = iter(a)
    next(it)
    with pytest.raises(ResumeStateError, match="identity"):
        DataLoader(Named(["a.jpg", "b.jpg", "x.jpg"]), batch_size=1, **bk).load_state_dict(a.state_dict())
    with pytest.raises(ResumeStateError, match="batch_size was 1 when saved, is 2"):
        DataLoader(Named(["a.jpg", "b.jpg", "c.jpg"]), batch_size=2, **bk).load_state_dict(a.state_dict())
    same = Named(["a.jpg", "b.jpg", "c.jpg"])
    d = DataLoader(same, batch_size=1, sampler=DistributedSampler(same, num_replicas=1, rank=0, shuffle=False), **bk)
    with pytest.raises(ResumeStateError, match="the sampler was 'replay'"):
        d.load_state_dict(a.state_dict())
    moved = Named(["a.jpg", "b.jpg", "c.jpg"])
    moved.root, moved.samples = "/elsewhere", [(p.replace("/data", "/elsewhere"), 0) for p, _ in moved.samples]
    DataLoader(moved, batch_size=1, **bk).load_state_dict(a.state_dict())  # a moved dataset is the same dataset


class Plain(torch.utils.data.IterableDataset):
    """An iterable dataset with no state_dict: resumed by reading its batches again."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        yield from (i for i in range(18) if i % nw == wid)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_without_state_is_fast_forwarded(workers):
    whole = ids(DataLoader(Plain(), batch_size=4, num_workers=workers))
    loader = DataLoader(Plain(), batch_size=4, num_workers=workers)
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    sd = roundtrip(loader.state_dict())
    del it
    fresh = DataLoader(Plain(), batch_size=4, num_workers=workers)
    fresh.load_state_dict(sd)
    assert head + ids(fresh) == whole


@pytest.mark.gpu
def test_pinned_batches_of_a_stateful_iterable_with_workers_resume_exactly():
    def make():
        return DataLoader(Stateful(), batch_size=4, num_workers=2, pin_memory=True)

    whole = ids(make())
    loader = make()
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    assert all(b.is_pinned() for b in head)  # the per-worker state rides along without unpinning the batch
    sd = roundtrip(loader.state_dict())
    del it
    fresh = make()
    fresh.load_state_dict(sd)
    rest = list(fresh)
    assert all(b.is_pinned() for b in rest)
    assert ids(head) + ids(rest) == whole


def test_store_identity_is_its_checksums_and_labels(tiny_store):
    from types import SimpleNamespace

    from fastload.load.state import dataset_identity

    a, b = LMDBImageDataset(tiny_store), LMDBImageDataset(tiny_store)
    assert dataset_identity(a) == dataset_identity(b) and dataset_identity(a).startswith("store:")
    crc = a._reader.crc32.copy()
    crc[3] ^= 1  # one sample's bytes differ
    other = SimpleNamespace(_reader=SimpleNamespace(crc32=crc, labels=a._reader.labels))
    assert dataset_identity(other) != dataset_identity(a)
    loader = DataLoader(a, batch_size=4, collate_fn=list)
    next(iter(loader))
    sd = loader.state_dict()
    DataLoader(b, batch_size=4).load_state_dict(sd)  # the same store, opened again: accepted
    with pytest.raises(ResumeStateError, match="dataset identity"):
        DataLoader(b, batch_size=4).load_state_dict({**sd, "dataset": {**sd["dataset"], "identity": "store:x"}})


@pytest.mark.parametrize("bk", BACKENDS)
def test_preset_augmentation_under_distributed_sampler_is_the_same_on_any_rank_layout(tiny_store, bk):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(32))

    def images_by_index(world: int) -> dict[int, torch.Tensor]:
        out = {}
        for rank in range(world):
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=4)
            order = list(sampler)
            loader = DataLoader(ds, batch_size=5, sampler=sampler, collate_fn=collate_uint8, **bk)
            images = torch.cat([im for im, _ in loader])
            out.update({i: im for i, im in zip(order, images)})
        return out

    two, one = images_by_index(2), images_by_index(1)
    assert sorted(one) == sorted(two) == list(range(len(ds)))
    assert all(torch.equal(one[i], two[i]) for i in one)  # sample i gets the same crop on any rank
