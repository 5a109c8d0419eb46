"""A real local Ray cluster for the tests, reachable on 127.0.0.1 only.

A pytest plugin (loaded by ``tests/conftest.py``): ``ray_cluster`` (session) starts one
local cluster (``ray.init(num_cpus=2, include_dashboard=False)``) with the node address
forced to 127.0.0.1 and shuts it down at the end. Skipped when ray is not installed.

Ray 2.60's gRPC servers listen on wildcard addresses (``0.0.0.0``/``::``) whatever the node
address, so forcing the address is not enough to keep the tests off the machine's network.
The fixture therefore starts Ray only inside a loopback-only network namespace (where a
wildcard listener is reachable through ``lo`` alone) and skips, saying how, elsewhere:
``.ci/run`` runs the slow tests under ``unshare -n``. docs/convert-at-scale.md, "Ray on
loopback", says the same for users.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest


#: how to run the Ray tests where they may run (the reason the fixture skips elsewhere)
NETNS_HINT = ("Ray listens on every interface; the Ray tests run only in a loopback-only network "
              "namespace: unshare -n sh -c 'ip link set lo up; python -m pytest -m slow' "
              "(as root; `unshare -rn` otherwise). .ci/run does this.")


def loopback_only_netns() -> bool:
    """True when this process's network namespace has no interface but ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


@pytest.fixture(scope="session")
def ray_cluster():
    """The address of a running local Ray cluster (the tests' driver is connected to it)."""
    # Read when ray is imported and by every process it starts: Ray replaces a 127.0.0.1 node address
    # with the machine's routable one (services.resolve_ip_for_localhost) unless "clusters" are off,
    # which makes it advertise and connect over loopback; no usage report.
    if not loopback_only_netns():
        pytest.skip(NETNS_HINT)
    mp = pytest.MonkeyPatch()  # the environment is restored when the session ends
    mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # workers import test-only conversion handlers (tests/pack/die_once_handler.py) by name
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pack")
    mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    try:
        ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'fastload[ray]')")
    except BaseException:
        mp.undo()
        raise
    # a short folder: Ray puts Unix sockets in it, and their paths are limited to 107 bytes
    tmp = tempfile.mkdtemp(prefix="fastload-ray-", dir="/tmp")
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                   _temp_dir=tmp, log_to_driver=False, configure_logging=False)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        mp.undo()
