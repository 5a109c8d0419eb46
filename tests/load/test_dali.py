"""fastload.dali.DALILoader: CPU mode here and in CI; GPU mode under the gpu marker."""

from __future__ import annotations

import builtins
import shutil
import subprocess
import sys
import textwrap

import lmdb
import pytest
import torch
from torchvision.datasets import ImageFolder

from ddp import rank_records, torchrun
from fastload.errors import CorruptSampleError, MissingDependencyError
from fastload.load.dataset import LMDBImageDataset
from fastload.load.transforms import EvalTransform, normalize
from fastload.store import format as fmt

dali = pytest.mark.dali
gpu = pytest.mark.gpu


def loader(source, batch_size=5, **kw):
    from fastload.dali import DALILoader

    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 1)
    kw.setdefault("size", 32)
    return DALILoader(source, batch_size, **kw)


@dali
def test_store_epoch_covers_every_sample_once_with_its_label(tiny_store):
    ds = LMDBImageDataset(tiny_store)
    ld = loader(tiny_store, return_index=True, seed=1)
    assert len(ld) == 5  # 24 samples, batches of 5: the last one partial
    orders = []
    for _ in range(3):
        seen = []
        for images, labels, index in ld:
            assert images.shape[1:] == (3, 32, 32) and images.shape[0] == len(labels) <= 5
            assert labels.tolist() == [ds.targets[i] for i in index.tolist()]
            seen += index.tolist()
        assert sorted(seen) == list(range(len(ds)))
        orders.append(seen)
    assert orders[0] != orders[1] != orders[2]  # a new global order every epoch
    again = [i for _, _, idx in loader(tiny_store, return_index=True, seed=1) for i in idx.tolist()]
    assert again == orders[0]  # same seed, same order


@dali
def test_drop_last(tiny_store):
    ld = loader(tiny_store, drop_last=True)
    assert len(ld) == 4
    assert [len(y) for _, y in ld] == [5, 5, 5, 5]


@dali
@pytest.mark.parametrize("train", [True, False])
def test_uint8_batches_are_the_float_batches_before_the_normalise(tiny_store, train):
    from fastload.dali import DALIOptions

    floats = [x for x, _ in loader(tiny_store, seed=3, train=train)]
    raw = [x for x, _ in loader(tiny_store, seed=3, train=train, options=DALIOptions(dtype=torch.uint8))]
    assert len(raw) == len(floats)
    for u8, f32 in zip(raw, floats):  # the same crops and flips (same seed, same graph), not normalised
        assert u8.dtype == torch.uint8 and u8.shape == f32.shape
        torch.testing.assert_close(normalize(u8), f32, atol=1e-4, rtol=0)


@dali
@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_channels_last_batches_are_the_same_values_written_channels_last(tiny_store, device, dtype):
    from fastload.dali import DALIOptions

    planar = [x for x, _ in loader(tiny_store, seed=3, device=device, options=DALIOptions(dtype=dtype))]
    cl = [x for x, _ in loader(tiny_store, seed=3, device=device, options=DALIOptions(dtype=dtype, channels_last=True))]
    assert len(planar) == len(cl) == 5
    for a, b in zip(planar, cl):  # the pipeline writes HWC: handed out as its NCHW view, no transpose
        assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last) and not b.is_contiguous()
        assert b.dtype == dtype and b.shape == a.shape and torch.equal(a, b)


@dali
def test_a_dtype_that_is_neither_float_nor_uint8_is_refused():
    from fastload.dali import DALIOptions

    with pytest.raises(ValueError, match="floating type or torch.uint8"):
        DALIOptions(dtype=torch.int32)


@dali
def test_folder_source_uses_torchvisions_classes(tiny_tree):
    tv = ImageFolder(str(tiny_tree))
    ld = loader(tiny_tree, batch_size=6, shuffle=False, train=False)
    labels = [int(v) for _, y in ld for v in y]
    assert sorted(labels) == sorted(tv.targets)
    assert labels == tv.targets  # unshuffled: torchvision's order


@dali
def test_eval_close_to_fastload_cpu_eval_preset(tiny_store):
    """Documented tolerance: mean |difference| under 0.06 in normalised units (~3.5/255)."""
    ds = LMDBImageDataset(tiny_store)
    from fastload.dali import DALIOptions

    ld = loader(tiny_store, batch_size=4, train=False, size=48, options=DALIOptions(resize=56), return_index=True)
    images, _, index = next(iter(ld))
    ours = normalize(torch.stack([EvalTransform(48, 56).from_bytes(ds.get_bytes(i)) for i in index.tolist()]))
    diff = (images - ours).abs()
    assert diff.mean() < 0.06, diff.mean()


