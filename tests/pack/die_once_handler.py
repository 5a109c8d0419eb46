"""A sharded-conversion handler whose task dies mid-shard once: on a file whose name holds
``die_once``, the first attempt waits until the shard being written in scratch (``<tree>/../scratch``)
has committed samples (4, two chunks of ``chunk_size=2``), records how many, then SIGKILLs the process
running the shard task (the pool worker's parent), as an out-of-memory kill or a lost node would;
the retry finds the marker and converts normally."""

import glob
import os
import signal
import time
from pathlib import Path

from fastload.pack.work import prepare_item as real


def _committed(scratch: Path, pid: int) -> int:
    import lmdb

    for work in glob.glob(str(scratch / f"fastload-shard-*-pid{pid}-*" / "work")):
        env = lmdb.open(work, readonly=True, lock=False, subdir=True)
        try:
            with env.begin() as txn:
                return sum(1 for k, _ in txn.cursor() if len(k) == 8)  # sample records (sample_key)
        finally:
            env.close()
    return 0


def prepare_item(location: str, options):
    marker = location + ".killed"
    if "die_once" in os.path.basename(location) and not os.path.exists(marker):
        scratch, task = Path(location).parents[2] / "scratch", os.getppid()
        deadline = time.monotonic() + 60
        while (n := _committed(scratch, task)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        with open(marker, "w") as f:
            f.write(str(n))  # samples of this shard committed when its task was killed
        os.kill(task, signal.SIGKILL)
        os._exit(1)
    return real(location, options)
