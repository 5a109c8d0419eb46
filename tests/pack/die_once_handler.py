"""A sharded-conversion handler whose task dies mid-shard once: on a file named die_once.*, the
first attempt SIGKILLs the process running the shard task (the pool worker's parent), as an
out-of-memory kill or a lost node would; the retry finds the marker and converts normally."""

import os
import signal

from fastload.pack.work import prepare_item as real


def prepare_item(location: str, options):
    marker = location + ".killed"
    if os.path.basename(location).startswith("die_once.") and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getppid()))
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
    return real(location, options)
