"""fastload.DataLoader, auto_num_workers and DevicePrefetcher."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.data

from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.prefetch import DevicePrefetcher
from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD, collate_uint8, train_transform
from fastload.load.workers import worker_plan
from fastload.system import CpuBudget

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


def budget(n: int) -> CpuBudget:
    return CpuBudget(os_cpus=64, affinity_cpus=n, cgroup_quota=None, cgroup_source=None, available=n)


@pytest.mark.parametrize("cpus, env, gpus, workers", [
    (1, {}, 0, 0),                              # one CPU: load in the main process
    (2, {}, 0, 2),                              # two or three: one worker per CPU
    (3, {}, 0, 3),
    (8, {}, 0, 7),                              # four or more: leave one for training
    (32, {}, 4, 7),                             # 4 GPUs, no torchrun: 8 CPUs each
    (32, {"LOCAL_WORLD_SIZE": "8"}, 4, 3),      # torchrun says 8 local ranks: 4 CPUs each
    (4, {"LOCAL_WORLD_SIZE": "8"}, 8, 0),       # fewer CPUs than ranks: never negative
])
def test_worker_rule(cpus, env, gpus, workers):
    plan = worker_plan(env=env, budget=budget(cpus), visible_gpus=gpus)
    assert plan.workers == workers
    assert plan.main_threads == max(1, plan.cpus_per_process - workers)
    assert "CPUs per process" in plan.explain()


@pytest.mark.parametrize("cpus, env, gpus, workers, headroom", [
    (2, {}, 1, 1, 1),                           # a GPU host keeps a CPU for kernel launches
    (3, {}, 1, 2, 1),
    (12, {"LOCAL_WORLD_SIZE": "4"}, 4, 2, 1),   # 3 CPUs per rank, beside 4 GPUs
    (2, {}, 0, 2, 0),                           # no GPU: the rule's assumption says why no headroom
])
def test_auto_workers_leave_headroom_on_gpu_hosts_and_say_what_they_assumed(cpus, env, gpus, workers, headroom,
                                                                            monkeypatch, caplog):
    import logging

    import fastload.load.workers as workers_mod

    plan = worker_plan(env=env, budget=budget(cpus), visible_gpus=gpus)
    assert (plan.workers, plan.headroom) == (workers, headroom)
    assert ("GPU" in plan.assumption) and ("kernel launches" in plan.assumption) == (gpus > 0)
    assert f"assumed: {plan.assumption}" in plan.explain()
    monkeypatch.setattr(workers_mod, "cpu_budget", lambda: budget(cpus))
    monkeypatch.setattr(workers_mod, "_visible_gpus", lambda: gpus)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level(logging.INFO, logger="fastload.load.workers"):
        assert workers_mod.auto_num_workers() == workers
    assert f"num_workers='auto' -> {workers}" in caplog.text and plan.assumption in caplog.text


def test_signature_is_torchs_plus_main_threads_backend_snapshot_every_n_steps_autotune_and_reuse():
    ours = inspect.signature(DataLoader.__init__).parameters
    theirs = inspect.signature(torch.utils.data.DataLoader.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    assert list(ours)[len(theirs):] == ["main_threads", "backend", "snapshot_every_n_steps", "autotune",
                                        "reuse_batch_memory"]
    assert ours["reuse_batch_memory"].default is True
    assert ours["snapshot_every_n_steps"].default == 1  # torchdata StatefulDataLoader's default
    assert ours["snapshot_every_n_steps"].kind == inspect.Parameter.KEYWORD_ONLY
    for name, p in theirs.items():
        if name != "pin_memory":
            assert ours[name].default == p.default, name
            assert ours[name].kind == p.kind, name
    assert issubclass(DataLoader, torch.utils.data.DataLoader)


def test_generic_like_torchs():
    def make() -> DataLoader[list[torch.Tensor]]:  # subscripting must work, as it does for torch's
        return DataLoader([])

    assert DataLoader[int] is not None and make() is not None


def test_num_workers_auto_and_explicit(tiny_store, monkeypatch):
    import fastload.load.loader as loader_mod

    monkeypatch.setattr(loader_mod, "auto_num_workers", lambda: 2)
    ds = LMDBImageDataset(tiny_store)
    assert DataLoader(ds, num_workers="auto").num_workers == 2
    assert DataLoader(ds, num_workers=1).num_workers == 1
    assert DataLoader(ds).num_workers == 0
    with pytest.raises(ValueError, match="Valid values are 'auto'"):
        DataLoader(ds, num_workers="many")


def test_pin_memory_defaults_to_cuda_availability(tiny_store):
    ds = LMDBImageDataset(tiny_store)
    assert DataLoader(ds).pin_memory == torch.cuda.is_available()
    assert DataLoader(ds, pin_memory=False).pin_memory is False


def test_behaves_like_torch_for_plain_datasets():
    data = torch.arange(10)
    ours = list(DataLoader(data, batch_size=4, drop_last=True))
    theirs = list(torch.utils.data.DataLoader(data, batch_size=4, drop_last=True))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and len(ours) == 2
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [b.tolist() for b in DataLoader(data, batch_size=3, shuffle=True, generator=g1)] == \
        [b.tolist() for b in torch.utils.data.DataLoader(data, batch_size=3, shuffle=True, generator=g2)]
    assert len(DataLoader(data, batch_size=3)) == 4


class Boom(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise KeyError("sample 2 is broken")
        return i


def test_worker_errors_surface_in_the_main_process():
    with pytest.raises(KeyError, match="sample 2 is broken"):
        list(DataLoader(Boom(), batch_size=1, num_workers=2))


def test_main_thread_budget_applied_while_workers_run_and_restored_after():
    code = textwrap.dedent("""
        import torch
        from fastload import DataLoader
        torch.set_num_threads(8)
        import fastload.load.loader as m
        m.main_thread_budget = lambda n: 2 - n if n < 2 else 1
        print([torch.get_num_threads() for _ in DataLoader(torch.arange(8), batch_size=4, num_workers=1)])
        print(torch.get_num_threads())                       # exhausted: given back
        it = iter(DataLoader(torch.arange(8), batch_size=4, num_workers=1, persistent_workers=True))
        next(it)
        print(torch.get_num_threads())                       # mid-epoch: still capped
        it._shutdown_workers()
        print(torch.get_num_threads())                       # shut down mid-epoch: given back
        torch.set_num_threads(3)
        print([torch.get_num_threads() for _ in DataLoader(torch.arange(8), batch_size=4, num_workers=1,
                                                           main_threads=None)])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:5] == ["[1, 1]", "8", "1", "8", "[3, 3]"]


