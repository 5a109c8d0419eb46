"""The profiler on loaders a framework builds and iterates for the user (Lightning), and on fastload's own
dataset under both loader backends: the loader is named by the user's ``DataLoader(...)`` line (not the
framework's), and an ``LMDBImageDataset`` sample's time is split into store read, decode and transform.

In-process (``fastload.profile()``) with Lightning's own helpers, so each test runs in a second or two;
``tests/examples/test_frameworks.py`` runs ``fastload profile`` on the whole ``Trainer.fit`` example.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import fastload
from fastload import DataLoader, LMDBImageDataset, collate_uint8, train_transform
from fastload.image.fast import decode_rgb_fast
from fastload.marks import marked, timed
from fastload.profiling._snippet import loader_snippet
from helpers import RenderFails


def _line_of(fn, text: str) -> int:
    """The line number in this file of the first line of ``fn``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def make_loader(store):  # the user's own train_dataloader()
    return DataLoader(LMDBImageDataset(store, transform=train_transform(16)), batch_size=4, num_workers=0,
                      collate_fn=collate_uint8)


def test_a_loader_made_inside_lightnings_wrapper_is_named_by_the_users_line(tiny_store, tmp_path):
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _replace_dunder_methods

    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        # what Trainer.fit does around train_dataloader(): every DataLoader subclass's __init__ wrapped by Lightning
        with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"):
            loader = make_loader(tiny_store)
        for _ in loader:
            pass
    s = p.summary()
    line = _line_of(make_loader, "return DataLoader(")
    assert s["loader"]["created_at"] == f"{__file__}:{line}"
    key = s["loader"]["key"]
    assert key.startswith("DataLoader@") and key.endswith(f"test_profile_frameworks.py:{line}")
    this_test = test_a_loader_made_inside_lightnings_wrapper_is_named_by_the_users_line
    assert s["loader"]["iterated_at"].endswith(f":{_line_of(this_test, 'for _ in loader')}")
    snippet = loader_snippet(s["loader"]["created_at"], {"num_workers": 2})
    assert snippet.splitlines()[0] == f"# test_profile_frameworks.py:{line}" and "num_workers=2" in snippet


def test_a_loader_lightning_rebuilds_keeps_the_users_line(tiny_store, tmp_path):
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import _replace_dunder_methods, _update_dataloader

    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        with _replace_dunder_methods(torch.utils.data.DataLoader, "dataset"):
            loader = make_loader(tiny_store)
        # what Lightning does to add a DistributedSampler: a new loader from the saved constructor arguments
        sampler = torch.utils.data.DistributedSampler(loader.dataset, num_replicas=2, rank=0, shuffle=False)
        rebuilt = _update_dataloader(loader, sampler)
        assert rebuilt is not loader
        for _ in rebuilt:
            pass
    assert p.summary()["loader"]["created_at"] == f"{__file__}:{_line_of(make_loader, 'return DataLoader(')}"


def test_two_loaders_made_on_one_line_get_two_keys(tmp_path):
    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.tensor([float(i)])

    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        a, b = (torch.utils.data.DataLoader(Squares(), batch_size=2) for _ in range(2))
        for _ in a:
            pass
        for _ in b:
            pass
    s = p.summary()
    keys = [s["loader"]["key"], *(o["key"] for o in s["other_loaders"])]
    assert len(keys) == 2 and len(set(keys)) == 2
    assert all(k.startswith(s["loader"]["key"].split(" ")[0]) for k in keys)  # both name the one line


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_lmdb_dataset_samples_are_split_into_read_decode_transform(tiny_store, tmp_path, backend):
    ds = LMDBImageDataset(tiny_store, transform=train_transform(16))
    loader = DataLoader(ds, batch_size=4, num_workers=2, backend=backend, collate_fn=collate_uint8)
    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        for _ in range(2):
            for _ in loader:
                pass
    s = p.summary()
    assert s["steps"] == 2 * 6 - 1  # the thread pipeline's loader is measured too
    samples = s["samples"]
    assert samples["n"] > 0
    parts = samples["parts"]
    assert parts["read"] > 0 and parts["decode"] > 0 and parts["transform"] > 0
    assert parts["decode"] + parts["transform"] > 0.5 and parts["other"] < 0.5, parts
    assert set(samples["transforms"]) == {"TrainTransform"}
    assert "store" not in " ".join(r["change"] for r in s["recommendations"])  # it reads from a store already


def test_a_planned_sample_redone_by_getitem_is_counted_once(tiny_store, tmp_path):
    ds = LMDBImageDataset(tiny_store, transform=RenderFails(16))
    loader = DataLoader(ds, batch_size=8, num_workers=2, backend="threads", collate_fn=collate_uint8)
    with fastload.profile(out=tmp_path / "p", warmup=0) as p:
        for _ in loader:
            pass
    samples = p.summary()["samples"]
    assert RenderFails.calls > 0
    assert 0 < samples["n"] <= len(ds), samples["n"]  # 24 samples loaded: a failed render is not one more


