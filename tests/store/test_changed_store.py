"""A store whose data.mdb changes while it is read: a named error, not SIGBUS or stale records.

Reading a memory map past the end of its file kills the process with SIGBUS (LMDB maps
data.mdb). A store replaced in place by a smaller file mid-epoch (a re-run ``cp``, an
rsync without --inplace=no, a re-conversion into the same path) must fail with
``StoreChangedError`` naming the store and the change. Each case runs in a subprocess, so
the unguarded SIGBUS kills that process and not pytest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastload.errors import StoreChangedError, StoreDamagedError
from fastload.store.reader import StoreReader

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.loader import DataLoader
    from fastload.load.transforms import eval_transform
    store, how = Path(sys.argv[1]), sys.argv[2]
    loader = DataLoader(LMDBImageDataset(store, transform=eval_transform(32)), batch_size=4, num_workers=2,
                        backend="threads", shuffle=True)
    it = iter(loader)
    next(it)
    # the batches the pool reads ahead finish first: a thread inside a read when the file is cut short is the
    # one window the guard cannot close (a stat, then the read: StoreReader._check_unchanged), and with the
    # pool still reading, this test hit it in 1 run of 40 (SIGBUS in CI once); the reads that follow the cut
    # are the ones checked here
    for batch in list(it._inflight):
        assert batch.done.wait(60)
    data = store / "data.mdb"
    if how == "smaller-in-place":  # the same inode, rewritten shorter (what cp onto it does)
        head = data.read_bytes()[: data.stat().st_size // 3]
        with open(data, "r+b") as f:
            f.truncate(0)
            f.write(head)
    elif how == "replaced":  # a new file renamed over it (its own inode)
        tmp = store / "new.mdb"
        tmp.write_bytes(data.read_bytes())
        os.replace(tmp, data)
    try:
        for _ in it:
            pass
    except Exception as exc:
        print("raised", type(exc).__name__, str(exc).replace(chr(10), " | "), flush=True)
    else:
        print("no error", flush=True)
""")


def run(store: Path, how: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(store), how], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def store(tiny_store, tmp_path) -> Path:
    dst = tmp_path / "copy.lmdb"
    shutil.copytree(tiny_store, dst)
    return dst


def test_a_store_cut_short_in_place_mid_epoch_raises_a_named_error_not_sigbus(store):
    proc = run(store, "smaller-in-place")
    assert proc.returncode == 0, f"the reader died (returncode {proc.returncode}; -7 is SIGBUS): {proc.stderr[-800:]}"
    assert "raised StoreChangedError" in proc.stdout, proc.stdout + proc.stderr[-800:]
    assert str(store) in proc.stdout and "changed while it was being read" in proc.stdout and "HINT" in proc.stdout


def test_a_store_replaced_by_another_file_mid_epoch_is_named_too(store):
    proc = run(store, "replaced")
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "raised StoreChangedError" in proc.stdout and "another file" in proc.stdout, proc.stdout


def test_the_changed_store_error_is_a_store_damaged_error_and_names_the_sample(store):
    reader = StoreReader(store)
    reader.get(0)
    data = store / "data.mdb"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 1_000_000_000))
    with pytest.raises(StoreChangedError, match=r"sample 1 \(") as err:
        reader.get(1)
    assert isinstance(err.value, StoreDamagedError)
