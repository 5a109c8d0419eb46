"""``python -m fastload.store._fetch_child URL PATH``: one download in a fresh process.

obstore's runtime does not survive ``fork()``: a forked DataLoader worker whose parent already
used obstore hangs in its first request (a fork of a process with the tokio runtime's threads).
Such a process downloads shards through this module instead (``remote_store._download``); a
shard is megabytes to gigabytes, so the interpreter start is noise. The failure comes back as
one JSON line on stderr and becomes the same ``RemoteStoreError`` in the caller.

The download ends with the process that asked for it: torch terminates a DataLoader worker
that does not stop within 5 s of its shutdown (SIGTERM, no Python cleanup), and an orphaned
download would go on for up to the retry budget (or a whole 1 GB shard) into a partial folder
nobody reads. A watchdog thread sees the parent go, removes what this process wrote (the
partial file, and PATH's folder when that leaves it empty: the cache made it for this
download) and exits.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from fastload.errors import RemoteStoreError
from fastload.store.remote import download_file

WATCH_S = 0.25  # how often the watchdog looks for the parent


def _abandon(path: Path) -> None:
    """The process that wanted these bytes is gone: remove what this one wrote, and exit."""
    for _ in range(3):  # a retry may open a new partial file between the unlinks and the rmdir
        for f in (path.with_name(f".{path.name}.{os.getpid()}.part"), path):
            try:
                f.unlink()
            except OSError:
                pass
        try:
            path.parent.rmdir()  # only when empty
            break
        except FileNotFoundError:
            break
        except OSError:
            continue
    os._exit(4)


def _watch_parent(parent: int, path: Path) -> None:
    while True:
        if os.getppid() != parent:  # reparented (or never ours): the process that wanted these bytes is gone
            _abandon(path)
        time.sleep(WATCH_S)


def main(argv: list[str]) -> int:
    """``URL PATH [PARENT_PID]``: PARENT_PID is the pid of the process that wants the bytes (it may die
    before this interpreter has started: then ``os.getppid()`` is already someone else's)."""
    url, path = argv[:2]
    parent = int(argv[2]) if len(argv) > 2 else os.getppid()
    threading.Thread(target=_watch_parent, args=(parent, Path(path)), daemon=True,
                     name="fastload-fetch-watchdog").start()
    try:
        download_file(url, path)
    except RemoteStoreError as exc:
        ctx = exc.__context__
        err = getattr(ctx, "errno", None) if isinstance(ctx, OSError) else None
        sys.stderr.write(json.dumps({"message": str(exc), "url": exc.url, "reason": exc.reason, "errno": err}) + "\n")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