def test_fast_path_batches_are_uint8_and_prefetcher_normalises(tiny_store):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(64))
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_uint8, shuffle=True)
    raw_images, raw_labels = next(iter(loader))
    assert raw_images.dtype == torch.uint8 and raw_images.shape == (8, 3, 64, 64)
    seen = 0
    for images, labels in DevicePrefetcher(loader, "cpu"):
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 64, 64)
        assert labels.dtype == torch.int64 and labels.dim() == 1
        assert -2.2 < images.min() and images.max() < 2.7  # ImageNet-normalised range
        seen += len(labels)
    assert seen == len(ds)


@pytest.mark.parametrize("device", DEVICES)
def test_prefetcher_contract_and_values(device):
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    labels = [1, 2, 3, 4]
    loader = [(images, torch.tensor(labels))] * 3
    out = list(DevicePrefetcher(loader, device, dtype=torch.bfloat16, channels_last=True))
    assert len(out) == 3
    x, y = out[0]
    assert x.device.type == device and y.device.type == device
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.int64 and y.tolist() == labels
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(x.float().cpu(), (images / 255 - mean) / std, atol=0.03, rtol=0.01)


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_prefetcher_on_cpu_reuses_a_buffer_only_when_no_batch_holds_it(channels_last, ahead):
    from fastload.load.transforms import normalize

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(4))
               for _ in range(6)]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    pf = DevicePrefetcher(batches, "cpu", channels_last=channels_last, ahead=ahead)
    held = [x for x, _ in pf]  # every batch kept: none may be rewritten by a later one
    for (raw, _), x in zip(batches, held):
        assert x.is_contiguous(memory_format=fmt)
        assert torch.equal(x, normalize(raw, channels_last=channels_last))
    pooled = {buf.data_ptr() for buf, _, _ in pf._buffers.pool}
    # ahead: the batch the step holds, the one ready and the one being written
    assert len(pooled) == (3 if ahead else 2) and len({x.data_ptr() for x in held}) == 6
    del held, x
    seen = []
    for (raw, _), (x, _) in zip(batches, pf):  # each batch dropped before the next but one: the pool serves
        assert torch.equal(x, normalize(raw, channels_last=channels_last))
        seen.append(x.data_ptr())
    assert set(seen) <= pooled
    del x
    # what else holds a batch: its storage object alone (not a tensor: the use count misses it) ...
    stores = [x.untyped_storage() for x, _ in pf]
    assert len({st.data_ptr() for st in stores}) == 6  # none rewritten while its storage is held
    del stores
    # ... or another process, once its memory is shared (a torch.multiprocessing queue shares it)
    it = iter(pf)
    shared, _ = next(it)
    shared.share_memory_()
    del shared
    for _ in it:
        pass
    assert pf._buffers.pool and not any(buf.is_shared() for buf, _, _ in pf._buffers.pool)
    # an idle buffer of another shape makes room: a partial batch does not take a slot for good
    odd = DevicePrefetcher([(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.arange(2))] + batches, "cpu",
                           channels_last=channels_last, ahead=ahead)
    full = [x for x, _ in odd if len(x) == 4]  # every full batch held: each needs a buffer, the partial one's idles
    assert len({x.data_ptr() for x in full}) == 6
    assert all(buf.shape == (4, 3, 8, 8) for buf, _, _ in odd._buffers.pool)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        normalize(batches[0][0], out=torch.empty(4, 3, 8, 9))
    with pytest.raises(ValueError, match="uint8 NCHW images on the CPU"):
        normalize(batches[0][0], dtype=torch.bfloat16, out=torch.empty(4, 3, 8, 8))


