"""A real local Ray cluster for the tests, bound to 127.0.0.1 only.

A pytest plugin (loaded by ``tests/conftest.py``): ``ray_cluster`` (session) starts one
local cluster (``ray.init(num_cpus=2, include_dashboard=False)``) with the node address
forced to 127.0.0.1 and shuts it down at the end. Skipped when ray is not installed.
How the loopback-only binding is checked is in docs/convert-at-scale.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a running local Ray cluster (the tests' driver is connected to it)."""
    # Read when ray is imported and by every process it starts: Ray replaces a 127.0.0.1 node address
    # with the machine's routable one (services.resolve_ip_for_localhost) unless "clusters" are off,
    # which makes it advertise and connect over loopback; no usage report.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'fastload[ray]')")
    # a short folder: Ray puts Unix sockets in it, and their paths are limited to 107 bytes
    tmp = tempfile.mkdtemp(prefix="fastload-ray-", dir="/tmp")
    ctx = ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                   _temp_dir=tmp, log_to_driver=False, configure_logging=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
