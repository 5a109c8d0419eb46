"""A sharded-conversion handler for the "one shard fails, the others are cancelled" test: a file whose
name holds ``fail_now`` fails to read (``RemoteStoreError``, as a throttled read does); every other
file takes a second, so the other shards are still running when the failure is reported."""

import os
import time

from fastload.errors import RemoteStoreError
from fastload.pack.work import prepare_item as real


def prepare_item(location: str, options):
    if "fail_now" in os.path.basename(location):
        raise RemoteStoreError(f"{location}: reading failed: SlowDown (503).\nHINT: rerun", url=location)
    time.sleep(1.0)
    return real(location, options)
