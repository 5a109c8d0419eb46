"""Benchmarks and doctor end to end on tiny data: the structure and discipline of each
result is asserted (which paths ran, in which order, against which ceiling), never a timing."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.pack.convert import validator_options
from helpers import photo

TINY = ["--workers", "1", "--batch-size", "4", "--image-size", "32", "--batches", "2"]


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
    assert list(paths) == ["torchvision", "fastload", "fastload (max-side 64)", "ffcv"]
    for name in ("torchvision", "fastload", "fastload (max-side 64)"):
        p = paths[name]
        assert len(p["rounds"]) == 2 and p["images_per_s"] > 0 and p["round_order"] == [0, 1]
        assert len(p["round_ratios"]) == 2
    assert paths["torchvision"]["round_ratios"] == [1.0, 1.0] and paths["torchvision"]["ratio"] == 1.0
    # the ceiling is measured per store: the reduced store has its own
    full, reduced = paths["fastload"], paths["fastload (max-side 64)"]
    assert full["ceiling_per_core"] == result["ceiling_per_core"]
    assert reduced["ceiling_per_core"] != full["ceiling_per_core"]
    assert reduced["fraction_of_ceiling"] == pytest.approx(reduced["images_per_s"] / reduced["ceiling_per_core"])
    assert "different data: the max-side 64 store" in r.output
    ffcv = paths["ffcv"]
    if importlib.util.find_spec("ffcv") is None:
        assert ffcv["images_per_s"] is None and "ffcv is not importable" in ffcv["skipped"]
    else:
        assert ffcv["skipped"] is None and ffcv["images_per_s"] > 0


def test_bench_loader_rotates_order_and_times_each_path_alone(tiny_tree, monkeypatch):
    import fastload.measure.bench_loader as bl

    seen = []
    real = bl._time

    def spy(loader, warmup, batches):
        # the previous path's worker processes are gone before this one is timed
        seen.append((type(getattr(loader, "loader", loader)).__module__, len(multiprocessing.active_children())))
        return real(loader, warmup, batches)

    monkeypatch.setattr(bl, "_time", spy)
    paths = ("torchvision", "fastload", "webdataset") if importlib.util.find_spec("webdataset") else \
        ("torchvision", "fastload")
    opts = bl.LoaderBenchOptions(workers=1, batch_size=4, image_size=32, batches=2, warmup=1, rounds=2, paths=paths)
    bench = bl.bench_loader(tiny_tree, options=opts, progress=False)
    assert [r.name for r in bench.results] == list(paths)
    modules = [m for m, _ in seen]
    n = len(paths)
    assert len(set(modules[:n])) == n and modules[n:] == modules[1:n] + modules[:1]  # round 1: rotated by one
    assert [alive for _, alive in seen] == [0] * (2 * n)


def test_bench_loader_webp_folder_and_a_failing_path_is_skipped(tmp_path, monkeypatch):
    import fastload.measure.bench_loader as bl

    tree = tmp_path / "tree"
    for c in ("a", "b"):
        (tree / c).mkdir(parents=True)
        for k in range(4):
            photo(64 + 8 * k, 48, seed=k).save(tree / c / f"{k}.webp" if k % 2 else tree / c / f"{k}.jpg")
    opts = bl.LoaderBenchOptions(workers=1, batch_size=4, image_size=32, batches=2, warmup=1, rounds=1,
                                 paths=("torchvision", "fastload", "webdataset"))
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
    import fastload.measure.bench_convert as bc
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
    from fastload.image.fast import jpeg_backend

    out = tmp_path / "d.json"
    r = CliRunner().invoke(main, ["bench", "decode", str(tiny_tree), "--images", "6", "--rounds", "2",
                                  "--size", "32", "--json", str(out)])
    assert r.exit_code == 0, r.output
    methods = json.loads(out.read_text())["methods"]
    for name in ("full+crop", "simplejpeg", "pillow", "resize torch", "resize pillow", "preset", "torchvision"):
        assert methods[name]["ms_per_image"] > 0 and len(methods[name]["rounds"]) == 2, name
    if jpeg_backend().startswith("nvimgcodec"):
        assert methods["region"]["ms_per_image"] > 0
    else:
        assert "nvImageCodec" in methods["region"]["skipped"]
    if importlib.util.find_spec("cv2") is None:
        assert "OpenCV is not installed" in methods["resize opencv"]["skipped"]
    assert "region" in r.output and "simplejpeg" in r.output


def test_bench_loader_times_the_thread_pipeline_beside_the_process_workers(tiny_tree):
    import fastload.measure.bench_loader as bl

    opts = bl.LoaderBenchOptions(workers=2, batch_size=4, image_size=32, batches=2, warmup=1, rounds=1,
                                 paths=("fastload", "fastload-threads"))
    by = {r.name: r for r in bl.bench_loader(tiny_tree, options=opts, progress=False).results}
    assert by["fastload (threads)"].skipped is None and by["fastload (threads)"].images_per_s > 0
    assert by["fastload"].images_per_s > 0