@pytest.mark.parametrize("channels_last", [False, True])
def test_prefetcher_on_cpu_survives_a_partial_last_batch_epoch_after_epoch(channels_last):
    # the pool made room for the partial batch's shape with list.remove, whose == on (tensor, ...) entries
    # raised "Boolean value of Tensor with more than one value is ambiguous" unless the idle buffer was first
    from fastload.load.transforms import normalize

    g = torch.Generator().manual_seed(0)
    epoch = [(torch.randint(0, 256, (4 if k < 3 else 2, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(4))
             for k in range(4)]  # 3 full batches, then a partial one, as a DataLoader without drop_last ends
    pf = DevicePrefetcher(epoch, "cpu", channels_last=channels_last)
    for _ in range(3):
        for (raw, _), (x, _) in zip(epoch, pf):
            assert torch.equal(x, normalize(raw, channels_last=channels_last))
        del x


class _CountingLoader:
    """Batches of uint8 images; records how many were drawn and from which thread, and can fail at one."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8, generator=g), torch.arange(4) + k)
                        for k in range(n)]
        self.fail_at, self.drawn, self.threads = fail_at, 0, set()

    def __iter__(self):
        import threading

        for k, batch in enumerate(self.batches):
            self.threads.add(threading.current_thread().name)
            if k == self.fail_at:
                raise RuntimeError(f"sample {4 * k} of batch {k} is broken")
            self.drawn += 1
            yield batch


@pytest.mark.parametrize("ahead", [True, False])
def test_prefetcher_on_cpu_normalises_the_next_batch_during_the_step_and_holds_one_ahead(monkeypatch, ahead):
    import threading

    import fastload.load.prefetch as prefetch
    from fastload.load.transforms import normalize

    prepared: list[tuple[int, str]] = []  # (first label, thread) per batch converted
    started = {k: threading.Event() for k in range(6)}
    real = prefetch.prepare_batch

    def recording(batch, *args, **kwargs):
        k = int(batch[1][0])
        prepared.append((k, threading.current_thread().name))
        started[k].set()
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(prefetch, "prepare_batch", recording)
    loader = _CountingLoader(6)
    got = []
    for k, (x, y) in enumerate(DevicePrefetcher(loader, "cpu", ahead=ahead)):
        assert torch.equal(x, normalize(loader.batches[k][0])) and y.tolist() == loader.batches[k][1].tolist()
        # one batch drawn ahead at most (ahead=False: none), so a loader's state counts at most one unseen batch
        assert loader.drawn == min(6, k + 2 if ahead else k + 1)
        if ahead and k < 5:  # the step (here: this wait) runs while the helper converts the next batch
            assert started[k + 1].wait(10)
        got.append(k)
    assert got == list(range(6))
    main = threading.current_thread().name
    assert loader.threads == {main}  # the loader is always asked in the calling thread: a profiler sees its waits
    converted_on = {name for _, name in prepared}
    assert [k for k, _ in prepared] == list(range(6))
    if ahead:
        assert converted_on and main not in converted_on
        assert all(name.startswith("fastload-prefetch") for name in converted_on)
    else:
        assert converted_on == {main}


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_prefetcher_hands_out_every_batch_before_the_loaders_error(device, ahead):
    loader = _CountingLoader(6, fail_at=3)
    it = iter(DevicePrefetcher(loader, device, ahead=ahead))
    for k in range(3):
        x, y = next(it)
        assert x.device.type == device and y.cpu().tolist() == loader.batches[k][1].tolist()
    with pytest.raises(RuntimeError, match="sample 12 of batch 3 is broken"):
        next(it)


def test_prefetcher_closed_early_leaves_no_helper_thread():
    import threading

    before = set(threading.enumerate())

    def helpers():
        return [t for t in set(threading.enumerate()) - before if t.name.startswith("fastload-prefetch")]

    it = iter(DevicePrefetcher(_CountingLoader(6), "cpu"))
    next(it)
    assert helpers()  # converting the next batch
    it.close()  # what a `break` out of the loop does, once the iterator is dropped
    assert not helpers()
    for _ in DevicePrefetcher(_CountingLoader(0), "cpu"):  # an empty loader starts no helper
        pass
    assert not helpers()


@pytest.mark.parametrize("ahead", [True, False])
def test_a_none_batch_is_refused_by_name_not_taken_for_the_end(ahead):
    # a collate_fn that returns None mid-epoch: the batch is named as wrong, the epoch does not end quietly
    batches = [(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.arange(2)), None,
               (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), torch.arange(2))]
    it = iter(DevicePrefetcher(batches, "cpu", ahead=ahead))
    next(it)
    with pytest.raises(TypeError, match="got NoneType"):
        next(it)


def test_a_loop_in_a_thread_that_outlives_the_main_thread_keeps_its_batches(tmp_path):
    # once the main thread ends, the interpreter's thread pools take no new work ("cannot schedule new futures
    # after interpreter shutdown"): the batches are then normalised in the training thread
    script = tmp_path / "train_in_a_thread.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        import torch
        from fastload.load.prefetch import DevicePrefetcher

        def train():
            while threading.main_thread().is_alive():  # stopped as the interpreter's shutdown begins
                time.sleep(0.01)
            time.sleep(0.2)  # its thread-pool exit hook runs right after
            batches = [(torch.full((2, 3, 8, 8), k, dtype=torch.uint8), torch.arange(2)) for k in range(4)]
            seen = [int(x[0, 0, 0, 0] * 1000) for x, _ in DevicePrefetcher(batches, "cpu")]
            print("trained", len(seen), len(set(seen)))

        threading.Thread(target=train).start()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "trained 4 4" in proc.stdout, proc.stderr


def test_a_device_other_than_cpu_and_cuda_is_prepared_in_the_calling_thread(monkeypatch):
    import threading

    import fastload.load.prefetch as prefetch

    where = []
    monkeypatch.setattr(prefetch, "prepare_batch", lambda batch, *a, **k: where.append(threading.get_ident()) or batch)
    pf = DevicePrefetcher([(torch.zeros(1), torch.zeros(1))] * 3, "cpu")
    pf.device = torch.device("meta")  # stands in for MPS or XPU, whose ops two threads must not run at once
    assert len(list(pf)) == 3 and set(where) == {threading.get_ident()}


@pytest.mark.slow  # the script runs three times (exits_cleanly): 10-18 s, in CI's slow suite
def test_a_script_that_ends_inside_a_cpu_prefetching_loop_exits_cleanly(tmp_path):
    from tests.helpers import exits_cleanly

    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        import torch
        from fastload.load.prefetch import DevicePrefetcher
        batches = [(torch.randint(0, 256, (64, 3, 224, 224), dtype=torch.uint8), torch.arange(64))] * 4
        it = iter(DevicePrefetcher(batches, "cpu"))
        next(it)  # the helper is converting the next batch when the script ends
        print("leaving")
    """))
    exits_cleanly(script, "leaving")


def test_prefetcher_passes_float_batches_through():
    x = torch.randn(2, 3, 4, 4)
    (out, _), = list(DevicePrefetcher([(x, torch.tensor([0, 1]))], "cpu"))
    assert torch.equal(out, x)


@gpu
def test_prefetcher_overlaps_copy_on_a_side_stream(tiny_store):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(64))
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=collate_uint8)
    assert loader.pin_memory
    batches = list(DevicePrefetcher(loader, "cuda"))
    torch.cuda.synchronize()
    assert sum(len(y) for _, y in batches) == len(ds)
    assert all(x.is_cuda and x.dtype == torch.float32 for x, _ in batches)


def test_installed_as_torchs_dataloader_it_still_iterates(monkeypatch):
    """A drop-in may be installed by rebinding torch.utils.data.DataLoader (PyTorch's own tests are run so)."""
    import torch.utils.data

    from fastload.load.loader import DataLoader as FastloadDataLoader

    monkeypatch.setattr(torch.utils.data, "DataLoader", FastloadDataLoader)
    batches = [b.tolist() for b in FastloadDataLoader(list(range(10)), batch_size=4)]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
