"""SIGKILL a real `fastload convert` mid-way, rerun it, and compare with an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lmdb
import pytest

from fastload.datasets import DatasetSpec, make_dataset
from fastload.store import format as fmt


def records(path):
    env = lmdb.open(str(path), readonly=True, lock=False)
    with env.begin() as txn:
        out = dict(txn.cursor())
    env.close()
    return out


def committed_chunks(path) -> int:
    if not (path / "data.mdb").exists():
        return 0
    try:
        env = lmdb.open(str(path), readonly=True, lock=True)
    except lmdb.Error:
        return 0
    with env.begin() as txn:
        n = sum(1 for k, _ in txn.cursor() if k.startswith(fmt.CHUNK_PREFIX))
    env.close()
    return n


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "fastload.cli", *map(str, args)]


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["jpeg", "raw"])
def test_sigkill_then_rerun_gives_the_same_records(tmp_path, encoding):
    src = make_dataset(tmp_path / "src", DatasetSpec(num_classes=4, per_class=40, min_side=64, max_side=240, seed=5),
                       workers=2)
    dst = tmp_path / "killed"
    cmd = cli("convert", src, dst, "--quiet", "--chunk-size", "3", "--workers", "1", "--encoding", encoding)
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while committed_chunks(dst) < 3:
        assert proc.poll() is None, "conversion finished before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI and its worker processes, mid-write
    proc.wait()
    assert fmt.META_KEY not in records(dst), "the killed run must not have finished"

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed after" in rerun.stdout
    straight = subprocess.run(cli("convert", src, tmp_path / "straight", "--quiet", "--encoding", encoding),
                              capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr
    assert records(dst) == records(tmp_path / "straight")
    # LMDB can leave freed pages unwritten at the end of the file; a resumed store must still pass the
    # readers' truncation check (it used to be refused as "cut short" when opened for reading)
    from fastload.store.reader import check_data_file

    check_data_file(dst)
    check_data_file(tmp_path / "straight")

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already complete" in again.stdout
