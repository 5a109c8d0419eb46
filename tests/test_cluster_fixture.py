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