class Gray:
    """A new preset, as a contributor would add one: it marks its own work, and the profiler has no list to extend."""

    size = 16

    @timed("transform", own=True, per_class=True)
    def from_bytes(self, data: bytes, generator=None) -> torch.Tensor:
        arr = torch.from_numpy(decode_rgb_fast(data)).permute(2, 0, 1)  # a marked decoder: decode time
        small = torch.nn.functional.interpolate(arr[None].float(), size=(16, 16), mode="bilinear")[0]
        return small.mean(0, keepdim=True).expand(3, -1, -1).round().to(torch.uint8)

    def __call__(self, img) -> torch.Tensor:
        return self.from_bytes(img)


@pytest.mark.parametrize("backend", ["processes", "threads"])
def test_a_new_preset_that_marks_itself_is_in_the_split_with_no_profiler_change(tiny_store, tmp_path, backend):
    ds = LMDBImageDataset(tiny_store, transform=Gray())
    loader = DataLoader(ds, batch_size=4, num_workers=2, backend=backend, collate_fn=collate_uint8)
    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        for _ in loader:
            pass
    samples = p.summary()["samples"]
    assert samples["n"] > 0 and set(samples["transforms"]) == {"Gray"}
    assert samples["parts"]["read"] > 0 and samples["parts"]["decode"] > 0 and samples["parts"]["transform"] > 0


def test_fastloads_own_timed_work_is_marked_where_it_is_written():
    """What the profile splits (store read, decode, preset) is marked in its own room."""
    import fastload.store.remote_store  # noqa: F401  (marks are registered as modules are imported)

    names = {m.qualname: m.part for m in marked()}
    assert names["fastload.store.reader.StoreReader.get"] == "read"
    assert names["fastload.store.remote_store.RemoteStoreReader.get"] == "read"
    assert names["fastload.image.fast.decode_pil"] == names["fastload.image.fast.decode_rgb_fast"] == "decode"
    assert names["fastload.load.transforms.TrainTransform.from_bytes"] == "transform"
    assert names["fastload.load.transforms.EvalTransform.__call__"] == "transform"
    with pytest.raises(ValueError, match="part must be one of"):
        timed("download")


SPIN_SCRIPT = '''
import os, time
import lightning as L
import torch
from torch import nn

STEP_MS, SAMPLE_MS = float(os.environ["STEP_MS"]), float(os.environ["SAMPLE_MS"])


def spin(ms):  # CPU time, in this thread: neither I/O nor sleep
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


class Burn(torch.utils.data.Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        spin(SAMPLE_MS)
        return torch.zeros(4), i % 2


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def training_step(self, batch, i):
        spin(STEP_MS)
        x, y = batch
        return nn.functional.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Burn(), batch_size=4, num_workers=0)


torch.set_num_threads(1)
L.Trainer(max_steps=400, logger=False, enable_progress_bar=False, enable_model_summary=False,
          enable_checkpointing=False, accelerator="cpu", devices=1).fit(Model())
'''


@pytest.mark.slow
def test_trainer_fit_step_cpu_is_seen_and_the_worker_gain_is_bounded_by_the_cpus(tmp_path):
    """Under Lightning the probe takes the step's CPU time inside ``Trainer.fit``'s loop, and on all-CPU work
    (a 10 ms CPU step, 4 x 5 ms CPU samples, 0 workers) no worker count is promised more than the CPUs allow."""
    pytest.importorskip("lightning")
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "fit.py"
    script.write_text(SPIN_SCRIPT)
    out = tmp_path / "p"
    repo = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, STEP_MS="10", SAMPLE_MS="5", PYTHONPATH=repo)
    proc = subprocess.run([sys.executable, "-m", "fastload.cli", "profile", "--seconds", "3", "--warmup", "3",
                           "--out", str(out), "--", sys.executable, str(script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads((out / "profile.json").read_text())
    line = next(i for i, t in enumerate(SPIN_SCRIPT.splitlines(), 1) if "return torch.utils.data.DataLoader(" in t)
    assert s["loader"]["key"] == f"DataLoader@fit.py:{line}"
    assert s["step_cpu"]["main_thread_cpu_s"] >= 0.010 * 0.95  # the spin in training_step, inside Lightning's loop
    cpus = s["loader"]["cpus_per_process"]
    # the loop's whole work is CPU: more workers cannot beat the step itself, nor all the work over all the CPUs
    bound = min(1 / (1 - s["data_wait_fraction"]), float(cpus))
    gains = [p["expected_gain"] for p in s["predictions"]]
    assert gains and all(g <= bound * 1.05 for g in gains), (bound, s["predictions"])
