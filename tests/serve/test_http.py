"""Both HTTP fronts on 127.0.0.1 with an ephemeral port: answers, errors, overload, deadline, health, draining.

Every test runs against the standard library front (``http.py``) and the ASGI one
(``asgi.py``, skipped without the ``serve`` extra): one contract, one set of assertions.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import torch

from fastload.load.transforms import EvalTransform
from fastload.serve import DynamicBatcher, FrontOptions
from helpers import bomb_png, jpeg_bomb, jpeg_bytes, photo


class Logits:
    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, x):
        self.gate.wait(10)
        return torch.stack([torch.arange(10, dtype=torch.float32) * (1 + x[i].mean().abs()) for i in range(len(x))])


def start(batcher, server: str, **limits):
    if server == "asgi":
        pytest.importorskip("uvicorn", reason="the asgi front needs the serve extra")
        from fastload.serve.asgi import make_server, serve_forever
    else:
        from fastload.serve.http import make_server, serve_forever
    srv = make_server(batcher, port=0, k=3, classes=[f"c{i}" for i in range(10)],
                      options=FrontOptions(server=server, **limits))
    return srv, serve_forever(srv)


def stop(srv, thread, batcher) -> None:
    srv.shutdown()
    thread.join()
    srv.close_all(2)
    batcher.stop(drain=False)


@pytest.fixture(params=["stdlib", "asgi"])
def server(request):
    model = Logits()
    batcher = DynamicBatcher(model, preprocess=EvalTransform(32, 40), max_batch=4, max_wait_ms=5, max_queue=3,
                             device="cpu")
    srv, thread = start(batcher, request.param)
    yield srv, batcher, model
    stop(srv, thread, batcher)


def call(srv, method, path, body=b"", ctype="image/jpeg"):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    headers = {"Content-Type": ctype} if ctype else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    out = (resp.status, data, {k.title(): v for k, v in resp.getheaders()})  # starlette sends lowercase names
    conn.close()
    return out


def test_health_only_after_warm_up_then_predict(server):
    srv, batcher, _ = server
    assert call(srv, "GET", "/healthz")[0] == 503
    batcher.start()
    status, body, _ = call(srv, "GET", "/healthz")
    assert status == 200 and body["ready"] is True
    status, body, _ = call(srv, "POST", "/predict", jpeg_bytes(photo(60, 50)))
    assert status == 200
    assert [t["class"] for t in body["top_k"]] == ["c9", "c8", "c7"]
    scores = [t["score"] for t in body["top_k"]]
    assert scores == sorted(scores, reverse=True) and 0 < scores[-1] and scores[0] <= 1
    stats = call(srv, "GET", "/stats")[1]
    assert stats["completed"] == 1
    assert "traceEvents" in call(srv, "GET", "/trace")[1]


@pytest.mark.parametrize("body, ctype, message", [
    (b"", "image/jpeg", "empty body"),
    (b"hello world, not a picture", "image/jpeg", "not an image"),
    (jpeg_bytes(photo(64, 64))[:200], "image/jpeg", "cannot decode"),
    (bomb_png(20000), "image/png", "decompression bomb"),
    (jpeg_bomb(20000), "image/jpeg", "decompression bomb"),
    (jpeg_bytes(photo(64, 64)), "text/plain", "wrong content type"),
])
def test_bad_input_is_400_and_serving_continues(server, body, ctype, message):
    srv, batcher, _ = server
    batcher.start()
    status, out, _ = call(srv, "POST", "/predict", body, ctype)
    assert status == 400 and message in out["error"]
    assert call(srv, "POST", "/predict", jpeg_bytes(photo(40, 40)))[0] == 200


def test_overload_is_503_with_retry_after(server):
    srv, batcher, model = server
    batcher.start()
    model.gate.clear()
    results = []

    def post():
        results.append(call(srv, "POST", "/predict", jpeg_bytes(photo(40, 40))))

    threads = [threading.Thread(target=post) for _ in range(12)]
    for t in threads:
        t.start()
    for _ in range(200):
        if any(r[0] == 503 for r in results):
            break
        threading.Event().wait(0.02)
    model.gate.set()
    for t in threads:
        t.join(30)
    codes = sorted(r[0] for r in results)
    assert 503 in codes and 200 in codes
    rejected = next(r for r in results if r[0] == 503)
    assert rejected[2].get("Retry-After") == "1"


def test_unknown_route(server):
    srv, batcher, _ = server
    assert call(srv, "GET", "/nope")[0] == 404


def test_metrics_for_a_single_batcher_parse_and_count_requests(server):
    from prometheus_client.parser import text_string_to_metric_families

    srv, batcher, _ = server
    batcher.start()
    for _ in range(3):
        assert call(srv, "POST", "/predict", jpeg_bytes(photo(40, 40)))[0] == 200
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    total = [s for s in families["fastload_stage_seconds"].samples
             if s.name == "fastload_stage_seconds_count" and s.labels["stage"] == "total"]
    assert [s.value for s in total] == [3.0]
    sizes = [s for s in families["fastload_batch_size"].samples if s.name == "fastload_batch_size_count"]
    assert sizes[0].value >= 1  # at least one batch (the three may have shared batches)
    assert {s.labels["status"]: s.value for s in families["fastload_http_responses"].samples}["200"] == 3


@pytest.mark.parametrize("front", ["stdlib", "asgi"])
def test_past_the_request_deadline_is_504_and_the_request_leaves_the_queue(front):
    model = Logits()
    batcher = DynamicBatcher(model, preprocess=EvalTransform(32, 40), max_batch=1, max_wait_ms=0, max_queue=4,
                             device="cpu").start()
    srv, thread = start(batcher, front, request_timeout_s=0.5)
    try:
        model.gate.clear()  # the model holds the first request; the second waits in the queue past its deadline
        held = threading.Thread(target=call, args=(srv, "POST", "/predict", jpeg_bytes(photo(40, 40))))
        held.start()
        for _ in range(1000):  # the first request is in the model before the second is sent
            s = batcher.stats()
            if s["in_flight"] == 1 and s["waiting"] == 0:
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError(f"the first request never reached the model: {batcher.stats()}")
        status, out, _ = call(srv, "POST", "/predict", jpeg_bytes(photo(40, 40)))
        waiting = batcher.stats()["waiting"]
        model.gate.set()
        held.join(10)
    finally:
        stop(srv, thread, batcher)
    assert status == 504 and "deadline" in out["error"]
    assert waiting == 0  # its place in the queue was freed at once


def test_draining_answers_503_to_new_predictions_and_healthz_says_so(server):
    srv, batcher, _ = server
    batcher.start()
    srv.begin_drain()
    status, out, headers = call(srv, "POST", "/predict", jpeg_bytes(photo(40, 40)))
    assert status == 503 and "shutting down" in out["error"] and headers["Retry-After"] == "1"
    assert call(srv, "GET", "/healthz")[0] == 503  # stdlib refuses the new connection; asgi answers draining


def test_asgi_front_without_the_extra_says_which_pip_command_fixes_it(monkeypatch):
    import builtins

    from fastload.errors import MissingDependencyError
    from fastload.serve import asgi

    real = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name.split(".")[0] in ("uvicorn", "starlette"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[serve\]'"):
        asgi.make_server(object(), port=0)


def test_a_drain_answers_a_request_on_an_idle_keep_alive_connection_instead_of_resetting_it(server):
    """Issue #21 (resets under SIGTERM, on used connections): a drain closed idle keep-alive connections at
    once, so a request the client was sending on one met a closed socket and was reset."""
    srv, batcher, _ = server
    batcher.start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=10)
    try:
        conn.request("GET", "/healthz")
        first = conn.getresponse()
        first.read()
        srv.begin_drain()
        time.sleep(0.3)  # the connection is idle while the drain starts
        conn.request("POST", "/predict", body=jpeg_bytes(photo(40, 40)), headers={"Content-Type": "image/jpeg"})
        second = conn.getresponse()
        second.read()
    finally:
        conn.close()
    assert first.status == 200
    assert second.status == 503 and second.getheader("Connection", "").lower() == "close"


def test_after_the_backlog_is_answered_the_listener_is_closed_at_once(server):
    """Issue #21 (resets under SIGTERM, on new connections): the listener stayed open after its backlog was
    answered, until the batchers had stopped; every connection made in between was reset when it closed."""
    srv, batcher, _ = server
    port = srv.server_address[1]
    srv.begin_drain()
    srv.shutdown()
    waiting = socket.create_connection(("127.0.0.1", port), timeout=5)  # in the backlog: answered 503
    waiting.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.1)
    try:
        assert srv.refuse_backlog() == 1
        assert waiting.recv(65536).startswith(b"HTTP/1.1 503")
        with pytest.raises(ConnectionRefusedError):  # not accepted into a backlog that a later close resets
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        waiting.close()
