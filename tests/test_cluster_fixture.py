"""tests/cluster.py: the local Ray cluster runs tasks, and every address it advertises is loopback.

Ray 2.x's gRPC servers (GCS, raylet, workers, agents) listen on wildcard addresses whatever the
node address, so the fixture runs Ray only in a loopback-only network namespace (tests/cluster.py);
the second test checks that every socket Ray's processes listen on is reachable through ``lo`` only.
"""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_ray_cluster_advertises_loopback_only(ray_cluster):
    import ray

    @ray.remote
    def node_ip() -> str:
        return ray.util.get_node_ip_address()

    assert ray_cluster.startswith("127.0.0.1:")
    assert ray.get(node_ip.remote()) == "127.0.0.1"
    nodes = ray.nodes()
    assert len(nodes) == 1 and nodes[0]["NodeManagerAddress"] == "127.0.0.1"


@pytest.mark.slow
def test_every_ray_listener_is_reachable_on_loopback_only(ray_cluster):
    import ipaddress
    import socket

    import psutil

    # the fixture ran Ray in a namespace whose only interface is lo: a wildcard listener there is
    # loopback-only too, and a listener on any other address cannot exist
    assert [name for _, name in socket.if_nameindex()] == ["lo"]
    ray_procs = [p for p in psutil.process_iter(["name", "cmdline"])
                 if any(k in " ".join(p.info["cmdline"] or []) or k in (p.info["name"] or "")
                        for k in ("gcs_server", "raylet", "ray::", "dashboard", "default_worker"))]
    assert ray_procs, "no Ray process found"
    listening = [c.laddr for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in {p.pid for p in ray_procs}]
    assert listening, "Ray's processes listen on nothing"
    for addr in listening:
        ip = ipaddress.ip_address(addr.ip)
        if getattr(ip, "ipv4_mapped", None):
            ip = ip.ipv4_mapped
        assert ip.is_loopback or ip.is_unspecified, addr


_PROBE = """
import json, ray_probe_marker
from fastload.pack.engines import EngineOptions
from fastload.pack.ray_engine import connect
ray, started = connect(EngineOptions(engine="ray"))
@ray.remote
def node_ip():
    return ray.util.get_node_ip_address()
try:
    print(json.dumps({"started": started, "gcs": ray.get_runtime_context().gcs_address,
                      "nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "task": ray.get(node_ip.remote())}))
finally:
    ray.shutdown()
"""


@pytest.mark.slow
def test_a_cluster_fastload_starts_advertises_loopback(tmp_path):
    # its own network namespace whose lo also holds 10.99.0.1 with a default route: there Ray's
    # "routable address" is 10.99.0.1, so a cluster that does not keep 127.0.0.1 shows it
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -rn (a network namespace of its own)")
    (tmp_path / "ray_probe_marker.py").write_text("import sys\nassert 'ray' not in sys.modules\n")
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    root = str(Path(__file__).parents[1])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    # a cluster `ray start` left on record in Ray's temp folder, long gone: a cluster fastload starts must not
    # try to join it (ray.init without address="local" waited on its dead GCS until the caller gave up)
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="flrt", dir="/tmp"))  # short: Ray's socket paths are limited
    (ray_tmp / "ray").mkdir()  # Ray's own folder under RAY_TMPDIR, where `ray start` records its cluster
    (ray_tmp / "ray" / "ray_current_cluster").write_text("10.203.127.3:6379")
    env.update(PYTHONPATH=os.pathsep.join([root, str(tmp_path)]), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=str(ray_tmp))
    setup = ("ip link set lo up && ip addr add 10.99.0.1/32 dev lo && ip route add default dev lo src 10.99.0.1 && "
             f"exec {sys.executable} {script}")
    try:
        out = subprocess.run(["unshare", "-rn", "sh", "-c", setup], env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stdout + out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["started"] and seen["gcs"].startswith("127.0.0.1:"), seen
    assert seen["nodes"] == ["127.0.0.1"] and seen["task"] == "127.0.0.1", seen
