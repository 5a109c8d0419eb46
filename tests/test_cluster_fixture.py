"""tests/cluster.py: the local Ray cluster runs tasks, and every address it advertises is loopback.

What listens where is recorded, not asserted: Ray 2.x's gRPC servers (GCS, raylet, workers,
agents) listen on wildcard addresses whatever the node address (docs/convert-at-scale.md,
"Ray on loopback", says how to confine them: a network namespace or a firewall rule).
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
