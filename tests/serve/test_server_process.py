"""A real ``fastload serve`` process: SIGTERM drains reliably, /metrics parses, replicas, memory after big images."""

from __future__ import annotations

import collections
import concurrent.futures
import io
import socket
import threading
import time

import pytest
from PIL import Image

from helpers import jpeg_bytes, photo
from serving import ServeProcess, call, loopback_load, rss_bytes, status_of

pytestmark = pytest.mark.slow


def _post(port: int) -> int:
    try:
        return call(port, "POST", "/predict", jpeg_bytes(photo(64, 48)), timeout=30)[0]
    except ConnectionResetError:
        return -2  # a reset: exactly what must not happen
    except (ConnectionRefusedError, OSError):
        return -1  # refused: the listening socket is closed (not accepted, so no reset of an accepted request)


@pytest.mark.parametrize("front, trial", [("stdlib", 0), ("stdlib", 1), ("stdlib", 2), ("asgi", 0), ("asgi", 1)])
def test_sigterm_drains_accepted_requests_and_new_ones_get_503_not_resets(front, trial):
    if front == "asgi":
        pytest.importorskip("uvicorn", reason="the asgi front needs the serve extra")
    proc = ServeProcess("--model", "simulated", "--batch-ms", "400", "--devices", "cpu", "--max-batch", "4",
                        "--max-wait-ms", "0", "--size", "32", "--resize", "40", "--front", front)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            accepted = [pool.submit(_post, proc.port) for _ in range(6)]
            deadline = time.monotonic() + 10
            while call(proc.port, "GET", "/stats")[1]["in_flight"] < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            t0 = time.monotonic()
            proc.proc.send_signal(15)
            time.sleep(0.05)
            late = [pool.submit(_post, proc.port) for _ in range(6)]
            codes = [f.result(30) for f in accepted]
            late_codes = [f.result(30) for f in late]
        rc = proc.proc.wait(30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert codes == [200] * 6, proc.output()
    # sent while accepted requests drain: the accept loop still runs and answers each 503 (never a reset)
    assert late_codes == [503] * 6, late_codes
    assert rc == 0 and took < 20, (rc, took, proc.output())
    out = proc.output()
    assert "stopping: finishing accepted requests" in out and "Traceback" not in out
    assert "terminate called" not in out


def test_metrics_parse_as_prometheus_text_and_count_what_happened():
    from prometheus_client.parser import text_string_to_metric_families

    proc = ServeProcess("--model", "simulated", "--batch-ms", "2+0.1*n", "--devices", "cpu", "--replicas", "2",
                        "--size", "32", "--resize", "40")
    try:
        for _ in range(5):
            assert _post(proc.port) == 200
        assert call(proc.port, "POST", "/predict", b"not an image")[0] == 400
        conn = socket.create_connection(("127.0.0.1", proc.port))
        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        text = b""
        while more := conn.recv(65536):
            text += more
        conn.close()
    finally:
        assert proc.terminate() == 0
        proc.kill()
    head, _, body = text.partition(b"\r\n\r\n")
    assert status_of(head) == 200 and b"text/plain; version=0.0.4" in head
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    responses = {s.labels["status"]: s.value for s in families["fastload_http_responses"].samples}
    assert responses["200"] >= 5 and responses["400"] == 1
    stages = {s.labels["stage"] for s in families["fastload_stage_seconds"].samples if "stage" in s.labels}
    assert stages == {"queued", "preprocess", "batch_assembly", "compute", "total"}
    totals = [s for s in families["fastload_stage_seconds"].samples
              if s.name.endswith("_count") and s.labels["stage"] == "total"]
    assert sum(s.value for s in totals) == 5  # 5 answered requests over the two replicas
    assert {s.labels["replica"] for s in families["fastload_queue_depth"].samples} == {"cpu:0", "cpu:1"}
    decodes = {(s.labels["replica"], s.labels["where"]): s.value for s in families["fastload_decodes"].samples}
    assert sum(v for (r, w), v in decodes.items() if w == "cpu") >= 5
    assert "fastload_device_busy_fraction" in families and "fastload_batch_size" in families


def _big_png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def test_memory_is_returned_after_big_requests():
    proc = ServeProcess("--model", "simulated", "--batch-ms", "1", "--devices", "cpu", "--workers", "2",
                        "--size", "32", "--resize", "40")
    try:
        assert _post(proc.port) == 200
        baseline = rss_bytes(proc.pid)
        big = _big_png(6000)  # 36 MP: inside the 40 MP budget; Pillow decodes all of it (108 MB RGB)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            codes = list(pool.map(lambda _: call(proc.port, "POST", "/predict", big, "image/png", 60)[0], range(4)))
        time.sleep(0.5)
        after = rss_bytes(proc.pid)
    finally:
        assert proc.terminate() == 0
        proc.kill()
    assert codes == [200] * 4
    assert after - baseline < 120 << 20, (baseline >> 20, after >> 20)


@pytest.mark.gpu
def test_fastload_serve_on_cuda_decodes_big_batches_on_the_gpu():
    proc = ServeProcess("--model", "simulated", "--batch-ms", "20", "--devices", "cuda", "--max-batch", "8",
                        "--max-wait-ms", "50", "--gpu-decode-min-batch", "2", "--size", "64", "--resize", "72")
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: _post(proc.port), range(16)))
        stats = call(proc.port, "GET", "/stats")[1]
    finally:
        assert proc.terminate() == 0
        proc.kill()
    assert codes == [200] * 16
    assert stats["gpu_decoded"] >= 2 and stats["gpu_decode_fallbacks"] == 0, stats
    assert stats["replicas"][0]["device"].startswith("cuda") and stats["fallback"]["device"] == "cpu"


@pytest.mark.parametrize("front", ["stdlib", "asgi"])
def test_sigterm_under_load_answers_every_request_200_or_503_and_resets_none(front):
    """Issue #21: under load, SIGTERM drained cleanly but 160-182 requests per run saw a connection reset.

    Keep-alive clients and connect-per-request clients POST until the listener closes; SIGTERM
    arrives mid-load. Every request sent must get 200 or 503 (a refused connection, once the
    listener is closed, is fine: nothing was accepted), and the drain must end once the
    requests taken before it are answered (the asgi front's waited for the 503s too, so it
    always ran to --drain-timeout under load).
    """
    if front == "asgi":
        pytest.importorskip("uvicorn", reason="the asgi front needs the serve extra")
    proc = ServeProcess("--model", "simulated", "--batch-ms", "3+0.2*n", "--devices", "cpu", "--max-batch", "8",
                        "--max-wait-ms", "1", "--size", "32", "--resize", "40", "--front", front,
                        "--drain-timeout", "20")
    stop = threading.Event()
    try:
        out, threads = loopback_load(proc.port, jpeg_bytes(photo(48, 40)), keep_alive=6, fresh=4, stop=stop)
        deadline = time.monotonic() + 20
        while len(out.statuses) < 100 and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        proc.proc.send_signal(15)
        rc = proc.proc.wait(30)
        took = time.monotonic() - t0
        time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(35)
    finally:
        stop.set()
        proc.kill()
    answered = collections.Counter(out.statuses)
    assert rc == 0, proc.output()
    assert not out.failures, (collections.Counter(f.split(":")[0] for f in out.failures), answered)
    assert set(answered) <= {200, 503} and answered[200] >= 100, answered
    assert answered[503] >= 1, answered  # the load went on into the drain
    # the drain waits for the requests taken before it, not for the 503s that keep coming: inside the 20 s
    # that waiting on them takes (3-5 s measured; 15 s leaves room for a loaded machine)
    assert took < 15, (took, proc.output())
