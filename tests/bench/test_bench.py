"""Benchmarks and doctor end to end on tiny data: the structure and discipline of each
result is asserted (which paths ran, in which order, against which ceiling), never a timing."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import statistics

import pytest
import torch
from click.testing import CliRunner

from fastload.cli import main
from fastload.pack.convert import validator_options
from helpers import photo

TINY = ["--workers", "1", "--batch-size", "4", "--image-size", "32", "--batches", "2", "--floor-seconds", "0.1"]


def test_doctor_prints_the_worker_plan_and_the_one_environment_record():
    from fastload.load.workers import worker_plan
    from fastload.measure.env import environment

    r = CliRunner().invoke(main, ["doctor"])
    assert r.exit_code == 0, r.output
    assert "DataLoader workers per process" in r.output and "Pinned-memory budget" in r.output
    data = json.loads(CliRunner().invoke(main, ["doctor", "--json", "--batch-size", "8"]).output)
    assert data["pinned_memory"]["batch_bytes"] == 8 * 3 * 224 * 224
    assert data["workers"]["recommended"] == worker_plan().workers
    assert data["environment"] == environment()  # the record results.json carries, not a second one
    if importlib.util.find_spec("nvidia.dali") is not None:
        assert data["environment"]["dali"].startswith("nvidia-dali")
        assert data["environment"]["dali"] in r.output


def test_bench_loader_paths_ceilings_and_per_round_ratios(tiny_tree, tmp_path):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), *TINY, "--rounds", "2", "--max-side", "64",
                                  "--path", "torchvision", "--path", "fastload", "--path", "fastload-reduced",
                                  "--path", "ffcv", "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    paths = {p["name"]: p for p in result["paths"]}
    assert list(paths) == ["torchvision", "fastload", "fastload (threads, max-side 64)", "ffcv"]
    for name in ("torchvision", "fastload", "fastload (threads, max-side 64)"):
        p = paths[name]
        assert len(p["rounds"]) == 2 and p["images_per_s"] > 0 and p["round_order"] == [0, 1]
        assert len(p["round_ratios"]) == 2
    assert paths["torchvision"]["round_ratios"] == [1.0, 1.0] and paths["torchvision"]["ratio"] == 1.0
    # the ceiling is measured per store: the reduced store has its own
    full, reduced = paths["fastload"], paths["fastload (threads, max-side 64)"]
    assert full["ceiling_per_core"] == result["ceiling_per_core"]
    assert reduced["ceiling_per_core"] != full["ceiling_per_core"]
    # the floors are measured in every round beside the paths: each round's images/s against its own round's
    # ceiling, the median of those reported
    for p in (full, reduced):
        assert len(p["round_fractions_of_ceiling"]) == 2 and all(f > 0 for f in p["round_fractions_of_ceiling"])
        assert p["fraction_of_ceiling"] == pytest.approx(statistics.median(p["round_fractions_of_ceiling"]))
    assert "of ceiling" in r.output and "(per round)" in r.output
    # two floors per core and normalisation per batch; every path against both floors
    floors = result["floors"]
    assert floors["normalise_ms"] > 0 and floors["batch_size"] == 4 and floors["decode_per_core"] > 0
    # float batches: every path must also normalise, so the ceiling per core is the preset's work plus that
    per_image_us = 1e6 / floors["preset_per_core"] + 1e3 * floors["normalise_ms"] / floors["batch_size"]
    assert result["ceiling_per_core"] == pytest.approx(1e6 / per_image_us)
    lo, mid, hi = floors["preset_over_decode"]
    assert 0 < lo <= mid <= hi
    assert full["decode_floor_per_core"] == floors["decode_per_core"]
    assert reduced["decode_floor_per_core"] != full["decode_floor_per_core"]
    assert full["fraction_of_decode_floor"] == pytest.approx(full["images_per_s"] / floors["decode_per_core"])
    assert "decode alone" in r.output and "the preset's whole work" in r.output and "normalise a batch of 4" in r.output
    assert "different data: the max-side 64 store" in r.output
    ffcv = paths["ffcv"]
    if importlib.util.find_spec("ffcv") is None:
        assert ffcv["images_per_s"] is None and "ffcv is not importable" in ffcv["skipped"]
    else:
        assert ffcv["skipped"] is None and ffcv["images_per_s"] > 0


def test_bench_loader_rotates_order_and_times_each_path_alone(tiny_tree, monkeypatch):
    import fastload.bench.loader as bl

    seen = []
    real = bl._time

    def spy(loader, warmup, batches, *rest):
        # the previous path's worker processes are gone before this one is timed
        seen.append((type(getattr(loader, "loader", loader)).__module__, len(multiprocessing.active_children())))
        return real(loader, warmup, batches, *rest)

    monkeypatch.setattr(bl, "_time", spy)
    paths = ("torchvision", "fastload", "webdataset") if importlib.util.find_spec("webdataset") else \
        ("torchvision", "fastload")
    opts = bl.LoaderBenchOptions(workers=1, batch_size=4, image_size=32, batches=2, warmup=1, rounds=2, paths=paths,
                                 floor_seconds=0.1)
    bench = bl.bench_loader(tiny_tree, options=opts, progress=False)
    assert [r.name for r in bench.results] == list(paths)
    modules = [m for m, _ in seen]
    n = len(paths)
    assert len(set(modules[:n])) == n and modules[n:] == modules[1:n] + modules[:1]  # round 1: rotated by one
    assert [alive for _, alive in seen] == [0] * (2 * n)


def test_bench_loader_webp_folder_and_a_failing_path_is_skipped(tmp_path, monkeypatch):
    import fastload.bench.loader as bl

    tree = tmp_path / "tree"
    for c in ("a", "b"):
        (tree / c).mkdir(parents=True)
        for k in range(4):
            photo(64 + 8 * k, 48, seed=k).save(tree / c / f"{k}.webp" if k % 2 else tree / c / f"{k}.jpg")
    opts = bl.LoaderBenchOptions(workers=1, batch_size=4, image_size=32, batches=2, warmup=1, floor_seconds=0.1,
                                 rounds=1, paths=("torchvision", "fastload", "webdataset"))
    if importlib.util.find_spec("webdataset") is not None:
        bench = bl.bench_loader(tree, options=opts, progress=False)
        wds = next(r for r in bench.results if r.name == "webdataset")
        assert wds.skipped is None and wds.images_per_s > 0  # .webp samples are read, not refused

    def broken(*a, **k):
        raise RuntimeError("decoder exploded")

    monkeypatch.setattr(bl, "_make_webdataset", broken)
    monkeypatch.setattr(bl.importlib.util, "find_spec", lambda name: object())
    bench = bl.bench_loader(tree, options=opts, progress=False)
    by = {r.name: r for r in bench.results}
    assert "RuntimeError: decoder exploded" in by["webdataset"].skipped and by["webdataset"].images_per_s is None
    assert by["torchvision"].images_per_s > 0 and by["fastload"].images_per_s > 0
    assert "skipped" in bench.table()


def test_bench_convert_divides_by_the_validator_conversion_runs(tiny_tree, tmp_path):
    import fastload.bench.convert as bc
    import fastload.pack.convert as conv

    assert bc.VALIDATE_HANDLER == conv._HANDLER  # the same worker function, called by name
    from fastload.pack.sources import open_source

    captured = []
    real = conv.imap_isolated

    def spy(handler, init, payloads, workers, **kw):
        captured.append((handler, init))
        return real(handler, init, payloads, workers, **kw)

    opts = conv.ConvertOptions(workers=1, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conv, "imap_isolated", spy)
        conv.convert(tiny_tree, tmp_path / "spy.lmdb", opts)
    assert captured == [(bc.VALIDATE_HANDLER, validator_options(opts, open_source(tiny_tree)))]  # with the same options
    out = tmp_path / "c.json"
    r = CliRunner().invoke(main, ["bench", "convert", str(tiny_tree), "--workers", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    paths = json.loads(out.read_text())["paths"]
    assert [p["name"] for p in paths] == ["read (cat)", "read+validate", "convert"]
    assert paths[1]["ratio"] == 1.0 and "vs read+validate" in r.output


def test_bench_decode_times_every_method_or_says_why_not(tiny_tree, tmp_path):
    from fastload.image.fast import jpeg_backend, region_backends

    out = tmp_path / "d.json"
    r = CliRunner().invoke(main, ["bench", "decode", str(tiny_tree), "--images", "6", "--rounds", "2",
                                  "--size", "32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    methods = json.loads(out.read_text())["methods"]
    for name in ("full+crop", "simplejpeg", "pillow", "resize torch", "resize pillow", "preset", "torchvision"):
        assert methods[name]["ms_per_image"] > 0 and len(methods[name]["rounds"]) == 2, name
    if jpeg_backend() != "simplejpeg":
        assert methods["region"]["ms_per_image"] > 0
    else:
        assert "nvImageCodec" in methods["region"]["skipped"]
    if region_backends() == ["libjpeg-turbo", "nvimgcodec-cpu"]:
        assert methods["region nvimgcodec"]["ms_per_image"] > 0
    else:
        assert "compiled region decoder" in methods["region nvimgcodec"]["skipped"]
    if importlib.util.find_spec("cv2") is None:
        assert "OpenCV is not installed" in methods["resize opencv"]["skipped"]
    assert "region" in r.output and "simplejpeg" in r.output


def test_bench_loader_uint8_times_every_path_to_uint8_batches(tiny_tree, tmp_path, monkeypatch):
    import fastload.bench.loader as bl

    seen = {}
    real_time = bl._time

    def spy(loader, warmup, batches, *rest):  # what each path hands out, then the real timing
        images, labels = next(iter(loader))[:2]
        seen[type(loader).__name__ + str(len(seen))] = (images.dtype, tuple(images.shape), labels.dtype)
        return real_time(loader, warmup, batches, *rest)

    monkeypatch.setattr(bl, "_time", spy)
    out = tmp_path / "bench.json"
    paths = ["torchvision", "fastload", "fastload-threads", "ffcv"] + \
        (["dali-cpu"] if importlib.util.find_spec("nvidia.dali") else [])
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), *TINY, "--rounds", "1", "--uint8",
                                  *[a for p in paths for a in ("--path", p)], "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["options"]["uint8"] is True and "uint8 batches (not normalised)" in r.output
    assert result["ceiling_per_core"] == result["floors"]["preset_per_core"]  # nothing to normalise
    by = {p["name"]: p for p in result["paths"]}
    assert by["ffcv"]["images_per_s"] is None and "uint8" in by["ffcv"]["skipped"]
    ran = [p for p in result["paths"] if p["name"] != "ffcv"]
    assert all(p["images_per_s"] > 0 for p in ran) and len(seen) == len(ran)
    assert set(seen.values()) == {(torch.uint8, (4, 3, 32, 32), torch.int64)}


def test_bench_loader_channels_last_ends_every_path_channels_last(tiny_tree, tmp_path, monkeypatch):
    import fastload.bench.loader as bl

    handed, inner, timed = {}, {}, {}
    real_time, real_floors = bl._time, bl.store_floors

    def spy(loader, warmup, batches, step=None, channels_last=False):
        name = type(getattr(loader, "loader", loader)).__name__ + str(len(handed))
        handed[name] = next(iter(loader))[0]  # as the path hands it out
        inner[name] = next(iter(getattr(loader, "loader", loader)))[0]  # as its loader makes it, before the hand-off
        timed[name] = channels_last
        return real_time(loader, warmup, batches, step, channels_last)

    floors_asked = []

    def floors_spy(*args, **kw):
        floors_asked.append(kw.get("channels_last"))
        return real_floors(*args, **kw)

    monkeypatch.setattr(bl, "_time", spy)
    monkeypatch.setattr(bl, "store_floors", floors_spy)
    out = tmp_path / "bench.json"
    paths = ["torchvision", "fastload", "fastload-threads"] + \
        (["dali-cpu"] if importlib.util.find_spec("nvidia.dali") else [])
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), *TINY, "--rounds", "1", "--uint8", "--channels-last",
                                  *[a for p in paths for a in ("--path", p)], "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["options"]["channels_last"] is True and "uint8 batches (not normalised), channels-last" in r.output
    assert all(p["images_per_s"] > 0 for p in result["paths"]) and len(handed) == len(paths)
    assert all(timed.values()) and floors_asked and all(floors_asked)  # the timed loop converts what is not yet
    for images in handed.values():  # fastload's presets, DALI's HWC output and the stages' wrappers: already so
        assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)
        assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    # written channels-last where they are made, not transposed after: fastload's presets and DALI
    native = {name: images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
              for name, images in inner.items()}
    assert sum(native.values()) == len(paths) - 1, native  # all but torchvision's workers
    r = CliRunner().invoke(main, ["bench", "loader", "--store", str(tiny_tree), "--remote", "s3://b/s", "--channels-last"])
    assert r.exit_code == 2 and "--channels-last is for the local paths" in r.output


def test_bench_loader_times_the_thread_pipeline_beside_the_process_workers(tiny_tree):
    import fastload.bench.loader as bl

    opts = bl.LoaderBenchOptions(workers=2, batch_size=4, image_size=32, batches=2, warmup=1, floor_seconds=0.1,
                                 rounds=1, paths=("fastload", "fastload-threads"))
    by = {r.name: r for r in bl.bench_loader(tiny_tree, options=opts, progress=False).results}
    assert by["fastload (threads)"].skipped is None and by["fastload (threads)"].images_per_s > 0
    assert by["fastload"].images_per_s > 0


def test_bench_loader_runs_a_simulated_training_step_after_every_batch(tiny_tree, tmp_path):
    # batch 4, a 50 ms step (20 ms of it holding the GIL) after each batch: at most 4 / 0.05 = 80 images/s
    r = CliRunner().invoke(main, ["bench", "loader", str(tiny_tree), *TINY, "--rounds", "1", "--path", "fastload",
                                  "--path", "fastload-threads", "--step-ms", "50", "--host-ms", "20",
                                  "--json", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    assert "a simulated step of 50 ms after each batch, 20 ms of it host CPU holding the GIL" in r.output
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["options"]["step_ms"] == 50 and data["options"]["host_ms"] == 20
    for p in data["paths"]:
        assert 0 < p["images_per_s"] <= 80 * 1.02, p


def _coded_tree(root):
    """3 classes x 5 images of mixed sizes and formats, each pixel telling what it is: red is the
    class (40 + 80 * label), green a left-to-right ramp 0..255 (so a flip and a crop show), blue 128."""
    import numpy as np
    from PIL import Image

    for label, cls in enumerate(("a", "b", "c")):
        (root / cls).mkdir(parents=True)
        for k in range(5):
            w, h = 90 + 37 * k, 70 + 23 * ((k + label) % 3)
            arr = np.empty((h, w, 3), np.uint8)
            arr[..., 0] = 40 + 80 * label
            arr[..., 1] = np.linspace(0, 255, w).round().astype(np.uint8)[None, :]
            arr[..., 2] = 128
            img = Image.fromarray(arr, "RGB")
            if k == 4:
                img.convert("RGBA").save(root / cls / f"{k}.png")  # alpha: converted to rgb24 by the filter
            elif k == 3:
                img.save(root / cls / f"{k}.png")
            else:
                img.save(root / cls / f"{k}.jpg", quality=95, subsampling=0)
    return root


def test_spdl_path_hands_out_the_batch_contract_with_the_files_labels(tmp_path):
    if importlib.util.find_spec("spdl") is None:
        pytest.skip("spdl is not installed (pip install 'fastload[spdl]')")
    import torch

    from fastload.load.transforms import IMAGENET_MEAN, IMAGENET_STD
    from fastload.bench import _spdl_path

    assert _spdl_path.unavailable() is None  # installed but FFmpeg missing is a failure here, not a skip
    samples = _spdl_path.folder_samples(_coded_tree(tmp_path / "tree"))
    assert len(samples) == 15
    built = _spdl_path.spdl_stage(samples, batch_size=4, image_size=24, workers=2)
    assert len(built.loader) == 3 and built.workers == 2
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    flips, spans = set(), set()
    try:
        for _epoch in range(2):
            seen = 0
            for images, labels in built.loader:
                assert images.dtype == torch.float32 and images.shape == (4, 3, 24, 24)
                assert labels.dtype == torch.int64 and labels.shape == (4,)
                pixels = (images * std + mean) * 255  # undo the ImageNet normalisation
                red = pixels[:, 0].mean(dim=(1, 2))
                assert torch.equal(((red - 40) / 80).round().long(), labels), (red, labels)  # the file's class
                assert (pixels[:, 0] - (40 + 80 * labels).view(-1, 1, 1)).abs().max() < 8
                assert (pixels[:, 2] - 128).abs().max() < 8
                ramp = pixels[:, 1].mean(dim=1)  # per column
                for row in ramp:
                    flips.add(bool(row[-1] < row[0]))
                    spans.add(int((row[-1] - row[0]).abs() // 16))
                seen += len(labels)
            assert seen == 12  # 15 files, batches of 4, the last partial batch dropped
    finally:
        built.loader.loader.close()
    assert flips == {True, False}  # random horizontal flips, both ways
    assert len(spans) > 2  # random-resized crops cover different widths of the ramp


def test_spdl_path_runs_in_bench_loader_or_is_skipped_with_the_install_hint(tiny_tree, tmp_path, monkeypatch):
    import fastload.bench._spdl_path as sp
    import fastload.bench.loader as bl

    opts = bl.LoaderBenchOptions(workers=2, batch_size=4, image_size=32, batches=2, warmup=1, floor_seconds=0.1,
                                 rounds=2, paths=("torchvision", "spdl"))
    if importlib.util.find_spec("spdl") is not None:
        by = {r.name: r for r in bl.bench_loader(tiny_tree, options=opts, progress=False).results}
        assert by["spdl"].skipped is None and len(by["spdl"].rounds) == 2 and by["spdl"].images_per_s > 0
        assert len(by["spdl"].round_ratios) == 2
    monkeypatch.setattr(sp.importlib.util, "find_spec", lambda name: None)
    assert "pip install 'fastload[spdl]'" in sp.unavailable()
    bench = bl.bench_loader(tiny_tree, options=opts, progress=False)
    spdl = next(r for r in bench.results if r.name == "spdl")
    assert spdl.images_per_s is None and spdl.rounds == [] and spdl.skipped.startswith("spdl is not installed")
    assert "apt-get install ffmpeg" in bench.table()


def test_spdl_path_names_the_file_it_cannot_decode(tmp_path):
    if importlib.util.find_spec("spdl") is None:
        pytest.skip("spdl is not installed (pip install 'fastload[spdl]')")
    from fastload.bench import _spdl_path

    tree = _coded_tree(tmp_path / "tree")
    (tree / "b" / "1.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    # batches of 5 of 15 files: none dropped, so the bad one is decoded in the first epoch
    built = _spdl_path.spdl_stage(_spdl_path.folder_samples(tree), batch_size=5, image_size=24, workers=2)
    try:
        with pytest.raises(RuntimeError, match=r"SPDL could not decode .*b/1\.jpg"):
            for _ in built.loader:
                pass
    finally:
        built.loader.loader.close()


def test_bench_convert_engines_reports_each_engine(tiny_tree, tmp_path):
    out = tmp_path / "engines.json"
    r = CliRunner().invoke(main, ["bench", "convert", str(tiny_tree), "--engine", "local", "--num-shards", "2",
                                  "--workers", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["files"] == 24 and result["shards"] == 2 and result["images_per_s"]["local"] > 0
    assert result["ray_startup_s"] is None and result["upload_mb_per_s"] is None
    r = CliRunner().invoke(main, ["bench", "convert", str(tiny_tree), "--engine", "spark"])
    assert r.exit_code == 2 and "unknown engine 'spark'" in r.output


def test_bench_loader_refuses_uint8_with_remote(tiny_store):
    r = CliRunner().invoke(main, ["bench", "loader", "--store", str(tiny_store), "--remote", "s3://b/s", "--uint8"])
    assert r.exit_code == 2 and "--uint8 is for the local paths" in r.output


def test_the_floors_time_as_many_crops_as_a_round_of_a_path_over_the_stores_first_records(tiny_store, monkeypatch):
    """A floor measured on a few crops is set by their luck (on 800 real photos the first 256 records took 707 us
    per image with one seed's crops and 729-750 with others'): the floors cycle the store's first records to
    FLOOR_CROPS crops, each drawn afresh, and stop taking records at FLOOR_RECORDS or FLOOR_BYTES."""
    import fastload.bench.loader as bl
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.transforms import TrainTransform

    ds = LMDBImageDataset(tiny_store)
    n = len(ds)
    assert bl.floor_records(ds) == [ds.get_bytes(i) for i in range(n)]  # 24 records, under both caps
    monkeypatch.setattr(bl, "FLOOR_RECORDS", 5)
    assert bl.floor_records(ds) == [ds.get_bytes(i) for i in range(5)]
    sizes = [len(ds.get_bytes(i)) for i in range(n)]
    monkeypatch.setattr(bl, "FLOOR_RECORDS", n)
    monkeypatch.setattr(bl, "FLOOR_BYTES", sizes[0] + sizes[1] + 1)  # the third record passes it
    assert bl.floor_records(ds) == [ds.get_bytes(i) for i in range(3)]
    monkeypatch.setattr(bl, "FLOOR_BYTES", 1)
    assert bl.floor_records(ds) == [ds.get_bytes(0)]  # never none
    empty = type("Empty", (), {"__len__": lambda self: 0, "root": "/data/empty.lmdb"})()
    with pytest.raises(ValueError, match="empty.lmdb: the store holds no records"):
        bl.floor_records(empty)

    monkeypatch.setattr(bl, "FLOOR_RECORDS", 4)
    monkeypatch.setattr(bl, "FLOOR_BYTES", 1 << 30)
    monkeypatch.setattr(bl, "FLOOR_CROPS", 10)
    decoded: list[tuple[bytes, tuple]] = []
    real = TrainTransform.decode_crop

    def spy(self, data, drawn):
        decoded.append((data, drawn))
        return real(self, data, drawn)

    monkeypatch.setattr(TrainTransform, "decode_crop", spy)
    bl.store_floors(tiny_store, 32, 4, seconds=0.0, rounds=1)
    first = [ds.get_bytes(i) for i in range(4)]
    # one round runs the decode floor's pass over the 10 crops, then the preset floor's (whose from_bytes decodes
    # the same crops), then the normalisation
    decode_pass, preset_pass = decoded[-20:-10], decoded[-10:]
    assert [d for d, _ in decode_pass] == [first[k % 4] for k in range(10)]
    assert preset_pass == decode_pass  # the two floors time the same records with the same crops
    boxes = [drawn for _, drawn in decode_pass]
    assert boxes[0] != boxes[4] or boxes[1] != boxes[5]  # a record's second crop is drawn afresh


def test_the_ceiling_of_n_workers_is_the_preset_in_n_processes_at_once_when_measured():
    """Cores busy together slow each other down (two processes at once made 94-103% of twice one alone on the
    2-core Xeons): with the preset's loop measured in as many processes at once as there are workers, the ceiling
    is their rate, each process's share plus the normalisation of its image for float batches; without it (one
    worker, or another count), one core alone times the workers, as before."""
    from fastload.bench.loader import Floors

    alone = Floors(decode_per_core=2000.0, preset_per_core=1000.0, normalise_ms=6.4, batch_size=64,
                   preset_over_decode=(2.0, 2.0, 2.0))
    assert alone.ceiling(True, 2) == 2000.0 and alone.together_share is None
    assert alone.ceiling(False, 2) == pytest.approx(2 * 1e6 / (1000 + 100))
    assert alone.ceiling(True, 0) == 1000.0  # loading in the main process: one core
    at_once = Floors(decode_per_core=2000.0, preset_per_core=1000.0, normalise_ms=6.4, batch_size=64,
                     preset_over_decode=(2.0, 2.0, 2.0), preset_together=1900.0, together=2)
    assert at_once.together_share == pytest.approx(0.95)
    assert at_once.ceiling(True, 2) == pytest.approx(1900.0)
    assert at_once.ceiling(False, 2) == pytest.approx(2 * 1e6 / (1e6 / 950 + 100))
    assert at_once.ceiling(True, 3) == 3000.0  # measured for 2: not used for 3
    assert at_once.ceiling_per_core(True) == 1000.0  # one core alone is still reported
    rounds = [at_once, Floors(decode_per_core=2000.0, preset_per_core=1000.0, normalise_ms=6.4, batch_size=64,
                              preset_over_decode=(2.0, 2.0, 2.0), preset_together=1700.0, together=2),
              Floors(decode_per_core=2000.0, preset_per_core=1000.0, normalise_ms=6.4, batch_size=64,
                     preset_over_decode=(2.0, 2.0, 2.0), preset_together=1800.0, together=2)]
    both = Floors.combine(rounds)
    assert both.preset_together == 1800.0 and both.together == 2


def test_preset_processes_run_the_preset_floor_at_once_and_name_a_store_they_cannot_read(tiny_store, tmp_path,
                                                                                          monkeypatch):
    import fastload.bench.loader as bl

    with bl.PresetProcesses(tiny_store, 32, 2) as group:
        ours = {p.pid for p in group._procs}
        assert len(ours) == 2 and ours <= {p.pid for p in multiprocessing.active_children()}
        assert group.rate(0.05) > 0 and group.rate(0.05) > 0  # asked again: the same processes, still waiting
        f = bl.store_floors(tiny_store, 32, 4, seconds=0.05, rounds=2, together=group)
    assert f.together == 2 and f.preset_together > 0 and f.together_share > 0
    assert not ours & {p.pid for p in multiprocessing.active_children()}  # closed: gone
    with pytest.raises(RuntimeError, match="missing.lmdb: the preset floor's process failed"):
        bl.PresetProcesses(tmp_path / "missing.lmdb", 32, 1)
    assert not multiprocessing.active_children()
    monkeypatch.setattr(bl.PresetProcesses, "TIMEOUT", 0.001)  # no process opens a store and warms up in 1 ms
    with pytest.raises(RuntimeError, match="tiny.lmdb: the preset floor's process did not start in 0.001 s"):
        bl.PresetProcesses(tiny_store, 32, 2)
    assert not multiprocessing.active_children()  # stopped, not left running


def test_processes_at_once_are_held_to_one_window_not_the_sum_of_their_rates():
    """Two processes of 100 images each, one from 0 to 1 s and one from 0 to 2 s: 200 images in 2 s is 100 images/s.
    The sum of their rates (100 + 50 = 150) would count the second one's lone second as if both still ran."""
    from fastload.bench.loader import together_rate

    assert together_rate([(100, 10.0, 11.0), (100, 10.0, 12.0)]) == pytest.approx(100.0)
    assert together_rate([(100, 10.0, 11.0), (100, 10.5, 11.5)]) == pytest.approx(200 / 1.5)  # a late start too
    assert together_rate([(300, 5.0, 8.0)]) == pytest.approx(100.0)


