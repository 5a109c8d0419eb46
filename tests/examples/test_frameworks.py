"""The Lightning and accelerate examples: they train on a fastload store, and a run resumed from
the framework's own checkpoint trains on exactly the batches the uninterrupted run did; and
``fastload profile`` works unchanged on the Lightning ``Trainer.fit`` script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# 24 images, batch 4: 6 steps per epoch; 10 steps cross an epoch boundary after the step-4 checkpoint
ARGS = ["--max-steps", "10", "--every", "4", "--batch-size", "4", "--size", "16", "--workers", "0"]


def run(*cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *cmd], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def batches(log: Path) -> dict[int, str]:
    """step -> the batch's fingerprint (pixel sum and labels)."""
    return {int(line.split(" ", 1)[0]): line.split(" ", 1)[1] for line in log.read_text().splitlines()}


@pytest.mark.slow
def test_lightning_datamodule_resumes_exactly_through_lightnings_checkpoint(tiny_store, tmp_path):
    pytest.importorskip("lightning")
    script = str(EXAMPLES / "lightning_train.py")
    run(script, str(tiny_store), "full", *ARGS, "--log-batches", "full.log", cwd=tmp_path)
    full = batches(tmp_path / "full.log")
    assert sorted(full) == list(range(10))
    # a run killed after its step-4 checkpoint: only that checkpoint is left
    (tmp_path / "killed").mkdir()
    shutil.copy(tmp_path / "full" / "step=4.ckpt", tmp_path / "killed")
    proc = run(script, str(tiny_store), "killed", *ARGS, "--log-batches", "resumed.log", cwd=tmp_path)
    assert "Restored all states from the checkpoint" in proc.stdout + proc.stderr
    resumed = batches(tmp_path / "resumed.log")
    assert sorted(resumed) == list(range(4, 10))
    assert resumed == {k: full[k] for k in range(4, 10)}  # the same batches, same crops, across the epoch end


@pytest.mark.slow
def test_accelerate_resumes_exactly_through_save_state(tiny_store, tmp_path):
    pytest.importorskip("accelerate")
    script = str(EXAMPLES / "accelerate_train.py")
    run(script, str(tiny_store), "full", *ARGS, "--log-batches", "full.log", cwd=tmp_path)
    full = batches(tmp_path / "full.log")
    assert sorted(full) == list(range(10))
    # killed after step 6: the last save_state was at step 4 (it is overwritten at 8 in the full run)
    short = [*ARGS]
    short[1] = "6"
    run(script, str(tiny_store), "killed", *short, cwd=tmp_path)
    proc = run(script, str(tiny_store), "killed", *ARGS, "--log-batches", "resumed.log", cwd=tmp_path)
    assert "resumed at step 4" in proc.stdout
    resumed = batches(tmp_path / "resumed.log")
    assert resumed == {k: full[k] for k in range(4, 10)}


@pytest.mark.slow
def test_fastload_profile_works_unchanged_on_a_lightning_trainer_fit_script(tiny_store, tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "prof"
    proc = run("-m", "fastload.cli", "profile", "--steps", "4", "--warmup", "2", "--out", str(out), "--",
               sys.executable, str(EXAMPLES / "lightning_train.py"), str(tiny_store), "ck", "--max-steps", "12",
               "--every", "100", "--batch-size", "4", "--size", "16", "--workers", "0", cwd=tmp_path)
    assert "fastload profile: 4 steps after 2 warm-up" in proc.stdout
    prof = json.loads((out / "profile.json").read_text())
    assert prof["exit_status"] == 0 and prof["steps"] == 4 and prof["images_per_step"] == 4
    assert prof["loader"]["class"] == "fastload.load.loader.DataLoader"  # it found the DataModule's loader
    assert prof["samples"]["n"] > 0 and prof["images_per_s"] > 0
    # named by the DataLoader(...) line of train_dataloader(), not by Lightning's combined_loader.py
    source = (EXAMPLES / "lightning_train.py").read_text().splitlines()
    line = next(i for i, t in enumerate(source, 1) if "return DataLoader(" in t)
    assert prof["loader"]["created_at"] == f"{EXAMPLES / 'lightning_train.py'}:{line}"
    assert prof["loader"]["key"].endswith(f"lightning_train.py:{line}") and "lightning/" not in prof["loader"]["key"]
    assert "site-packages" not in prof["loader"]["iterated_at"]  # the script's trainer.fit(...) line
    assert f"lightning_train.py:{line}: num_workers=0" in proc.stdout
    # the store's samples: read, decode and the preset's crop/resize, not "other"
    parts = prof["samples"]["parts"]
    assert parts["read"] > 0 and parts["decode"] > 0 and parts["transform"] > 0 and parts["other"] < 0.5, parts
