"""The HTTP front on 127.0.0.1 with an ephemeral port: answers, errors, overload, health."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

from fastload.load.transforms import EvalTransform
from fastload.serve import DynamicBatcher, make_server, serve_forever
from helpers import bomb_png, jpeg_bomb, jpeg_bytes, photo


class Logits:
    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, x):
        self.gate.wait(10)
        return torch.stack([torch.arange(10, dtype=torch.float32) * (1 + x[i].mean().abs()) for i in range(len(x))])


@pytest.fixture
def server():
    model = Logits()
    batcher = DynamicBatcher(model, preprocess=EvalTransform(32, 40), max_batch=4, max_wait_ms=5, max_queue=3,
                             device="cpu")
    srv = make_server(batcher, port=0, k=3, classes=[f"c{i}" for i in range(10)])
    thread = serve_forever(srv)
    yield srv, batcher, model
    srv.shutdown()
    thread.join()
    srv.server_close()
    batcher.stop(drain=False)


def call(srv, method, path, body=b"", ctype="image/jpeg"):
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=30)
    headers = {"Content-Type": ctype} if ctype else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    out = (resp.status, data, dict(resp.getheaders()))
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
