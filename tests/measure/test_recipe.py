"""Recipes: validation before anything runs, the runner end to end, outputs, compare, torchrun."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.errors import RecipeError
from fastload.measure.recipe import load_recipe, run_recipe, validate

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY_RUN = ["--steps", "3", "--warmup", "1", "--batch-size", "4", "--image-size", "32", "--quiet"]


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "r.toml"
    p.write_text(textwrap.dedent(text))
    return p


def test_shipped_recipes_parse():
    for name in ("quickstart", "resnet50-imagenet", "workers-sweep", "cold-storage"):
        r = load_recipe(RECIPES / f"{name}.toml")
        assert r.name == name and r.stages
    q = load_recipe(RECIPES / "quickstart.toml")
    assert [s.type for s in q.stages] == ["baseline", "workers", "lmdb", "fast", "threads", "dali-cpu", "dali-gpu"]
    # interleaved rounds within the step budget of the former single pass (5 + 30 steps per stage)
    assert q.run.rounds == 3 and q.run.rounds * (q.run.warmup + q.run.steps) <= 5 + 30 + 2
    cold = load_recipe(RECIPES / "cold-storage.toml")
    assert cold.dataset.cache == "cold" and cold.dataset.read_delay_ms > 0
    assert {s.type for s in cold.stages} >= {"workers", "lmdb"}
    sweep = load_recipe(RECIPES / "workers-sweep.toml")
    assert [s.workers for s in sweep.stages] == [0, 1, 2, 4, "auto"]


@pytest.mark.parametrize("body, message", [
    ("[run]\nmodle = 'resnet50'\n[[stage]]\ntype='fast'", "Unknown field run.'modle'. Valid fields are: amp, "),
    ("[run]\nstep_ms=1\n[[stage]]\ntype='turbo'", "Unknown value 'turbo' for field stage.type. Valid values are "
                                                  "'baseline', 'workers', 'lmdb', 'fast', 'threads', "
                                                  "'threads-autotune', 'dali-cpu', 'dali-gpu'"),
    ("[run]\nstep_ms=1\n[[stage]]\ntype='fast'\nworkers=-1", "workers must be an integer >= 0"),
    ("[run]\nstep_ms=1\ndevice='tpu'\n[[stage]]\ntype='fast'", "Valid values are 'auto', 'cpu', 'cuda'"),
    ("[run]\nmodel='simulated'\n[[stage]]\ntype='fast'", "run.step_ms"),
    ("[run]\nstep_ms=1", "needs at least one [[stage]]"),
    ("[run]\nstep_ms=1\n[[stage]]\ntype='fast'\n[[stage]]\ntype='fast'", "'fast' is used twice"),
    ("[run\n", "not valid TOML"),
    ("[dataset]\ncache='lukewarm'\n[run]\nstep_ms=1\n[[stage]]\ntype='fast'",
     "Unknown value 'lukewarm' for field dataset.cache. Valid values are 'warm', 'cold'"),
    ("[dataset]\nread_delay_ms=-1\n[run]\nstep_ms=1\n[[stage]]\ntype='fast'", "read_delay_ms must be a number >= 0"),
    ("[run]\nstep_ms=1\nrounds=0\n[[stage]]\ntype='fast'", "run.rounds must be an integer >= 1"),
    ("[run]\nstep_ms=1\n[[stage]]\ntype='fast'\nprefetch_ahead='no'", "stage 'fast' prefetch_ahead must be true or false"),
])
def test_structural_errors_name_the_field(tmp_path, body, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, body))
    assert message in str(info.value)


def test_missing_dataset_and_unknown_model_fail_before_any_stage(tmp_path, monkeypatch):
    import fastload.measure.recipe as rec

    monkeypatch.setattr(rec, "prepare_data", lambda *a, **k: pytest.fail("a stage started"))
    r = load_recipe(write(tmp_path, "[dataset]\nfolder='/nope/imagenet'\n[run]\nstep_ms=1\n[[stage]]\ntype='fast'"))
    with pytest.raises(RecipeError, match="Field dataset.folder: /nope/imagenet is not a folder"):
        run_recipe(r)
    r = load_recipe(write(tmp_path, "[run]\nmodel='resnet5000'\n[[stage]]\ntype='fast'"))
    with pytest.raises(RecipeError, match="Unknown value 'resnet5000' for field model. Valid values are"):
        validate(r)
    r = load_recipe(RECIPES / "resnet50-imagenet.toml")
    with pytest.raises(RecipeError, match="dataset.folder"):
        validate(r)


def test_quickstart_runs_every_stage_in_rounds_and_writes_outputs(tiny_tree, tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["recipe", "run", str(RECIPES / "quickstart.toml"), "--folder", str(tiny_tree),
                                  "--store", str(tmp_path / "tiny.lmdb"), "--step-ms", "5", "--out", str(out),
                                  "--rounds", "2", *TINY_RUN])
    assert r.exit_code == 0, r.output
    assert "verdict:" in r.output and "vs baseline" in r.output and "95% interval" in r.output
    assert "median of 2 interleaved rounds" in r.output and "hierarchical bootstrap" in r.output
    results = json.loads((out / "results.json").read_text())
    stages = {s["name"]: s for s in results["stages"]}
    assert list(stages) == ["baseline", "workers", "lmdb", "fast", "threads", "dali-cpu", "dali-gpu"]
    ran = [n for n, s in stages.items() if s["status"] == "ran"]
    assert ran[:4] == ["baseline", "workers", "lmdb", "fast"]
    for name in ran:
        s = stages[name]
        assert s["images_per_s"] > 0 and 0 <= s["data_wait_fraction"] <= 1
        assert s["steps"] == 2 * 3 and "p99" in s["percentiles_ms"]["data_wait"]  # both rounds pooled
        assert [x["round"] for x in s["rounds"]] == [0, 1] and all(x["steps"] == 3 for x in s["rounds"])
        assert s["images_per_s"] == pytest.approx(statistics.median(x["images_per_s"] for x in s["rounds"]))
        low, high = s["images_per_s_ci95"]
        assert low <= s["images_per_s"] <= high
        assert s["normalises"]
    # round 1 runs the stages rotated by one: the first stage of round 0 runs last in round 1
    assert stages[ran[0]]["rounds"][0]["position"] == 0 and stages[ran[0]]["rounds"][1]["position"] == len(ran) - 1
    assert stages["workers"]["rounds"][1]["position"] == 0
    assert stages["baseline"]["speedup_vs_baseline"] == 1.0
    assert [x["ratio_vs_baseline"] for x in stages["baseline"]["rounds"]] == [1.0, 1.0]
    assert stages["dali-gpu"]["status"] == "skipped" and "CUDA" in stages["dali-gpu"]["reason"]
    assert results["recipe"]["run"]["steps"] == 3 and results["recipe"]["dataset"]["folder"] == str(tiny_tree)
    assert results["environment"]["cpus"]["usable"] >= 1 and results["environment"]["torch"]
    assert "float32 NCHW" in results["contract"] and "same output:" in r.output
    assert (out / "results.csv").read_text().startswith("name,type,status,workers,images_per_s,ci95_low,ci95_high")
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((out / "traces" / "fast.json").read_text())
    kinds = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert kinds == {"data wait", "copy", "compute"}
    assert len([e for e in trace["traceEvents"] if e["name"] == "compute"]) == 3  # one round's timeline

    r2 = CliRunner().invoke(main, ["recipe", "compare", str(out / "results.json"), str(out / "results.json")])
    assert r2.exit_code == 0 and "~1.00x" in r2.output and "fast" in r2.output and "within noise" in r2.output


def test_compare_marks_only_overlapping_intervals(tmp_path):
    from fastload.measure.report import compare_results

    env = {"gpu": None, "cpus": {"usable": 2}}

    def run(rate, ci):
        return {"recipe": {"name": "x"}, "environment": env,
                "stages": [{"name": "fast", "status": "ran", "images_per_s": rate, "images_per_s_ci95": ci,
                            "data_wait_fraction": 0.1, "gpu_idle_fraction": 0.1}]}

    apart = compare_results(run(100, [95, 105]), run(150, [140, 160]))
    assert " 1.50x" in apart and "~" not in apart
    close = compare_results(run(100, [90, 110]), run(105, [100, 112]))
    assert "~1.05x" in close and "within noise" in close


def test_cold_cache_evicts_before_every_stage_and_says_so(tiny_tree, tmp_path):
    from fastload.measure.cache import resident_bytes

    recipe = write(tmp_path, f"""
        [dataset]
        folder = "{tiny_tree}"
        store = "{tmp_path / 'cold.lmdb'}"
        cache = "cold"
        [run]
        step_ms = 1
        batch_size = 4
        image_size = 32
        steps = 2
        warmup = 1
        rounds = 2
        [[stage]]
        type = "workers"
        workers = 1
        [[stage]]
        type = "lmdb"
        workers = 1
    """)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["recipe", "run", str(recipe), "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    results = json.loads((out / "results.json").read_text())
    stages = results["stages"]
    assert results["reference_stage"] == "workers" and "vs workers" in r.output  # no baseline stage
    assert stages[0]["speedup_vs_baseline"] == 1.0
    files = sum(1 for p in tiny_tree.rglob("*") if p.is_file()) + sum(1 for p in (tmp_path / "cold.lmdb").iterdir())
    probe = next(tiny_tree.rglob("*.jpg"))
    probe.read_bytes()
    measurable = resident_bytes(probe) is not None
    for s in stages:
        ev = s["cache_evictions"]
        assert [e["round"] for e in ev] == [0, 1] and all(e["files"] == files for e in ev)
        if measurable:
            assert all(e["resident_after"] is not None for e in ev)
            assert s["eviction_confirmed"] == all(e["resident_after"] <= 0.02 * e["bytes"] for e in ev)
        state = "confirmed (mincore)" if s["eviction_confirmed"] else "NOT confirmed"
        assert f"cold cache, {s['name']}: {files} files evicted before each of 2 rounds, {state}" in r.output


def test_unconfirmed_eviction_is_reported(tmp_path, monkeypatch):
    import fastload.measure.cache as cache

    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 10000)
    monkeypatch.setattr(cache, "resident_bytes", lambda p: p.stat().st_size)  # nothing leaves the cache
    ev = cache.evict([f])
    assert not ev.confirmed and "100% of the files stayed in the page cache" in ev.note
    monkeypatch.setattr(cache, "resident_bytes", lambda p: None)
    ev = cache.evict([f])
    assert not ev.confirmed and "eviction not confirmed" in ev.note


def test_only_selected_stages_and_unknown_stage(tiny_tree, tmp_path):
    args = ["recipe", "run", str(RECIPES / "workers-sweep.toml"), "--folder", str(tiny_tree), "--store",
            str(tmp_path / "s.lmdb"), "--out", str(tmp_path / "o"), *TINY_RUN]
    r = CliRunner().invoke(main, [*args, "--stage", "fast-0", "--stage", "fast-1"])
    assert r.exit_code == 0, r.output
    names = [s["name"] for s in json.loads((tmp_path / "o" / "results.json").read_text())["stages"]]
    assert names == ["fast-0", "fast-1"]
    r = CliRunner().invoke(main, [*args, "--stage", "fast-9"])
    assert r.exit_code == 1 and "Unknown stage 'fast-9'" in r.output


@pytest.mark.slow
def test_two_ranks_report_each_rank_and_the_slowest(tiny_tree, tmp_path):
    recipe = write(tmp_path, f"""
        name = "ddp"
        [dataset]
        folder = "{tiny_tree}"
        store = "{tmp_path / 'ddp.lmdb'}"
        [run]
        step_ms = 2
        batch_size = 2
        image_size = 32
        steps = 3
        warmup = 1
        [[stage]]
        type = "baseline"
        [[stage]]
        type = "fast"
        workers = 1
    """)
    # pack first, so the two ranks do not both convert
    assert CliRunner().invoke(main, ["convert", str(tiny_tree), str(tmp_path / "ddp.lmdb"), "-q"]).exit_code == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastload.cli",
           "recipe", "run", str(recipe), "--out", str(tmp_path / "out"), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 ranks" in proc.stdout and "slowest rank" in proc.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for stage in results["stages"]:
        assert [r["rank"] for r in stage["ranks"]] == [0, 1]
        assert stage["slowest_rank"] in (0, 1)
        assert stage["images_per_s_total"] == pytest.approx(sum(r["images_per_s"] for r in stage["ranks"]))


def test_simulated_step_host_ms_default_override_and_validation(tmp_path):
    from fastload.measure.train import DEFAULT_HOST_MS

    r = load_recipe(write(tmp_path, "[run]\nstep_ms=5\n[[stage]]\ntype='fast'"))
    assert r.run.host_ms == DEFAULT_HOST_MS  # the measured launch cost, written into the resolved recipe
    assert r.with_overrides(**{"run.host_ms": 0.0}).run.host_ms == 0.0
    assert load_recipe(RECIPES / "quickstart.toml").run.host_ms == 8.0
    with pytest.raises(RecipeError, match="run.host_ms must be a number >= 0"):
        load_recipe(write(tmp_path, "[run]\nstep_ms=5\nhost_ms=-1\n[[stage]]\ntype='fast'"))


def test_recipe_run_names_the_data_and_never_overwrites_a_run(tiny_tree, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = write(tmp_path, f"""
        name = "named"
        [dataset]
        folder = "{tiny_tree}"
        store = "{tmp_path / 'n.lmdb'}"
        [run]
        step_ms = 2
        host_ms = 1
        [[stage]]
        type = "lmdb"
    """)
    args = ["recipe", "run", str(recipe), *TINY_RUN]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert f"data: {tiny_tree.name}: 24 images, 3 classes ({tiny_tree}" in first.output
    assert "1 ms of it host CPU holding the GIL" in first.output
    out1 = tmp_path / "runs" / f"named-{tiny_tree.name}"
    results = json.loads((out1 / "results.json").read_text())
    assert results["data"]["name"] == tiny_tree.name and results["data"]["images"] == 24
    assert results["stages"][0]["extra"]["host_ms"] == 1 and results["recipe"]["run"]["host_ms"] == 1
    before = (out1 / "results.json").read_bytes()
    second = CliRunner().invoke(main, args)  # default folder taken: a new one, the first run kept
    assert second.exit_code == 0, second.output
    assert f"runs/named-{tiny_tree.name}-2/results.json" in second.output
    assert (out1 / "results.json").read_bytes() == before
    # an explicit --out holding results is refused unless --force
    refused = CliRunner().invoke(main, [*args, "--out", str(out1)])
    assert refused.exit_code == 1 and "already holds the results" in refused.output and "HINT: pass --force" in \
        refused.output
    assert (out1 / "results.json").read_bytes() == before
    forced = CliRunner().invoke(main, [*args, "--out", str(out1), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (out1 / "results.json").read_bytes() != before


def test_recipe_run_writes_per_step_tensorboard_scalars(tiny_tree, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = write(tmp_path, f"""
        [dataset]
        folder = "{tiny_tree}"
        store = "{tmp_path / 'tb.lmdb'}"
        [run]
        step_ms = 2
        host_ms = 0
        rounds = 2
        [[stage]]
        type = "lmdb"
        [[stage]]
        type = "threads"
    """)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["recipe", "run", str(recipe), "--out", str(out), *TINY_RUN])
    assert r.exit_code == 0, r.output
    for stage in ("lmdb", "threads"):
        acc = EventAccumulator(str(out / "tensorboard" / stage))
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert {"step/data_wait_ms", "step/idle_ms", "step/images_per_s"} <= set(tags)
        rate = acc.Scalars("step/images_per_s")
        assert [e.step for e in rate] == list(range(2 * 3))  # 2 rounds x 3 measured steps
        assert all(e.value > 0 for e in rate)
        assert all(e.value >= 0 for e in acc.Scalars("step/data_wait_ms"))


def test_a_self_sizing_stage_reports_where_its_tuner_ended_each_round(tiny_tree, tmp_path):
    recipe = write(tmp_path, f"""
        [dataset]
        folder = "{tiny_tree}"
        store = "{tmp_path / 'at.lmdb'}"
        [run]
        step_ms = 2
        host_ms = 0
        rounds = 2
        [[stage]]
        type = "threads"
        [[stage]]
        type = "threads-autotune"
        workers = 1
    """)
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["recipe", "run", str(recipe), "--out", str(out), *TINY_RUN])
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads((out / "results.json").read_text())["stages"]}
    assert "autotune" not in rows["threads"]
    tuned = rows["threads-autotune"]["autotune"]
    assert [a["round"] for a in tuned] == [0, 1]
    for a in tuned:  # 3 steps: fewer than its first 16-batch window, so it is where it started
        assert (a["threads"], a["decisions"], a["changes"]) == (1, 0, 0) and a["depth"] >= 2
    assert "threads-autotune: started at 1 thread(s); ended each round at threads/prefetch depth 1/" in r.output
