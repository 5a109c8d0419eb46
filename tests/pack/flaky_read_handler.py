"""A conversion handler whose object-store reads fail while a fault is on: for files named flaky_*,
while the file named by $FASTLOAD_TEST_FAULT exists, reading raises ``RemoteStoreError`` (as a
throttled, reset or expired-credential read does); once the fault is cleared it reads normally."""

import os

from fastload.errors import RemoteStoreError
from fastload.pack.work import prepare_item as real


def prepare_item(location: str, options):
    fault = os.environ.get("FASTLOAD_TEST_FAULT")
    if os.path.basename(location).startswith("flaky_") and fault and os.path.exists(fault):
        raise RemoteStoreError(f"s3://bucket/{os.path.basename(location)}: reading failed: SlowDown (503).\n"
                               "HINT: rerun", url=location, reason="other")
    return real(location, options)
