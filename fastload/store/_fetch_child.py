"""``python -m fastload.store._fetch_child URL PATH``: one download in a fresh process.

obstore's runtime does not survive ``fork()``: a forked DataLoader worker whose parent already
used obstore hangs in its first request (a fork of a process with the tokio runtime's threads).
Such a process downloads shards through this module instead (``remote_store._download``); a
shard is megabytes to gigabytes, so the interpreter start is noise. The failure comes back as
one JSON line on stderr and becomes the same ``RemoteStoreError`` in the caller.
"""

from __future__ import annotations

import json
import sys

from fastload.errors import RemoteStoreError
from fastload.store.remote import download_file


def main(argv: list[str]) -> int:
    url, path = argv
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
