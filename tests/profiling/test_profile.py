"""`fastload profile -- COMMAND`, `fastload.watch()` and `fastload.profile()` on real training scripts.

Each test writes a plain torchvision-style training script into tmp_path (a small CNN, a dataset whose
``__getitem__`` PIL-decodes small JPEGs and then sleeps a known time, a step that sleeps a known time)
and runs it unmodified through the CLI in a subprocess, so the constructed truth of the data wait is
known: with N workers each delivering a batch in ``S`` seconds and a step of ``C`` seconds the loop
waits ``max(0, S / N - C)`` per step (``S`` per step with 0 workers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastload.cli import main
from fastload.profiling import _kineto
from fastload.profiling._recommend import recommend

REPO = Path(__file__).resolve().parents[2]
BATCH = 4

SCRIPT = '''
import os, signal, sys, time
import torch
from PIL import Image
from torch import nn
from torchvision import transforms

SAMPLE_SLEEP = float(os.environ["SAMPLE_SLEEP"])
STEP_SLEEP = float(os.environ["STEP_SLEEP"])
WORKERS = int(os.environ.get("WORKERS", "0"))
BATCHES = int(os.environ.get("BATCHES", "1000"))
SIGNAL_AT = int(os.environ.get("SIGNAL_AT", "-1"))
OWN_CLOCK = os.environ.get("OWN_CLOCK")  # a file: per step, the wait for its batch and the step's own time
BATCH = 4
DDP = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


class JpegDataset(torch.utils.data.Dataset):
    def __init__(self, folder, n):
        self.files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
        self.n = n
        self.tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.25] * 3)])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        img = Image.open(self.files[i % len(self.files)]).convert("RGB")
        time.sleep(SAMPLE_SLEEP)
        return self.tf(img), i % 3


def main():
    torch.set_num_threads(1)
    if DDP:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jpegs")
    dataset = JpegDataset(folder, BATCHES * BATCH * (2 if DDP else 1))
    sampler = torch.utils.data.DistributedSampler(dataset) if DDP else None
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=WORKERS, sampler=sampler,
                                         shuffle=sampler is None,
                                         multiprocessing_context=os.environ.get("MP_CONTEXT") if WORKERS else None)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    if DDP:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val = torch.utils.data.DataLoader(JpegDataset(folder, 2 * BATCH), batch_size=BATCH)
    own = open(OWN_CLOCK, "a", buffering=1) if OWN_CLOCK else None
    t_end = time.perf_counter()
    for step, (x, y) in enumerate(loader):
        t_got = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_SLEEP)
        if own is not None:
            own.write(f"{t_got - t_end} {time.perf_counter() - t_got}\\n")
        t_end = time.perf_counter()
        if step == SIGNAL_AT:
            os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
    for x, y in val:  # a second, shorter loader: not the training loader
        model(x)
    if DDP:  # a rank that exits with its gloo group alive can abort in teardown (pytorch#190489)
        dist.destroy_process_group()
    print("script finished", step + 1)


if __name__ == "__main__":
    main()
'''


def write_script(tmp_path: Path) -> Path:
    from PIL import Image

    folder = tmp_path / "jpegs"
    folder.mkdir()
    for k in range(8):
        Image.new("RGB", (32, 32), (30 * k, 100, 200 - 20 * k)).save(folder / f"{k}.jpg", quality=90)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    return script


def run_cli(args: list[str], env_extra: dict[str, str], timeout: float = 240,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env_extra.get("PYTHONPATH")) if p)
    env.pop("FASTLOAD_PROFILE_OUT", None)
    return subprocess.run([sys.executable, "-m", "fastload.cli", "profile", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def profile_script(tmp_path: Path, *, sample_sleep: float, step_sleep: float, workers: int, steps: int = 30,
                   warmup: int = 3, extra: list[str] = (), env: dict[str, str] | None = None,
                   launcher: list[str] | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    script = write_script(tmp_path)
    out = tmp_path / "out"
    cmd = (launcher or [sys.executable]) + [str(script)]
    proc = run_cli(["--steps", str(steps), "--warmup", str(warmup), "--out", str(out), *extra, "--", *cmd],
                   {"SAMPLE_SLEEP": str(sample_sleep), "STEP_SLEEP": str(step_sleep), "WORKERS": str(workers),
                    **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "profile.json").read_text()), proc


def check_files(out: Path) -> None:
    for name in ("profile.json", "trace.json"):
        json.loads((out / name).read_text())
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("name") == "data wait" for e in trace["traceEvents"])
    png = out / "profile.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_bound_in_the_main_process(tmp_path):
    # 4 samples x 10 ms loaded in the training process, then a 20 ms step: truth 40 / 60 = 0.67
    summary, proc = profile_script(tmp_path, sample_sleep=0.010, step_sleep=0.020, workers=0)
    truth = 4 * 0.010 / (4 * 0.010 + 0.020)
    assert abs(summary["data_wait_fraction"] - truth) < 0.07, summary["data_wait_fraction"]
    assert summary["steps"] == 30 and summary["warmup"] == 3
    assert summary["idle_source"] == "host-clock"
    assert summary["gpu_idle_fraction"] == summary["data_wait_fraction"]
    assert summary["verdict"].startswith("input-bound")
    top = summary["recommendations"][0]
    assert top["stage"] == "workers" and "num_workers" in top["change"]
    assert 1.5 < top["expected_gain"] <= 1 / (1 - summary["input_bound_idle_fraction"]) + 1e-9
    assert summary["loader"]["num_workers"] == 0 and "train.py:" in summary["loader"]["key"]
    assert summary["loader"]["batch_bytes"] == BATCH * 3 * 32 * 32 * 4 + BATCH * 8
    samples = summary["samples"]
    assert samples["n"] >= 30 * BATCH
    assert samples["parts"]["other"] > 0.6  # the sleep is the dataset's own code
    assert samples["parts"]["decode"] > 0 and samples["parts"]["read"] > 0
    assert set(samples["transforms"]) == {"ToTensor", "Normalize"}
    assert summary["ended"] == "steps"  # --steps ended the script
    assert "script finished" not in proc.stdout
    assert "input-bound" in proc.stdout and "host clocks" in proc.stdout
    assert summary["machine"]["cpus"]["available"] >= 1
    check_files(tmp_path / "out")


def own_wait_fraction(path: Path, warmup: int, steps: int) -> float:
    """The measured steps' data wait as a share of their time, on the training script's own clock."""
    rows = [tuple(map(float, line.split())) for line in path.read_text().splitlines()][warmup:warmup + steps]
    assert len(rows) == steps, rows
    return sum(w for w, _ in rows) / sum(w + c for w, c in rows)


def test_compute_bound_with_two_workers(tmp_path):
    # 2 workers x (4 samples x 2 ms) = a batch every 4 ms, a 300 ms step: truth 0 plus each batch's trip
    # through the worker queue (the tensors' file descriptors are fetched from the worker, whose GIL that
    # takes): ~2 ms on an idle 2-core machine, 5-25 ms beside two CPU burners (7-14% of a 100 ms step, which
    # made "compute-bound" untrue there). So the step is long enough to stay compute-bound under that load,
    # and the figure is held to the training script's own clock over the same steps, not to a fixed bound.
    own = tmp_path / "own-clock.txt"
    summary, proc = profile_script(tmp_path, sample_sleep=0.002, step_sleep=0.300, workers=2, steps=12,
                                   env={"OWN_CLOCK": str(own)})
    truth = own_wait_fraction(own, warmup=3, steps=12)
    assert abs(summary["data_wait_fraction"] - truth) < 0.02, (summary["data_wait_fraction"], truth)
    assert summary["verdict"].startswith("compute-bound")
    assert "faster loading will not help" in summary["verdict"]
    assert summary["recommendations"][0]["change"] == "none on the loading side"
    assert summary["loader"]["num_workers"] == 2
    assert len(summary["loader"]["worker_cpu_util"]) == 2
    assert all(0 <= u <= 1.2 for u in summary["loader"]["worker_cpu_util"])
    assert summary["samples"]["n"] > 0  # worker processes shipped their sample timings back
    assert "compute-bound" in proc.stdout


@pytest.mark.slow
def test_data_bound_with_two_workers(tmp_path):
    # 2 workers x (4 x 15 ms) = a batch every 30 ms; a 10 ms step: constructed truth 20 / 30 = 0.67. On a
    # loaded machine the sleeps overrun and the step's own work grows (CI once measured 0.59 here, 0.077
    # off), so the figure is held tightly to the script's own clock over the same steps, and loosely to the
    # constructed truth, which still tells input-bound from compute-bound.
    own = tmp_path / "own-clock.txt"
    summary, _ = profile_script(tmp_path, sample_sleep=0.015, step_sleep=0.010, workers=2,
                                env={"OWN_CLOCK": str(own)})
    truth = (4 * 0.015 / 2 - 0.010) / (4 * 0.015 / 2)
    measured = own_wait_fraction(own, warmup=3, steps=30)
    assert abs(summary["data_wait_fraction"] - measured) < 0.03, (summary["data_wait_fraction"], measured)
    assert abs(summary["data_wait_fraction"] - truth) < 0.15, summary["data_wait_fraction"]
    assert summary["verdict"].startswith("input-bound")
    assert "not CPU-bound" in summary["verdict"]
    top = summary["recommendations"][0]
    # the samples mostly sleep (blocked, not waiting for a CPU): more workers than CPUs overlap the waiting
    assert summary["samples"]["blocked_share"] > 0.5
    assert top["stage"] == "workers"
    assert int(top["change"].split("=")[1].split()[0].strip('"')) > 2
    check_files(tmp_path / "out")


@pytest.mark.slow
def test_headspace_replays_batches_from_memory(tmp_path):
    summary, proc = profile_script(tmp_path, sample_sleep=0.010, step_sleep=0.020, workers=0, steps=20,
                                   extra=["--headspace"])
    h = summary["headspace"]
    assert h["data_wait_fraction"] < 0.1
    # a perfect loader: 20 ms steps instead of 60 ms
    assert h["ratio"] > 2.0, h
    assert "headspace" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_killed_script_still_writes_results(tmp_path, sig):
    script = write_script(tmp_path)
    out = tmp_path / "out"
    proc = run_cli(["--steps", "500", "--warmup", "2", "--out", str(out), "--", sys.executable, str(script)],
                   {"SAMPLE_SLEEP": "0.002", "STEP_SLEEP": "0.01", "SIGNAL_AT": "12", "SIGNAL": sig})
    summary = json.loads((out / "profile.json").read_text())
    # the command's own status: 143 after the probe's SIGTERM handler, 1 or 130 after KeyboardInterrupt
    assert proc.returncode == summary["exit_status"] in ((143,) if sig == "SIGTERM" else (1, 130)), proc.stderr
    assert summary["ended"] == ("SIGTERM" if sig == "SIGTERM" else "KeyboardInterrupt")
    # batches 0..12 were taken; step 12 never ended (the script died in it) so 12 steps, 2 of them warm-up
    assert summary["steps"] == 12 - 2
    assert summary["exit_status"] != 0


@pytest.mark.slow
def test_ctrl_c_on_the_command_still_writes_results(tmp_path):
    import signal
    import time

    script = write_script(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), SAMPLE_SLEEP="0.002", STEP_SLEEP="0.01", WORKERS="2")
    proc = subprocess.Popen([sys.executable, "-m", "fastload.cli", "profile", "--steps", "100000", "--warmup", "2",
                             "--out", str(out), "--", sys.executable, str(script)], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob("samples-rank0-*.json")) and time.monotonic() < deadline:  # workers flush every 2 s
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    stdout, stderr = proc.communicate(timeout=120)
    summary = json.loads((out / "profile.json").read_text())
    assert proc.returncode == summary["exit_status"] in (1, 130), stderr  # the script's own status
    assert summary["ended"] == "KeyboardInterrupt" and summary["steps"] > 10
    assert "verdict:" in stdout


@pytest.mark.slow
def test_script_that_ends_early(tmp_path):
    summary, proc = profile_script(tmp_path, sample_sleep=0.002, step_sleep=0.005, workers=0, steps=200,
                                   env={"BATCHES": "12"})
    assert summary["ended"] == "exit" and summary["exit_status"] == 0
    assert "script finished 12" in proc.stdout
    assert summary["steps"] == 12 - 3
    assert summary["other_loaders"] == [{"key": summary["other_loaders"][0]["key"], "steps": 2}]


@pytest.mark.slow
def test_python_dash_m_spawned_workers_and_the_users_sitecustomize(tmp_path):
    script = write_script(tmp_path)
    user_site = tmp_path / "usersite"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text(
        "import os, pathlib\npathlib.Path(os.environ['MARKER'], str(os.getpid())).touch()\n")
    (tmp_path / "markers").mkdir()
    out = tmp_path / "out"
    proc = run_cli(["--steps", "15", "--warmup", "3", "--out", str(out), "--", sys.executable, "-m", script.stem],
                   {"SAMPLE_SLEEP": "0.004", "STEP_SLEEP": "0.005", "WORKERS": "2", "MP_CONTEXT": "spawn",
                    "PYTHONPATH": str(user_site), "MARKER": str(tmp_path / "markers")}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "profile.json").read_text())
    assert summary["steps"] == 15 and summary["loader"]["num_workers"] == 2
    assert summary["samples"]["n"] > 0  # spawned workers were instrumented and wrote their timings
    assert set(summary["samples"]["transforms"]) == {"ToTensor", "Normalize"}
    # the user's own sitecustomize still ran: in the script and in both spawned workers
    assert len(list((tmp_path / "markers").iterdir())) >= 3


@pytest.mark.slow
def test_torchrun_two_ranks(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    summary, proc = profile_script(tmp_path, sample_sleep=0.010, step_sleep=0.020, workers=0, steps=20,
                                   launcher=[str(torchrun), "--nproc_per_node=2", "--standalone"])
    assert summary["world_size"] == 2 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    truth = 4 * 0.010 / (4 * 0.010 + 0.020)
    for r in summary["ranks"]:
        assert r["steps"] == 20
        assert abs(r["data_wait_fraction"] - truth) < 0.1, r["data_wait_fraction"]
    assert summary["images_per_s"] == pytest.approx(sum(r["images_per_s"] for r in summary["ranks"]))
    assert summary["local_world_size"] == 2
    assert summary["verdict"].startswith("input-bound")
    assert "rank 1" in proc.stdout
    trace = json.loads((tmp_path / "out" / "trace.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def test_watch_yields_exactly_the_batches_and_records_steps(tmp_path):
    import time

    import fastload
    from fastload.profiling import _probe

    batches = [[i, i * 2] for i in range(12)]

    def slow():
        for b in batches:
            time.sleep(0.004)
            yield b

    with fastload.profile(out=tmp_path / "p", warmup=2) as p:
        seen = []
        for b in fastload.watch(slow()):
            time.sleep(0.004)
            seen.append(b)
    assert seen == batches and all(a is b for a, b in zip(seen, batches))
    s = p.summary()
    assert s["steps"] == 12 - 2
    assert 0.3 < s["data_wait_fraction"] < 0.7
    assert json.loads((tmp_path / "p" / "profile.json").read_text())["data_wait_fraction"] == s["data_wait_fraction"]
    assert _probe.recorder() is None
    # outside a profile, watch still yields the same objects
    assert list(fastload.watch(iter(batches))) == batches


def test_profile_context_patches_dataloader(tmp_path):
    import torch

    import fastload

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([float(i * i)])

    loader = torch.utils.data.DataLoader(Squares(), batch_size=4)
    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        got = [b for b in loader]
    assert torch.equal(torch.cat(got).flatten(), torch.tensor([float(i * i) for i in range(40)]))
    s = p.summary()
    assert s["steps"] == 10 - 1
    assert s["loader"]["batch_bytes"] == 16 and s["samples"]["n"] == 40
    assert list(loader)[0].shape == (4, 1)  # after the block: the plain loader again


def test_fastload_dataloader_with_persistent_workers_over_two_epochs(tmp_path):
    import time

    import torch

    import fastload

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            time.sleep(0.002)
            return torch.tensor([i])

    loader = fastload.DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True, main_threads=None)
    with fastload.profile(out=tmp_path / "p", warmup=2) as p:
        seen = [b for _ in range(2) for b in loader]
    assert sorted(torch.cat(seen).flatten().tolist()) == sorted(list(range(40)) * 2)
    s = p.summary()
    assert s["steps"] == 2 * 10 - 2  # both epochs, one training loader
    assert s["loader"]["class"] == "fastload.load.loader.DataLoader" and s["loader"]["num_workers"] == 2
    assert s["loader"]["persistent_workers"] is True
    assert s["samples"]["n"] >= 2  # the workers are still alive: their early flushes were read
    del loader


def test_summary_before_end_is_an_error(tmp_path):
    import fastload

    p = fastload.profile(out=tmp_path / "p")
    with pytest.raises(fastload.ProfileError, match="has not ended"):
        p.summary()


def test_command_with_no_loader_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["profile", "--out", str(tmp_path / "o"), "--", sys.executable, "-c", "pass"])
    assert result.exit_code == 1
    assert "ran no measured loader steps" in result.output and "HINT" in result.output


def test_missing_command_and_tensorboard(tmp_path):
    result = CliRunner().invoke(main, ["profile", "--", "no-such-program-xyz"])
    assert result.exit_code == 1 and "not found" in result.output
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        result = CliRunner().invoke(main, ["profile", "--tensorboard", str(tmp_path), "--", "true"])
        assert result.exit_code == 1 and "pip install tensorboard" in result.output


def test_interval_arithmetic_of_the_gpu_timeline():
    # window 0..100 us; kernels 10-30, 20-40 (overlap), 60-70; data wait 40-80
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "fastload.data_wait", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "fastload.data_wait", "ts": 40, "dur": 40},
        {"ph": "X", "cat": "user_annotation", "name": "fastload.window_end", "ts": 100, "dur": 0},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 10, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 20, "dur": 20},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 60, "dur": 10},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "fastload.data_wait", "ts": 0, "dur": 100},
    ]}
    t = _kineto.gpu_timeline(trace)
    assert t["gpu_busy_fraction"] == pytest.approx(0.40)
    assert t["gpu_idle_fraction"] == pytest.approx(0.60)
    # idle inside the waits: 0-5 and 40-60, 70-80
    assert t["input_bound_idle_fraction"] == pytest.approx(0.35)
    assert t["htod_copy_fraction"] == pytest.approx(0.10)


def _summary(wait, workers, per_sample_ms, cpu_share, parts, floats=0.0, pinned=None):
    step = 0.1
    return {"data_wait_fraction": wait, "gpu_idle_fraction": wait, "input_bound_idle_fraction": wait,
            "idle_source": "host-clock", "steps_per_s": 1 / step, "images_per_step": 8,
            "loader": {"num_workers": workers, "cpus_per_process": 4, "worker_cpu_util_mean": 0.97 if workers else None,
                       "pinned": pinned},
            "samples": {"per_sample_ms": per_sample_ms, "cpu_share": cpu_share, "parts": parts,
                        "float_transform_share": floats}}


def test_recommendations_follow_the_measurement():
    # CPU-bound decode with all 3 workers busy: the gain of each change comes from its share of sample time
    parts = {"read": 0.3, "decode": 0.5, "transform": 0.15, "other": 0.05}
    s = _summary(0.6, 3, per_sample_ms=30.0, cpu_share=0.95, parts=parts, floats=0.12)
    verdict, recs = recommend(s, plan_workers=3, has_gpu=True)
    assert verdict.startswith("input-bound") and "50% of each sample's time is image decode" in verdict
    stages = [r["stage"] for r in recs]
    assert stages[0] == "dali-gpu" and "lmdb" in stages and "fast" in stages and "workers" not in stages
    gains = [r["expected_gain"] for r in recs]
    assert gains == sorted(gains, reverse=True) and all(1.0 < g <= 1 / (1 - 0.6) + 1e-9 for g in gains)
    # no GPU: DALI on the GPU is not offered
    _, recs = recommend(s, plan_workers=3, has_gpu=False)
    assert "dali-gpu" not in [r["stage"] for r in recs]
    # barely waiting: compute-bound
    verdict, recs = recommend(_summary(0.04, 3, 30.0, 0.95, parts), plan_workers=3, has_gpu=True)
    assert verdict.startswith("compute-bound") and recs[0]["expected_gain"] == pytest.approx(1 / 0.96)
    # samples that mostly sleep: workers beyond the 4 CPUs, as many as keep up with the step
    io = _summary(0.5, 2, 20.0, 0.1, {"read": 0.0, "decode": 0.05, "transform": 0.05, "other": 0.9})
    io["samples"].update(runqueue_share=0.05, blocked_share=0.85)
    _, recs = recommend(io, plan_workers=3, has_gpu=False)
    assert recs[0]["change"] == "num_workers=4"  # 8 x 20 ms = 160 ms per batch, a 50 ms step: ceil(3.2)
    # the same off-CPU time spent waiting for a CPU (oversubscribed machine): no workers beyond the CPUs
    io["samples"].update(runqueue_share=0.8, blocked_share=0.05)
    verdict, recs = recommend(io, plan_workers=3, has_gpu=False)
    assert "oversubscribed" in verdict and recs[0]["change"] == 'num_workers="auto" (-> 3)'
    # the loader in the main process, CPU-bound samples: auto workers
    _, recs = recommend(_summary(0.5, 0, 6.0, 0.9, {"read": 0.0, "decode": 0.1, "transform": 0.1, "other": 0.8}),
                        plan_workers=3, has_gpu=False)
    assert recs[0]["change"] == 'num_workers="auto" (-> 3)'
    # main step 50 ms of compute; 48 ms of loading over 3 workers: every batch in time -> the full 2x
    assert recs[0]["expected_gain"] == pytest.approx(2.0)


@pytest.mark.gpu
def test_kineto_idle_on_a_constructed_kernel_workload(tmp_path):
    """Steps of ~20 ms of GPU matmuls, synchronised, after a 20 ms host wait for data: half the time idle,
    all of it while the host waits."""
    import time

    import torch

    import fastload

    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    reps = max(1, round(0.020 / ((time.perf_counter() - t0) / 10)))

    def data():
        for _ in range(40):
            time.sleep(0.020)
            yield torch.ones(8)

    with fastload.profile(out=tmp_path / "p", warmup=5, kineto_steps=20) as p:
        for _ in fastload.watch(data()):
            for _ in range(reps):
                a @ a
            torch.cuda.synchronize()
    s = p.summary()
    assert s["idle_source"] == "cuda"
    assert s["kineto"]["steps"] == 20 and s["kineto"]["gpu_events"] >= 20 * reps
    truth = s["data_wait_fraction"]  # the GPU had nothing to do exactly while the host waited
    assert 0.3 < truth < 0.7
    # the hand-off CUDA events (every measured step, not only the Kineto window) see the same idle
    assert abs(s["event_input_bound_idle_fraction"] - truth) < 0.07
    assert abs(s["gpu_idle_fraction"] - truth) < 0.07, (s["gpu_idle_fraction"], truth)
    assert abs(s["input_bound_idle_fraction"] - truth) < 0.07
    assert (tmp_path / "p" / "kineto-rank0.json").exists()


@pytest.mark.gpu
def test_kineto_compute_bound_kernel_workload(tmp_path):
    import torch

    import fastload

    a = torch.randn(2048, 2048, device="cuda")
    batches = [torch.ones(8) for _ in range(40)]
    with fastload.profile(out=tmp_path / "p", warmup=5, kineto_steps=20) as p:
        for _ in fastload.watch(batches):
            for _ in range(20):
                a @ a
    torch.cuda.synchronize()
    s = p.summary()
    assert s["idle_source"] == "cuda"
    assert s["gpu_idle_fraction"] < 0.1 and s["input_bound_idle_fraction"] < 0.05
    assert s["event_input_bound_idle_fraction"] < 0.05
    assert s["verdict"].startswith("compute-bound")
    # without the Kineto window the hand-off events still give the input-bound idle
    with fastload.profile(out=tmp_path / "q", warmup=5, kineto_steps=0) as q:
        for _ in fastload.watch(batches):
            for _ in range(20):
                a @ a
    assert q.summary()["idle_source"] == "cuda-events" and q.summary()["input_bound_idle_fraction"] < 0.05


def test_a_new_recommendation_is_one_rule_function(monkeypatch):
    """A rule reads the fitted model and returns its ``Recommendation``s; adding one to ``RULES`` is all it
    takes to be ranked, filtered (under 2%: no advice) and reported like the built-in ones."""
    from fastload.profiling import _recommend as rec

    def rule_smaller_images(m: rec.Model) -> list[rec.Recommendation]:
        if not m.samples or m.parts["decode"] < 0.4:
            return []
        return [rec.Recommendation(change="store smaller images (fastload convert --max-side 512)", stage="store-size",
                                   why=f"{m.parts['decode']:.0%} of sample time is decode", code="--max-side 512",
                                   expected_gain=m.gain(m.tb * 0.5, m.tcpu * 0.5, m.n_after))]

    parts = {"read": 0.3, "decode": 0.5, "transform": 0.15, "other": 0.05}
    s = _summary(0.6, 3, per_sample_ms=30.0, cpu_share=0.95, parts=parts, floats=0.12)
    _, before = recommend(dict(s), plan_workers=3, has_gpu=False)
    monkeypatch.setattr(rec, "RULES", [*rec.RULES, rule_smaller_images])
    _, recs = recommend(dict(s), plan_workers=3, has_gpu=False)
    added = [r for r in recs if r["stage"] == "store-size"]
    assert len(recs) == len(before) + 1 and added[0]["why"] == "50% of sample time is decode"
    assert set(added[0]) == {"change", "stage", "why", "expected_gain", "code"}  # unset options are left out
    assert [r["expected_gain"] for r in recs] == sorted((r["expected_gain"] for r in recs), reverse=True)
    _, recs = recommend(_summary(0.6, 3, 30.0, 0.95, {**parts, "decode": 0.2, "other": 0.35}), plan_workers=3,
                        has_gpu=False)
    assert "store-size" not in [r["stage"] for r in recs]


def test_the_thread_loaders_autotune_decisions_are_in_the_profile(tmp_path):
    import torch

    import fastload
    from fastload.load.autotune import AutotuneOptions
    from fastload.profiling._profile_report import format_summary

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([float(i * i)])

    # a window per batch: every batch after the first ends one, whatever the timing (10 batches: 9 decisions)
    options = AutotuneOptions(first_window=1, window=1, max_threads=3)
    loader = fastload.DataLoader(Squares(), batch_size=4, num_workers=2, backend="threads", autotune=options)
    with fastload.profile(out=tmp_path / "p", warmup=1) as p:
        got = [b for b in loader]
    assert torch.equal(torch.cat(got).flatten(), torch.tensor([float(i * i) for i in range(40)]))
    s = p.summary()
    tuned = s["loader"]["autotune"]
    assert tuned == loader.autotune_decisions and len(tuned) == 9
    assert [d["batch"] for d in tuned] == list(range(1, 10))
    text = format_summary(s)
    assert "autotune: " in text and f"ended at {tuned[-1]['threads']} thread(s)" in text
