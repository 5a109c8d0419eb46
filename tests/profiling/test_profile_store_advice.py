"""Issue 34: the profiler's store advice on a torchvision ImageFolder (the convert command for the user's folder,
the lines to change, a prediction from measured inputs), advice that holds on a loaded machine, and
``--verify-fix``'s one prediction and its "cannot tell" on a noisy machine.

The model is tested on constructed summaries; the end-to-end test runs a real ImageFolder of PNGs made in
tmp_path with a cheap step through the real CLI (its assertions are on the advice's shape, never on timings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fastload.profiling.compare import compare_rounds
from fastload.profiling._profile_report import format_summary
from fastload.profiling._gain import predict_step
from fastload.profiling._recommend import change_to_verify, recommend

REPO = Path(__file__).resolve().parents[2]
IMAGE_FOLDER = "torchvision.datasets.folder.ImageFolder"


def _summary(*, root: str | None = "/data/train", measured: dict | None = None, workers: int = 0,
             rq: float = 0.0, step_rq: float = 0.0, other_cpus: float | None = None) -> dict:
    """0 workers, 2 CPUs, a 100 ms step of which the loop waits 80 ms: 8 samples of 10 ms, decode 60% and
    transforms 30% of each (ToTensor/Normalize 10%), a single-threaded step. ``rq``: the samples also waited
    for a CPU that share of their time (their 10 ms of work took 10 / (1 - rq) ms: the step is that much longer)."""
    loading = 8 * 10.0 / (1 - rq) / 1e3
    wait = loading / (0.02 + loading)
    s = {"data_wait_fraction": wait, "gpu_idle_fraction": wait, "input_bound_idle_fraction": wait,
         "idle_source": "host-clock", "steps_per_s": 1 / (0.02 + loading), "images_per_step": 8,
         "step_cpu": {"cores": 1.0, "wanted_cores": 1.0, "runqueue_share": step_rq},
         "loader": {"num_workers": workers, "cpus_per_process": 2, "pinned": None, "created_at": None,
                    "worker_cpu_util_mean": 0.9 if workers else None, "dataset": IMAGE_FOLDER,
                    "image_folder": None if root is None else {
                        "root": root, "images": 700, "files": [], "repr": "TrainTransform(size=224, scale=(0.08, "
                        "1.0), ratio=(0.75, 1.3333333333333333), flip_p=0.5)", "mean": [0.5, 0.4, 0.3],
                        "std": [0.2, 0.25, 0.3], "preset": {"kind": "train", "size": 224}}},
         "samples": {"per_sample_ms": 10.0 / (1 - rq), "cpu_share": 1.0 - rq, "runqueue_share": rq,
                     "blocked_share": 0.0, "float_transform_share": 0.1,
                     "parts": {"read": 0.05, "decode": 0.6, "transform": 0.3, "other": 0.05}},
         "presets_measured": measured}
    if other_cpus is not None:
        s["machine_load"] = {"other_cpus": other_cpus, "own_cpus": 1.0, "cpus": 2, "wall_s": 10.0,
                             "load_average": 2.0 + other_cpus}
    return s


MEASURED = {"store_ms": 2.0, "files_ms": 3.0, "normalise_ms": 0.5, "files": 8}


def test_decode_and_transforms_dominating_an_image_folder_put_the_store_and_presets_first():
    s = _summary(measured=MEASURED)
    verdict, recs = recommend(s, plan_workers=2, has_gpu=False)
    top = recs[0]
    assert top["stage"] == "store" and "fastload convert /data/train /data/train.lmdb" in top["change"]
    code = top["code"].splitlines()
    assert code[0].startswith("fastload convert /data/train /data/train.lmdb")
    assert 'LMDBImageDataset("/data/train.lmdb", transform=train_transform(size=224' in top["code"]
    assert 'num_workers="auto", collate_fn=collate_uint8' in top["code"]
    # no CUDA in the training process: the CPU form, with the user's own mean/std
    assert 'DevicePrefetcher(loader, "cpu", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))' in code[-1]
    # the prediction from the measured inputs: 95% of each 10 ms sample becomes 2 ms of preset time, the 0.5 ms
    # per sample of normalising joins the step, with 2 workers ("auto")
    c = 0.1 * 0.2
    tb, moved = 8 * (10.0 * 0.05 + 2.0) / 1e3, 8 * 0.5 / 1e3
    t = predict_step(2, c=c + moved, tb=tb, tcpu=tb, cpus=2, step_cores=(c + moved) / (c + moved))
    assert top["expected_gain"] == pytest.approx(min(0.1 / t, 1 / 0.2))
    assert top["bound"] and "an upper bound: the store's own read is taken as free" in top["why"]
    # --verify-fix applies the presets to the files with the same workers, and says it cannot make the store
    assert top["apply"] == {"uint8_presets": True, "num_workers": 2}
    assert "cannot make the store" in top["verify_part"]
    pick = change_to_verify({**s, "recommendations": recs})
    assert pick["stage"] == "store"
    assert f"predicted {pick['verify_gain']['main process']:.2f}x" in top["why"]


def test_the_store_advice_on_cuda_has_both_forms_and_without_a_measurement_is_a_bound():
    s = _summary(measured=MEASURED)
    s["idle_source"] = "cuda"
    _, recs = recommend(s, plan_workers=2, has_gpu=True)
    code = recs[0]["code"]
    assert 'DevicePrefetcher(loader, "cuda", mean=' in code and 'DevicePrefetcher(loader, "cpu", ...)' in code
    # the transform has no preset (or no file could be read): the store is still named, its figure a bound
    s = _summary(measured=None)
    s["loader"]["image_folder"]["refused"] = "ColorJitter(...) in the dataset's transform"
    _, recs = recommend(s, plan_workers=2, has_gpu=False)
    store = next(r for r in recs if r["stage"] == "store")
    assert store["bound"] and "ColorJitter" in store["why"] and "apply" not in store
    # a fastload store already, or no folder seen: no store advice
    s = _summary(root=None, measured=MEASURED)
    assert not [r for r in recommend(s, plan_workers=2, has_gpu=False)[1] if r["stage"] == "store"]


def test_the_same_profile_under_other_processes_load_gets_the_same_advice():
    # the quiet run, and the same loop on a machine where other processes took 1.5 of the 2 CPUs: its samples
    # waited for a CPU 60% of their time and its step 80%. Without the measured foreign load that read as
    # "CPU-contended training: none on the loading side"; with it the advice is the quiet one, said plainly
    quiet = _summary(measured=None, root=None)
    loaded = _summary(measured=None, root=None, rq=0.6, step_rq=0.8, other_cpus=1.5)
    loaded["step_cpu"]["wanted_cores"] = 1.0
    q_verdict, q_recs = recommend(quiet, plan_workers=2, has_gpu=False)
    l_verdict, l_recs = recommend(loaded, plan_workers=2, has_gpu=False)
    assert q_recs[0]["change"] == l_recs[0]["change"] and q_recs[0]["stage"] == "workers"
    assert q_recs[0]["expected_gain"] == pytest.approx(l_recs[0]["expected_gain"])
    assert l_verdict.split(" ")[0] == q_verdict.split(":")[0]
    assert "other processes took 1.5 of the 2 CPUs" in l_verdict and "load average 3.5" in l_verdict
    assert "under this load the run read: CPU-contended training" in l_verdict
    # what the run read without the load measured (an older probe, the in-script profile()): contended
    del loaded["machine_load"]
    verdict, recs = recommend(loaded, plan_workers=2, has_gpu=False)
    assert verdict.startswith("CPU-contended") and recs[0]["stage"] is None


def test_verify_fix_checks_the_recommendations_own_figure():
    # CPU-contended: the recommendation promises no gain; verify-fix checks a worker count all the same, and
    # quotes that "no gain", not the model's figure the recommendation would not promise
    s = _summary(measured=None, root=None, rq=0.3, step_rq=0.5)
    _, recs = recommend(s, plan_workers=2, has_gpu=False)
    assert recs[0]["stage"] is None and recs[0]["expected_gain"] == 1.0
    model = next(p for p in s["predictions"] if p["apply"] == {"num_workers": 2})["expected_gain"]
    assert model > 1.0
    pick = change_to_verify({**s, "recommendations": recs})
    assert pick["apply"] == {"num_workers": 2} and pick["expected_gain"] == 1.0 and pick["advice"]


def _verify_summary(rounds: list[tuple[float, float]], predicted: float) -> dict:
    judged = compare_rounds([({"images_per_s": a}, {"images_per_s": b}) for a, b in rounds], predicted)
    return {"steps": 30, "warmup": 5, "images_per_s": rounds[0][0], "world_size": 1, "idle_source": "host-clock",
            "percentiles_ms": {"step": {"p50": 10.0}, "data_wait": {"p50": 5.0}}, "data_wait_fraction": 0.5,
            "gpu_idle_fraction": 0.5, "input_bound_idle_fraction": 0.5, "step_cpu": None,
            "loader": {"key": "DataLoader@t.py:1", "num_workers": 0, "pin_memory": False, "batch_bytes": 1000,
                       "worker_cpu_util": [], "shm": None}, "images_per_step": 8, "samples": None,
            "verdict": "input-bound: x", "recommendations": [],
            "verify_fix": {"change": 'num_workers="auto" (-> 2)', "why": "the top recommendation",
                           "applied": {"num_workers": 2}, "predicted": predicted, "profile": "v/profile.json",
                           "measured": judged["ratio"], "too_noisy": judged["too_noisy"],
                           "outside_noise": judged["outside_noise"], "noise": judged["noise"],
                           "round_ratios": judged["round_ratios"],
                           "images_per_s": [[a for a, _ in rounds], [b for _, b in rounds]]}}


def test_rounds_that_disagree_say_cannot_tell_instead_of_a_measurement():
    # the run: 3.55x then 0.75x, "measured 1.63x ... within the noise"
    text = format_summary(_verify_summary([(100.0, 355.0), (400.0, 300.0)], 1.72))
    line = next(x for x in text.splitlines() if x.startswith("verify-fix:"))
    assert "cannot tell: the machine is too noisy" in line and "measured 1.63x" not in line
    # rounds that straddle both 1.0 and the prediction cannot tell them apart either
    assert compare_rounds([({"images_per_s": 100.0}, {"images_per_s": 95.0}),
                           ({"images_per_s": 100.0}, {"images_per_s": 125.0})], 1.1)["too_noisy"]
    # rounds that agree are a measurement
    text = format_summary(_verify_summary([(100.0, 150.0), (102.0, 155.0)], 1.5))
    line = next(x for x in text.splitlines() if x.startswith("verify-fix:"))
    assert "measured 1.51x" in line and "cannot tell" not in line


# -- end to end: a torchvision ImageFolder script with a cheap step, under the real CLI -------------------------

SCRIPT = '''
import sys
import torch
from torchvision import datasets, transforms as T

torch.set_num_threads(1)
ds = datasets.ImageFolder(sys.argv[1], transform=T.Compose([T.RandomResizedCrop(32), T.ToTensor(),
                                                            T.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))]))
loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=0)
for epoch in range(1000):
    for images, labels in loader:
        images.sum()
'''


def make_pngs(root: Path, n: int = 12) -> Path:
    """``n`` smooth 240x320 RGB PNGs in 3 class folders."""
    from PIL import Image

    y, x = np.mgrid[0:240, 0:320].astype(np.float32)
    for i in range(n):
        img = np.stack([127 + 100 * np.sin(x / 320 * (i + 2)), 127 + 100 * np.cos(y / 240 * 3),
                        127 + 60 * np.sin((x + y) / 560 * 5)], axis=2).astype(np.uint8)
        folder = root / f"class{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i}.png")
    return root


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("FASTLOAD_PROFILE_OUT", None)
    return subprocess.run([sys.executable, "-m", "fastload.cli", "profile", "--steps", "25", "--warmup", "3",
                           "--out", str(tmp_path / "out"), *args, "--", sys.executable, str(script),
                           str(make_pngs(tmp_path / "pngs"))], env=env, capture_output=True, text=True, timeout=300)


def test_an_image_folder_script_is_told_to_convert_its_folder(tmp_path):
    proc = run_cli(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "out" / "profile.json").read_text())
    folder = str(tmp_path / "pngs")
    assert s["loader"]["image_folder"]["root"] == folder and len(s["loader"]["image_folder"]["files"]) == 8
    assert s["loader"]["image_folder"]["repr"].startswith("TrainTransform(size=32")
    m = s["presets_measured"]
    assert m["files"] == 8 and m["store_ms"] > 0 and m["files_ms"] > 0 and m["normalise_ms"] > 0
    assert s["machine_load"]["cpus"] >= 1 and s["machine_load"]["other_cpus"] >= 0
    store = next(r for r in s["recommendations"] if r["stage"] == "store")
    assert f"fastload convert {folder} {folder}.lmdb" in store["code"].splitlines()[0]
    assert 'DevicePrefetcher(loader, "cpu", mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))' in store["code"]
    assert f"fastload convert {folder} {folder}.lmdb" in proc.stdout


@pytest.mark.slow
def test_verify_fix_of_the_store_advice_quotes_its_one_prediction(tmp_path):
    # the top recommendation: the store (its presets applied to the files), or on a loaded machine the workers
    proc = run_cli(tmp_path, "--verify-fix")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "out" / "profile.json").read_text())
    v = s["verify_fix"]
    assert v["applied"], v
    line = next(x for x in proc.stdout.splitlines() if x.startswith("verify-fix:"))
    quoted = f"predicted {v['predicted']:.2f}x"
    assert quoted in line
    rec_lines = proc.stdout.split("recommendations:")[1].split("verify-fix:")[0]
    assert quoted in rec_lines  # the recommendation's line says the same figure


def test_a_profile_run_names_num_workers_auto_given_to_torchs_dataloader(tmp_path):
    script = tmp_path / "auto.py"
    script.write_text("import torch\nloader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, "
                      "num_workers='auto')\nfor x in loader:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("FASTLOAD_PROFILE_OUT", None)
    proc = subprocess.run([sys.executable, "-m", "fastload.cli", "profile", "--out", str(tmp_path / "out"), "--",
                           sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    error = proc.stderr[proc.stderr.index("error:"):]
    assert "num_workers=\"auto\" is fastload's" in error and "from fastload import DataLoader" in error
    assert "fastload.watch" not in error  # not the custom-loader hint