def test_bench_loader_holds_two_workers_to_the_preset_in_two_processes_at_once(tiny_tree, monkeypatch):
    import fastload.bench.loader as bl

    rates = iter([1000.0, 1500.0])  # round 0, round 1: the two processes together
    monkeypatch.setattr(bl.PresetProcesses, "rate", lambda self, seconds: next(rates))
    sizes, real_crops = [], bl.floor_crops
    measured, real_floors = [], bl.store_floors  # each round's floors (one store: one call per round)
    monkeypatch.setattr(bl, "store_floors", lambda *a, **k: measured.append(real_floors(*a, **k)) or measured[-1])
    monkeypatch.setattr(bl, "floor_crops",
                        lambda records, crops=None: sizes.append(crops) or real_crops(records, crops))
    opts = bl.LoaderBenchOptions(workers=2, batch_size=4, image_size=32, batches=2, warmup=1, floor_seconds=0.05,
                                 rounds=2, paths=("fastload-threads",), uint8=True)
    bench = bl.bench_loader(tiny_tree, options=opts, progress=False)
    r = bench.results[0]
    assert not multiprocessing.active_children()  # the floor's processes are closed with the bench
    by_round = dict(zip(r.order, r.rounds))
    assert r.ceiling_fractions == pytest.approx([by_round[0] / 1000.0, by_round[1] / 1500.0])
    assert r.one_core_fractions == pytest.approx([by_round[k] / (2 * measured[k].preset_per_core) for k in (0, 1)])
    assert bench.floors.preset_together == 1250.0 and bench.ceiling == 1250.0
    share = 1250.0 / (2 * bench.floors.preset_per_core)
    assert r.together_share == pytest.approx(share)  # the decode floor of 2 cores at once is scaled as the preset's
    assert bench._of_decode(r) == pytest.approx(r.images_per_s / (2 * r.decode_floor_per_core * share))
    table = bench.table()
    assert "of n x 1 core" in table and "in 2 processes at once: 1250 images/s" in table
    assert bench.to_json()["paths"][0]["round_fractions_of_one_core_ceiling"] == r.one_core_fractions
    assert sizes == [2 * 4, 2 * 4]  # each round's floors time as many crops as a path's round: 2 batches of 4


def test_the_floors_take_as_many_crops_as_asked_from_the_first_records():
    """A store of 12 MP photos costs 38 ms per image in the preset: floors of 2,048 crops for a round of 64 images
    (--batches 4 --batch-size 16) spent minutes per round; bench loader now asks for a round's worth."""
    import fastload.bench.loader as bl

    records = [b"r0", b"r1", b"r2"]
    assert bl.floor_crops(records, 7) == [b"r0", b"r1", b"r2", b"r0", b"r1", b"r2", b"r0"]
    assert bl.floor_crops(records, 2) == [b"r0", b"r1"]
    assert len(bl.floor_crops(records)) == bl.FLOOR_CROPS
    with pytest.raises(ValueError, match="at least one crop"):
        bl.floor_crops(records, 0)
