"""Across real links: nodes in network namespaces on a bridge (tests/netns.py), the bucket in a node of
its own, each node's link shaped with tc. torchrun across two nodes, and a link cut mid-epoch."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fastload.store.cache import node_downloads
from remote_helpers import sharded_store

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def _publish(node, bucket, local: Path, url: str) -> dict:
    """Upload a local sharded store from ``node`` (through its link); the manifest as JSON."""
    node.run([sys.executable, "-c", "import sys, pathlib; from remote_helpers import publish; publish(pathlib.Path(sys.argv[1]), sys.argv[2])",
              local, url], env=bucket.env)
    return json.loads(node.run([sys.executable, "-c", "import sys; from fastload.store import remote; "
                                "print(remote.get_bytes(remote.RemoteLocation.parse(sys.argv[1]).child('manifest.json'))"
                                ".decode())", url], env=bucket.env).stdout)


def _shard_of(manifest: dict):
    spans = [(s["start"], s["start"] + s["count"], s["name"]) for s in manifest["shards"]]
    return lambda i: next(name for a, b, name in spans if a <= i < b)


def _torchrun_env(bucket) -> dict[str, str]:
    # gloo and torchrun pick an interface from the host name, which every namespace shares: name the link
    return dict(bucket.env, GLOO_SOCKET_IFNAME="eth0", TP_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")


def _torchrun_two_nodes(cluster, bucket, url, limit, mode, *, cache="cache"):
    """tests/load/ddp_remote_check.py on 2 nodes x 2 ranks (rendezvous on node a), each node its own cache."""
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    port = 29400 + (hash(cluster.tag) % 500)
    procs = {}
    for node in (a, b):
        (node.root / "out").mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={a.address}:{port}", f"--local-addr={node.address}",
               # torchrun takes the host of the rendezvous to be the node whose host name resolves to its
               # address: namespaces share one host name, so say which node hosts it
               f"--rdzv-conf=is_host={int(node is a)}", f"--rdzv-id={mode}",
               HERE / "ddp_remote_check.py", url, node.root / cache, node.root / "out", limit, mode, 0, 1]
        procs[node.name] = node.popen(cmd, env=_torchrun_env(bucket), log=node.root / f"torchrun-{mode}.log")
    for name, proc in procs.items():
        assert proc.wait(timeout=300) == 0, f"node {name}: {proc.log.read_text()[-4000:]}"


def _records(a, b, mode="full") -> dict:
    """global rank -> (node, the record that rank wrote)"""
    records = {}
    for node in (a, b):
        for path in (node.root / "out").glob(f"{mode}*.json"):
            records[int(path.stem[len(mode):])] = (node, json.loads(path.read_text()))
    return records


def test_the_cluster_fixture_gives_nodes_their_own_links(netns_cluster):
    a, b = netns_cluster.node("a"), netns_cluster.node("b")
    a.shape(100)
    server = b.popen([sys.executable, "-c", "import socket; s = socket.create_server(('0.0.0.0', 9000)); "
                      "c, _ = s.accept(); n = 0\nwhile (d := c.recv(65536)): n += len(d)\nprint(n, flush=True)"])
    before = a.link_bytes()
    a.run([sys.executable, "-c", "import socket, time\nfor _ in range(100):  # until b listens\n"
           f"    try: c = socket.create_connection(('{b.address}', 9000)); break\n"
           "    except ConnectionRefusedError: time.sleep(0.1)\nc.sendall(b'x' * 2_000_000); c.close()"])
    server.wait(timeout=30)
    assert server.log.read_text().split()[-1] == "2000000"
    assert a.link_bytes()[1] - before[1] >= 2_000_000  # it crossed a's link, not a loopback
    qdisc = a.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in qdisc and "100Mbit" in qdisc
    # the node's namespace sees its own link and loopback only: not the test process's network
    assert {line.split(":")[1].strip().split("@")[0] for line in a.run(["ip", "-o", "link"]).stdout.splitlines()} \
        == {"lo", "eth0"}
    a.cut()
    refused = a.run([sys.executable, "-c", f"import socket; socket.create_connection(('{b.address}', 9000), "
                     "timeout=2)"], check=False)
    assert refused.returncode != 0
    a.restore()


def test_torchrun_across_two_nodes_one_download_per_shard_per_node(netns_cluster, tiny_tree, tmp_path):
    bucket = netns_cluster.bucket()
    a, b = netns_cluster.node("a"), netns_cluster.node("b")
    for node in (a, b):
        node.shape(200)
    local = sharded_store(tiny_tree, tmp_path / "store", 6)
    bucket.make_bucket("train")
    url = "s3://train/tiny/"
    man = _publish(a, bucket, local, url)
    shard_of = _shard_of(man)
    n = man["num_samples"]
    total = sum(s["bytes"] for s in man["shards"])

    received = {node.name: node.link_bytes()[0] for node in (a, b)}
    _torchrun_two_nodes(netns_cluster, bucket, url, total, "full")
    records = _records(a, b)
    assert sorted(records) == [0, 1, 2, 3]
    nodes_of = {node.name for node, _ in records.values()}
    assert nodes_of == {"a", "b"}
    for epoch in range(2):
        parts = [set(rec["epochs"][epoch]) for _, rec in records.values()]
        lengths = {len(rec["epochs"][epoch]) for _, rec in records.values()}
        assert len(lengths) == 1  # equal batch counts on every rank
        assert sum(map(len, parts)) == len(set().union(*parts)) == n  # disjoint and covering
    for node in (a, b):
        shards = [d["shard"] for d in node_downloads(node.root / "cache")]
        assert len(shards) == len(set(shards)), f"node {node.name} downloaded a shard twice: {shards}"
        mine = [rec for nd, rec in records.values() if nd is node]
        read = [{shard_of(i) for rec in mine for i in rec["epochs"][e]} for e in range(2)]
        assert set(shards) == read[0] | read[1]  # every shard its ranks read, once, and nothing else
        assert mine[0]["downloads"] == [len(read[0]), len(read[1] - read[0])]  # the warm part of epoch 1: none
        size = {e["name"]: e["bytes"] for e in man["shards"]}
        assert node.link_bytes()[0] - received[node.name] >= sum(size[s] for s in shards)  # through its own link

    # each node's cache below the store's size, one epoch: still one download per shard per node, never over
    limit = total - min(s["bytes"] for s in man["shards"])
    for node in (a, b):
        shutil.rmtree(node.root / "out")
    _torchrun_two_nodes(netns_cluster, bucket, url, limit, "one", cache="cache-small")
    records = _records(a, b, "one")
    for node in (a, b):
        shards = [d["shard"] for d in node_downloads(node.root / "cache-small")]
        mine = [rec for nd, rec in records.values() if nd is node]
        assert sorted(shards) == sorted({shard_of(i) for rec in mine for i in rec["epochs"][0]})
        assert max(rec["usage_max"] for rec in mine) <= limit


def _read_with_link_change(node, bucket, url, change, *, env=None) -> dict:
    """tests/load/netns_read_check.py on ``node``: ``change()`` runs after its first batch, then it reads on."""
    out = node.root / "out-read"
    out.mkdir()
    proc = node.popen([sys.executable, HERE / "netns_read_check.py", url, node.root / "cache", out],
                      env=dict(bucket.env, **(env or {})), log=node.root / "read.log")
    deadline = time.monotonic() + 120
    while not (out / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.log.read_text()[-3000:]
        time.sleep(0.05)
    change(out / "go")
    assert proc.wait(timeout=180) == 0, proc.log.read_text()[-3000:]
    return json.loads((out / "result.json").read_text())


def _store_in_bucket(netns_cluster, tiny_tree, tmp_path, node, shards=8):
    bucket = netns_cluster.bucket()
    local = sharded_store(tiny_tree, tmp_path / "store", shards)
    bucket.make_bucket("train")
    man = _publish(node, bucket, local, "s3://train/tiny/")
    return bucket, "s3://train/tiny/", man


def test_a_link_cut_for_10_s_mid_epoch_is_ridden_out(netns_cluster, tiny_tree, tmp_path):
    a = netns_cluster.node("a")
    a.shape(100)
    bucket, url, man = _store_in_bucket(netns_cluster, tiny_tree, tmp_path, a)

    def cut_for_10_s(go):
        a.cut()
        go.touch()  # the reader goes on while the cable is out
        time.sleep(10)
        a.restore()

    result = _read_with_link_change(a, bucket, url, cut_for_10_s)
    assert "error" not in result, result
    assert result["seen"] == man["num_samples"]
    assert result["downloads_after"] == len(man["shards"])
    assert result["downloads_after"] > result["downloads_before"]  # shards were fetched across the outage


def test_a_link_cut_past_the_budget_is_a_named_error_and_leaves_nothing_partial(netns_cluster, tiny_tree,
                                                                                tmp_path):
    a = netns_cluster.node("a")
    a.shape(100)
    bucket, url, man = _store_in_bucket(netns_cluster, tiny_tree, tmp_path, a)
    budget = 5

    def cut(go):
        a.cut()
        go.touch()

    result = _read_with_link_change(a, bucket, url, cut, env={"FASTLOAD_REMOTE_RETRY_S": str(budget)})
    error = result["error"]
    assert error["type"] == "RemoteStoreError", error
    assert "s3://train/tiny/" in error["text"] and f"from node {socket.gethostname()}" in error["text"], error
    # within the budget and the stall limit of a request in flight, plus a few seconds; not a hang
    assert error["after_go_s"] < budget + 10 + 10, error
    partial = [p for p in (a.root / "cache").rglob("*") if ".partial" in p.parts and p.is_file()]
    assert not partial, partial


def _ray_cluster_on(head, workers, bucket, *, check_refusal: bool = False) -> dict[str, dict[str, str]]:
    """A Ray head on ``head`` and one worker per node of ``workers``, token authentication on: the token
    made on the head (``ray get-auth-token --generate``) is copied into each node's own home, as a user
    distributes it. Each node gets one CPU and a short temp folder of its own. The environment of each."""
    ray = str(Path(sys.executable).with_name("ray"))
    envs = {}
    for node in (head, *workers):
        (node.root / "home" / ".ray").mkdir(parents=True)
        temp = tempfile.mkdtemp(prefix=f"flray{node.name}")  # Ray's socket paths must stay short
        node.cluster_temp = temp
        # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: the loopback Ray tests' engine sets it to 0 in this process (a
        # local cluster stays on 127.0.0.1); a cluster of nodes needs Ray's default back
        # RAY_TMPDIR: each node's Ray folder its own, as on separate machines (`ray start` records the cluster
        # in /tmp/ray/ray_current_cluster otherwise, which a later plain ray.init() on this machine would join)
        envs[node.name] = dict(bucket.env, HOME=str(node.root / "home"), RAY_AUTH_MODE="token",
                               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_TMPDIR=temp)
    head.run([ray, "get-auth-token", "--generate"], env=envs[head.name])
    token = head.root / "home" / ".ray" / "auth_token"
    head.run([ray, "start", "--head", f"--node-ip-address={head.address}", "--port=6379", "--num-cpus=1",
              "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={head.cluster_temp}"],
             env=envs[head.name], timeout=180)
    for node in workers:
        if check_refusal:  # authentication is on: a node holding another token is turned away
            (node.root / "home" / ".ray" / "auth_token").write_text("0" * 64)
            refused = node.run([ray, "start", f"--address={head.address}:6379", f"--node-ip-address={node.address}",
                                "--num-cpus=1", "--disable-usage-stats"], env=envs[node.name], timeout=180, check=False)
            assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout + refused.stderr, refused
            node.kill()  # whatever that attempt left running
        shutil.copy(token, node.root / "home" / ".ray" / "auth_token")
        node.run([ray, "start", f"--address={head.address}:6379", f"--node-ip-address={node.address}",
                  "--num-cpus=1", "--disable-usage-stats"], env=envs[node.name], timeout=180)
    return envs


def _manifest_shards(node, bucket, url) -> list[tuple[str, int, int, str]]:
    man = json.loads(node.run([sys.executable, "-c", "import sys; from fastload.store import remote; "
                               "print(remote.get_bytes(remote.RemoteLocation.parse(sys.argv[1]).child('manifest.json'))"
                               ".decode())", url], env=bucket.env).stdout)
    return [(s["name"], s["start"], s["count"], s["sha256"]) for s in man["shards"]]


def _two_ray_nodes(cluster, tree, mbit, *, check_refusal=False):
    """The bucket (buckets src and dst, the tree uploaded under s3://src/tree/: no node sees the driver's
    files), nodes a and b on ``mbit`` links, a Ray head on a and a worker on b; their environments."""
    bucket = cluster.bucket()
    a, b = cluster.node("a"), cluster.node("b")
    for node in (a, b):
        node.shape(mbit)
    for name in ("src", "dst"):
        bucket.make_bucket(name)
    a.run([sys.executable, "-c", "import sys, pathlib; from fastload.store import remote\n"
           "root = pathlib.Path(sys.argv[1])\nfor p in sorted(root.rglob('*')):\n"
           "    if p.is_file(): remote.upload_file(p, remote.RemoteLocation.parse('s3://src/tree/' + "
           "p.relative_to(root).as_posix()))", tree], env=bucket.env)
    return bucket, a, b, _ray_cluster_on(a, [b], bucket, check_refusal=check_refusal)


def test_ray_conversion_across_two_nodes_with_token_auth(netns_cluster, tiny_tree):
    bucket, a, b, envs = _two_ray_nodes(netns_cluster, tiny_tree, 200, check_refusal=True)
    fastload = str(Path(sys.executable).with_name("fastload"))
    sent = {node.name: node.link_bytes()[1] for node in (a, b)}
    ray_run = a.run([fastload, "convert", "s3://src/tree/", "s3://dst/ray/", "--engine", "ray",
                     "--address", f"{a.address}:6379", "--num-shards", "8"], env=envs["a"], timeout=600)
    uploaded = {node.name: node.link_bytes()[1] - sent[node.name] for node in (a, b)}
    a.run([fastload, "convert", "s3://src/tree/", "s3://dst/local/", "--num-shards", "8"], env=bucket.env)
    ray_shards = _manifest_shards(a, bucket, "s3://dst/ray/")
    assert ray_shards == _manifest_shards(a, bucket, "s3://dst/local/")  # byte-identical shards (sha256)
    assert "stored 24 of 24" in ray_run.stdout
    # tasks ran on both nodes: each node's link carried shards up to the bucket (the worker node has no
    # other reason to send bulk data; the smallest shard is a lower bound of one task's upload)
    smallest = min(_shard_sizes(a, bucket, "s3://dst/ray/"))
    assert uploaded["b"] >= smallest and uploaded["a"] >= smallest, uploaded


def _shard_sizes(node, bucket, url) -> list[int]:
    return [int(x) for x in node.run([sys.executable, "-c", "import sys, json; from fastload.store import remote; "
                                      "m = json.loads(remote.get_bytes(remote.RemoteLocation.parse(sys.argv[1])"
                                      ".child('manifest.json'))); print(*[s['bytes'] for s in m['shards']])", url],
                                     env=bucket.env).stdout.split()]


def _running_task(node, name: str) -> bool:
    """Whether a Ray worker of ``node`` is executing task ``name`` now (Ray titles it ``ray::NAME``)."""
    for pid in node.pids():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                return True
        except OSError:
            pass
    return False


def test_ray_worker_node_killed_mid_conversion_is_survived(netns_cluster, tiny_tree):
    bucket, a, b, envs = _two_ray_nodes(netns_cluster, tiny_tree, 20)
    # b on a slow link: its shard task (sources down, the shard up) takes long enough to be caught running;
    # on 20 Mbit/s the whole conversion took 6 s and b could finish its tasks between a sign and the kill
    b.shape(1)
    fastload = str(Path(sys.executable).with_name("fastload"))
    driver = a.popen([fastload, "convert", "s3://src/tree/", "s3://dst/ray/", "--engine", "ray",
                      "--address", f"{a.address}:6379", "--num-shards", "8"], env=envs["a"],
                     log=a.root / "convert.log")
    deadline = time.monotonic() + 120
    while not _running_task(b, "_shard_task"):  # a shard task is running on b
        assert driver.poll() is None and time.monotonic() < deadline, (a.root / "convert.log").read_text()[-3000:]
        time.sleep(0.02)
    # and is fetching its sources from the bucket (after counting its attempt: a task killed before that is
    # rerun uncounted). Bytes through b's link are no sign of it: Ray's own connections carry as much
    endpoint = bucket.endpoint.split("//")[1]
    while endpoint not in b.run(["ss", "-Htn", "state", "established"]).stdout:
        assert driver.poll() is None and time.monotonic() < deadline, (a.root / "convert.log").read_text()[-3000:]
    b.kill()  # every process of the node, raylet and its workers included
    assert driver.wait(timeout=300) == 0, (a.root / "convert.log").read_text()[-3000:]
    said = (a.root / "convert.log").read_text()
    assert "stored 24 of 24" in said
    assert re.findall(r"retries (\d+)", said)[-1] != "0", said[-2000:]  # b's task was run again, on a
    a.run([fastload, "convert", "s3://src/tree/", "s3://dst/local/", "--num-shards", "8"], env=bucket.env)
    assert _manifest_shards(a, bucket, "s3://dst/ray/") == _manifest_shards(a, bucket, "s3://dst/local/")


def test_a_node_lost_mid_epoch_is_survived_by_torchrun_elastic_resume(netns_cluster, tmp_path):
    from fastload.datasets import DatasetSpec, make_dataset

    bucket = netns_cluster.bucket()
    a, b = netns_cluster.node("a"), netns_cluster.node("b")
    for node in (a, b):
        node.shape(200)
    tree = make_dataset(tmp_path / "tree", DatasetSpec(num_classes=4, per_class=24, min_side=32, max_side=64,
                                                       png_every=0, seed=3), workers=1)
    local = sharded_store(tree, tmp_path / "store", 8)
    bucket.make_bucket("train")
    url = "s3://train/elastic/"
    man = _publish(a, bucket, local, url)
    n = man["num_samples"]
    shared = netns_cluster.root / "checkpoints"  # what a real cluster shares: the checkpoint folder
    shared.mkdir()
    port = 29400 + (hash(netns_cluster.tag) % 500)
    procs = {}
    for node in (a, b):
        (node.root / "out").mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=2",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={a.address}:{port}",
               f"--local-addr={node.address}", f"--rdzv-conf=is_host={int(node is a)},last_call_timeout=15",
               "--rdzv-id=elastic", HERE / "netns_elastic_check.py", url, node.root / "cache", node.root / "out",
               shared]
        # the workers' own store, not the rendezvous store shared with torchrun's agent: with the shared one,
        # restarted workers read their peers' addresses from before the restart (pytorch/pytorch#135712)
        env = dict(_torchrun_env(bucket), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        procs[node.name] = node.popen(cmd, env=env, log=node.root / "torchrun.log")
    deadline = time.monotonic() + 180
    while True:  # until the job has checkpointed a few batches with both nodes in it
        logs = list((b.root / "out").glob("log-0-*.jsonl"))
        if logs and all(len(p.read_text().splitlines()) >= 3 for p in logs) and (shared / "ckpt.pt").exists():
            break
        assert procs["a"].poll() is None and time.monotonic() < deadline, \
            (a.root / "torchrun.log").read_text()[-4000:]
        time.sleep(0.1)
    b.kill()  # the node is gone: its agent, its ranks, its cache's readers
    assert procs["a"].wait(timeout=300) == 0, (a.root / "torchrun.log").read_text()[-4000:]

    def log(node, attempt, rank):
        path = node.root / "out" / f"log-{attempt}-{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    first = {r: log(a, 0, r) + log(b, 0, r) for r in range(4)}
    assert {rec["world"] for recs in first.values() for rec in recs} == {4}  # both nodes were in it
    resumed = [json.loads((a.root / "out" / f"resumed-1-{r}.json").read_text()) for r in range(2)]
    assert {(x["from_attempt"], x["world"]) for x in resumed} == {(0, 2)}  # elastic: 4 ranks saved, 2 resume
    upto = resumed[0]["from_batch"]
    checkpointed = [i for recs in first.values() for rec in recs if rec["batch"] <= upto for i in rec["ids"]]
    after = [i for r in range(2) for rec in log(a, 1, r) for i in rec["ids"]]
    assert sorted(checkpointed + after) == list(range(n))  # every sample of the epoch exactly once
    assert checkpointed and after
    done = json.loads((a.root / "out" / "done-1-0.json").read_text())
    assert done["steps"] == (upto + 1) + len(log(a, 1, 0))  # the model resumed with the loader: one step a batch


def test_ray_driver_killed_mid_conversion_and_rerun_resumes(netns_cluster, tiny_tree):
    bucket, a, b, envs = _two_ray_nodes(netns_cluster, tiny_tree, 20)  # slow uploads: still converting when it dies
    fastload = str(Path(sys.executable).with_name("fastload"))
    cmd = [fastload, "convert", "s3://src/tree/", "s3://dst/ray/", "--engine", "ray", "--address",
           f"{a.address}:6379", "--num-shards", "8"]
    driver = a.popen(cmd, env=envs["a"], log=a.root / "first.log")
    deadline = time.monotonic() + 120
    while not re.search(r"shards [2-7]/8", (a.root / "first.log").read_text()):
        assert driver.poll() is None and time.monotonic() < deadline, (a.root / "first.log").read_text()[-3000:]
        time.sleep(0.05)
    os.kill(driver.pid, signal.SIGKILL)  # the driver alone: the cluster stays up
    driver.wait()
    rerun = a.run(cmd, env=envs["a"], timeout=600)
    resumed = re.search(r"resumed after (\d+)", rerun.stdout)
    assert resumed and 0 < int(resumed.group(1)) < 24, rerun.stdout
    assert "stored 24 of 24" in rerun.stdout
    a.run([fastload, "convert", "s3://src/tree/", "s3://dst/local/", "--num-shards", "8"], env=bucket.env)
    assert _manifest_shards(a, bucket, "s3://dst/ray/") == _manifest_shards(a, bucket, "s3://dst/local/")
