"""stages.py: every stage hands the step the same batch, and leaves the process as it found it."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD
from fastload.measure import stages as st
from fastload.measure.stages import StageData, StageOptions, build_stage, running, skip_reason


@pytest.mark.parametrize("stage_type", [t for t in st.STAGE_TYPES if t != "dali-gpu"])
def test_every_stage_hands_out_normalised_float32_nchw(stage_type, tiny_tree, tiny_store):
    opts = StageOptions(batch_size=4, image_size=32, workers=1, device="cpu")
    data = StageData(tiny_tree, tiny_store)
    reason = skip_reason(stage_type, data, opts)
    if reason:
        pytest.skip(reason)
    with running(build_stage(stage_type, data, opts)) as loader:
        images, labels = next(iter(loader))[:2]
    assert images.dtype == torch.float32 and tuple(images.shape) == (4, 3, 32, 32)
    assert images.device.type == "cpu" and labels.dtype == torch.int64 and labels.shape == (4,)
    lo = [(0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    hi = [(1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    for c in range(3):  # normalised with the ImageNet mean/std: every value inside that channel's range
        assert images[:, c].min() >= lo[c] - 1e-3 and images[:, c].max() <= hi[c] + 1e-3
    assert images.min() < 0  # not 0..1 (ToTensor without Normalize) and not 0..255


def test_running_shuts_workers_down_and_restores_torch_threads(tiny_store, tiny_tree):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        built = build_stage("fast", StageData(tiny_tree, tiny_store), StageOptions(batch_size=4, image_size=32,
                                                                                   workers=2))
        with running(built) as loader:
            next(iter(loader))
            assert len(multiprocessing.active_children()) == 2
            torch.set_num_threads(1)  # as fastload.DataLoader may do while it iterates
        assert torch.get_num_threads() == 2
        assert multiprocessing.active_children() == []
    finally:
        torch.set_num_threads(before)


def test_read_delay_is_charged_per_file_opened(tiny_tree, tiny_store, monkeypatch):
    sleeps = []
    monkeypatch.setattr(st.time, "sleep", lambda s: sleeps.append(s))
    opts = StageOptions(batch_size=4, image_size=32, workers=0, read_delay_ms=7)
    data = StageData(tiny_tree, tiny_store)
    folder = build_stage("baseline", data, opts).loader.loader.dataset
    for i in range(5):
        folder[i]
    assert sleeps == [0.007] * 5  # a folder opens one file per sample
    sleeps.clear()
    store = build_stage("lmdb", data, opts).loader.loader.dataset
    for i in range(5):
        store[i]
    assert sleeps == [0.007]  # a store is one file, opened once per process
    assert "read_delay_ms" in skip_reason("dali-cpu", data, opts) or "DALI is not installed" in skip_reason(
        "dali-cpu", data, opts)


def test_skip_reasons_and_unknown_type(tiny_store):
    cpu = StageOptions(batch_size=2, device="cpu")
    assert "needs a CUDA GPU" in skip_reason("dali-gpu", None, cpu) or "DALI is not installed" in skip_reason(
        "dali-gpu", None, cpu)
    assert "only a store" in skip_reason("baseline", StageData(None, tiny_store), cpu)
    assert skip_reason("fast", StageData(None, tiny_store), cpu) is None
    with pytest.raises(ValueError, match="Valid values are baseline, workers, lmdb, fast, threads, threads-autotune, dali-cpu, dali-gpu"):
        build_stage("turbo", StageData(None, tiny_store), cpu)
    with pytest.raises(ValueError, match="read_delay_ms must be >= 0"):
        StageOptions(batch_size=2, read_delay_ms=-1)


@pytest.mark.parametrize("stage_type", [t for t in st.STAGE_TYPES if t != "dali-gpu"])
def test_every_stage_hands_out_uint8_nchw_not_normalised_when_asked(stage_type, tiny_tree, tiny_store):
    opts = StageOptions(batch_size=4, image_size=32, workers=1, device="cpu", uint8=True)
    data = StageData(tiny_tree, tiny_store)
    reason = skip_reason(stage_type, data, opts)
    if reason:
        pytest.skip(reason)
    built = build_stage(stage_type, data, opts)
    with running(built) as loader:
        images, labels = next(iter(loader))[:2]
    assert images.dtype == torch.uint8 and tuple(images.shape) == (4, 3, 32, 32) and images.is_contiguous()
    assert images.device.type == "cpu" and labels.dtype == torch.int64 and labels.shape == (4,)
    assert images.max() > 1  # pixels 0..255, not a 0..1 image cast to uint8
    assert "uint8" in built.normalises


@pytest.mark.parametrize("ahead", [True, False])
def test_a_stage_converts_ahead_on_a_helper_thread_unless_the_recipe_says_not(tiny_tree, tiny_store, tmp_path, ahead):
    from fastload.measure.recipe import _stage_options, load_recipe

    recipe = tmp_path / "r.toml"
    recipe.write_text(f"[run]\nstep_ms=1\n[[stage]]\ntype='fast'\nprefetch_ahead={str(ahead).lower()}\n")
    r = load_recipe(recipe)
    opts = _stage_options(r.run, r.dataset, r.stages[0], "cpu")
    assert opts.prefetch_ahead is ahead
    opts = StageOptions(batch_size=4, image_size=32, workers=1, device="cpu", prefetch_ahead=ahead)
    built = build_stage("fast", StageData(tiny_tree, tiny_store), opts)
    assert built.loader.ahead is ahead
    assert ("helper thread" in built.normalises) is ahead and ("ahead=False" in built.normalises) is not ahead
    with running(built) as loader:
        images, labels = next(iter(loader))[:2]
    assert images.dtype == torch.float32 and labels.shape == (4,)