@dali
def test_corrupt_sample_names_index_and_path(tiny_store, tmp_path):
    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    env = lmdb.open(str(store), map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(fmt.sample_key(7), b"\xff\xd8\xff\xe0 this is not a jpeg")
    env.close()
    rel = LMDBImageDataset(store).samples[7][0]
    with pytest.raises(CorruptSampleError, match=rf"sample 7 \({rel}\)"):
        for _ in loader(store, shuffle=False):
            pass


def test_missing_dali_is_a_clear_error(monkeypatch, tiny_store):
    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali"):
            raise ImportError("No module named 'nvidia.dali'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    from fastload.dali import DALILoader

    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[dali\]'"):
        DALILoader(tiny_store, 4)


@dali
@pytest.mark.slow
def test_two_ranks_shard_the_store(tiny_store, tmp_path):
    torchrun("ddp_dali_check.py", 2, tiny_store, tmp_path, timeout=600)
    r0, r1 = rank_records(tmp_path, 2)
    assert r0["len"] == r1["len"] == 3  # 12 samples each, batches of 4
    for e in range(2):
        a, b = r0["epochs"][e], r1["epochs"][e]
        assert len(a) == len(b) == 12 and not set(a) & set(b) and sorted(a + b) == list(range(24))
    assert r0["epochs"][0] != r0["epochs"][1]


@dali
@gpu
def test_gpu_mode_batches_on_the_gpu(tiny_store):
    ld = loader(tiny_store, device="gpu", return_index=True)
    seen = []
    for images, labels, index in ld:
        assert images.is_cuda and labels.is_cuda and images.dtype == torch.float32
        seen += index.tolist()
    assert sorted(seen) == list(range(24))


@dali
def test_dali_cpu_decoder_agrees_with_pillow_on_stored_samples(tiny_store):
    """One store, every decoder: DALI's CPU decoder gives Pillow's pixels for what the store holds."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types
    from PIL import Image
    import io

    ds = LMDBImageDataset(tiny_store)
    blobs = [np.frombuffer(ds.get_bytes(i), dtype=np.uint8) for i in range(len(ds))]

    @pipeline_def(batch_size=len(blobs), num_threads=1, device_id=None)
    def decode():
        return fn.decoders.image(fn.external_source(source=lambda: blobs, batch=True), device="cpu",
                                 output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (out,) = pipe.run()
    for i in range(len(blobs)):
        got = np.asarray(out.at(i)).astype(int)
        want = np.asarray(Image.open(io.BytesIO(blobs[i].tobytes())).convert("RGB")).astype(int)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1, (i, np.abs(got - want).max())


@dali
@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=gpu)])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_undecodable_record_with_a_valid_checksum_is_named(tiny_store, tmp_path, train, device):
    from helpers import put_undecodable

    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    put_undecodable(store, 9)
    rel = LMDBImageDataset(store).samples[9][0]
    with pytest.raises(CorruptSampleError, match=rf"sample 9 \({rel}\) failed to decode") as info:
        for _ in loader(store, train=train, device=device):
            pass
    assert info.value.index == 9 and info.value.relpath == rel


@dali
@pytest.mark.parametrize("damage", ["undecodable", "checksum"])
def test_skip_replaces_a_bad_sample_and_the_epoch_completes(tiny_store, tmp_path, damage, caplog):
    from helpers import edit_store, put_undecodable

    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    if damage == "undecodable":
        put_undecodable(store, 9)
    else:
        edit_store(store, lambda t: t.put(fmt.sample_key(9), t.get(fmt.sample_key(9))[:-1] + b"\x00"))
    ld = loader(store, on_error="skip", return_index=True, seed=2)
    clean = [b[2].tolist() for b in loader(tiny_store, return_index=True, seed=2)]
    with caplog.at_level("WARNING", logger="fastload"):
        got = [(len(y), idx.tolist()) for _, y, idx in ld]
    assert [n for n, _ in got] == [len(b) for b in clean]  # every batch keeps its shape
    seen = [i for _, idx in got for i in idx]
    assert 9 not in seen and len(seen) == 24 and len(set(seen)) == 23  # one sample short, one repeated
    assert ld.skipped == 1 and "skipping" in caplog.text and "sample 9" in caplog.text
    second = [i for _, _, idx in ld for i in idx.tolist()]  # next epoch: a fresh pipeline, still skipping
    assert 9 not in second and len(second) == 24


@dali
def test_skip_gives_up_after_twenty_bad_samples_in_a_row(tiny_store, tmp_path):
    from fastload.errors import TooManyCorruptSamplesError
    from helpers import edit_store

    store = tmp_path / "s"
    shutil.copytree(tiny_store, store)
    edit_store(store, lambda t: [t.put(fmt.sample_key(i), b"rot") for i in range(24)])
    with pytest.raises(TooManyCorruptSamplesError, match="in a row"):
        for _ in loader(store, on_error="skip", shuffle=False):
            pass


@dali
def test_script_without_main_guard_gets_the_fix_named(tiny_store, tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text("import sys\nfrom fastload.dali import DALILoader\n"
                      "for _ in DALILoader(sys.argv[1], 4, device='cpu', num_threads=1, size=32):\n    pass\n")
    proc = subprocess.run([sys.executable, str(script), str(tiny_store)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr and "WorkerStartError" in proc.stderr


_FORK_COLLECT = textwrap.dedent("""
    import gc, os, sys, time
    import fastload.load.dali  # noqa: F401  (registers the after-fork freeze)
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=1, num_threads=2, device_id=None)
    def pipe():
        return fn.random.uniform(range=[0, 1], shape=[1])

    gc.disable()
    p = pipe()
    p.build()
    p.run()
    cycle = [p]
    cycle.append(cycle)
    del p, cycle  # garbage, not yet collected, when the child is forked
    pid = os.fork()
    if pid == 0:
        gc.enable()
        gc.collect()  # what a DataLoader worker's collector does sooner or later
        os._exit(0)
    t0 = time.time()
    while time.time() - t0 < 30:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("finished", status)
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        print("hung")
""")


@pytest.mark.dali
def test_a_forked_child_never_destroys_a_pipeline_it_inherited():
    """Destroying a DALI pipeline in a forked child waits forever for the parent's threads."""
    out = subprocess.run([sys.executable, "-c", _FORK_COLLECT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["finished", "0"]


@dali
def test_time_to_first_batch_counts_from_iter(tiny_store):
    import time

    ld = loader(tiny_store)
    assert ld.time_to_first_batch is None
    it = iter(ld)  # the clock starts here, as fastload.DataLoader's does, not at the first next()
    time.sleep(0.3)
    next(it)
    assert 0.3 <= ld.time_to_first_batch < 60
    list(it)
    ld.close()
