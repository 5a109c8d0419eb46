"""Router: least-loaded routing over replicas, run-time fallback on injected device failures, re-probing;
request deadlines; the dtype option against fp32."""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import time
import weakref

import pytest
import torch

from fastload.errors import DeadlineExceeded, DeviceFailure
from fastload.load.transforms import EvalTransform
from fastload.serve import DynamicBatcher, FrontOptions, Router, make_server, serve_forever
from fastload.serve.models import SimulatedDevice
from helpers import exits_cleanly, jpeg_bytes, photo
from serving import call


class Flaky(torch.nn.Module):
    """Sleeps a little per batch (so work spreads), counts batches, raises a CUDA-like error while ``broken``."""

    def __init__(self) -> None:
        super().__init__()
        self.broken = False
        self.batches = 0
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        time.sleep(0.02)
        with self.lock:
            self.batches += 1
        return x.float().mean(dim=(1, 2, 3)).unsqueeze(1).repeat(1, 4)


def replica(model, name: str, **kw) -> DynamicBatcher:
    kw.setdefault("max_batch", 2)
    kw.setdefault("max_wait_ms", 1)
    return DynamicBatcher(model, preprocess=EvalTransform(32, 40), device="cpu", name=name, **kw)


def images(n: int) -> list[bytes]:
    return [jpeg_bytes(photo(48, 40, seed=i)) for i in range(n)]


def test_requests_spread_over_two_replicas_least_loaded_first():
    a, b = Flaky(), Flaky()
    router = Router([replica(a, "cpu:0"), replica(b, "cpu:1")]).start()
    try:
        a.batches = b.batches = 0
        futures = [router.submit(d) for d in images(16)]
        outs = [f.result(10) for f in futures]
        s = router.stats()
    finally:
        router.stop()
    assert len(outs) == 16 and all(o.shape == (4,) for o in outs)
    per = [r["completed"] for r in s["replicas"]]
    assert sum(per) == 16 and min(per) >= 4, per  # least-loaded routing used both
    assert a.batches > 0 and b.batches > 0


def test_failing_replica_is_retried_elsewhere_marked_unhealthy_and_reprobed():
    a, b = Flaky(), Flaky()
    router = Router([replica(a, "cpu:0"), replica(b, "cpu:1")], probe_interval_s=0.2).start()
    try:
        a.broken = True
        futures = [router.submit(d) for d in images(12)]
        outs = [f.result(10) for f in futures]
        s = router.stats()
        assert len(outs) == 12  # every request answered although cpu:0 failed
        assert s["unhealthy"] == ["cpu:0"] and s["device_failures"] >= 1 and s["retried"] >= 1
        assert [r.name for r in router.healthy()] == ["cpu:1"]
        a.broken = False
        deadline = time.monotonic() + 5
        while "cpu:0" not in [r.name for r in router.healthy()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [r.name for r in router.healthy()] == ["cpu:0", "cpu:1"]  # passed its re-probe
    finally:
        router.stop()


def test_cpu_fallback_takes_the_retry_and_new_work_and_without_one_requests_fail_with_device_failure():
    a, fb = Flaky(), Flaky()
    router = Router([replica(a, "cuda-like")], fallback=replica(fb, "cpu-fallback"), probe_interval_s=10).start()
    try:
        a.broken = True
        fb.batches = 0
        out = router.submit(images(1)[0]).result(10)
        assert out.shape == (4,) and fb.batches == 1  # the retried batch ran on the fallback
        assert router.healthy() == [] and not router.ready.is_set()
        assert router.submit(images(1)[0]).result(10).shape == (4,) and fb.batches == 2  # new work goes there too
    finally:
        router.stop()
    lone = Router([replica(Flaky(), "only")], probe_interval_s=10).start()
    try:
        lone.replicas[0].model.broken = True
        with pytest.raises(DeviceFailure, match="no other healthy replica"):
            lone.submit(images(1)[0]).result(10)
        with pytest.raises(DeviceFailure, match="no healthy replica"):
            lone.submit(images(1)[0])
    finally:
        lone.stop()


@pytest.mark.slow  # the script runs three times (exits_cleanly): 10-18 s, in CI's slow suite
def test_a_script_that_ends_while_a_replica_is_re_probed_exits_cleanly(tmp_path):
    # the re-probe thread, a daemon inside the model when the script ended, was ended by pthread_exit while
    # CPython finalised and unwound through C++ frames: exit status 134 in 4 of 4 runs
    script = tmp_path / "leave.py"
    script.write_text(
        "import time, torch\n"
        "from fastload.serve import DynamicBatcher, Router\n"
        "from fastload.load.transforms import EvalTransform\n"
        "class Flaky(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv, self.calls = torch.nn.Conv2d(3, 64, 7, 1, 3), 0\n"
        "    def forward(self, x):\n"
        "        self.calls += 1\n"
        "        if self.calls == 1:\n"
        "            raise RuntimeError('device lost')  # the warm-up fails: the replica is re-probed\n"
        "        t0 = time.monotonic()\n"
        "        while time.monotonic() - t0 < 3:  # short torch calls for 3 s: one returns while the interpreter\n"
        "            self.conv(x[:1, :, :32, :32])  # finalises (the script ends 0.5 s into the re-probe)\n"
        "        return x.float().mean(dim=(1, 2, 3))\n"
        "b = DynamicBatcher(Flaky(), preprocess=EvalTransform(224, 256), max_batch=8, device='cpu', name='flaky')\n"
        "Router([b], probe_interval_s=0.01).start()\n"
        "time.sleep(0.5)\n"
        "print('left with a re-probe in the model', flush=True)\n")
    exits_cleanly(script, "left with a re-probe in the model")


def test_a_stopped_router_is_not_kept_alive_and_a_replica_warming_up_during_stop_ends_stopped():
    gate = threading.Event()

    class Slow(Flaky):
        def forward(self, x):
            gate.wait(10)
            return super().forward(x)

    b = replica(Slow(), "slow")
    r = Router([b]).start(wait=False)
    time.sleep(0.1)  # the warm-up waits in the model
    stopper = threading.Thread(target=r.stop, kwargs={"drain": False, "timeout": 10})
    stopper.start()
    time.sleep(0.1)
    gate.set()
    stopper.join(15)
    assert not stopper.is_alive()
    assert not b.ready.is_set() and b._thread is None  # stop() waited for the warm-up, then stopped it
    ref = weakref.ref(r)
    del r, stopper
    gc.collect()
    assert ref() is None  # stop() unregistered its exit handler


def test_a_stopped_router_starts_again_and_serves():
    r = Router([replica(Flaky(), "a")]).start()
    assert r.submit(images(1)[0]).result(10).shape == (4,)
    r.stop()
    r.start()
    try:
        assert r.healthy() and r.submit(images(1)[0]).result(10).shape == (4,)
    finally:
        r.stop()


def test_killed_replica_over_http_keeps_the_service_answering():
    a, b = Flaky(), Flaky()
    router = Router([replica(a, "cpu:0"), replica(b, "cpu:1")], probe_interval_s=30).start()
    srv = make_server(router, port=0)
    thread = serve_forever(srv)
    try:
        port = srv.server_address[1]
        a.broken = True
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda d: call(port, "POST", "/predict", d)[0], images(10)))
        health = call(port, "GET", "/healthz")
    finally:
        srv.shutdown()
        thread.join()
        srv.close_all(2)
        router.stop()
    assert codes == [200] * 10
    assert health[0] == 200 and health[1]["ready"] is True


def test_request_past_its_deadline_gets_504_and_its_queue_slot_is_freed():
    gate = threading.Event()

    class Held(torch.nn.Module):
        def forward(self, x):
            gate.wait(10)
            return x.float().mean(dim=(1, 2, 3)).unsqueeze(1)

    batcher = replica(Held(), "cpu", max_batch=1, max_wait_ms=0, max_queue=4)
    gate.set()
    router = Router([batcher]).start()
    gate.clear()
    srv = make_server(router, port=0, options=FrontOptions(request_timeout_s=0.5))
    thread = serve_forever(srv)
    try:
        port = srv.server_address[1]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            t0 = time.monotonic()
            answers = list(pool.map(lambda d: call(port, "POST", "/predict", d), images(3)))
            took = time.monotonic() - t0
        stats = batcher.stats()
        gate.set()
    finally:
        gate.set()
        srv.shutdown()
        thread.join()
        srv.close_all(2)
        router.stop()
    assert [a[0] for a in answers] == [504] * 3 and took < 3
    assert "deadline" in answers[0][1]["error"]
    assert stats["waiting"] == 0 and stats["expired"] == 2  # the two queued left the queue; one was in the model


def test_submit_timeout_drops_a_queued_request_with_deadline_exceeded():
    gate = threading.Event()

    class Held(torch.nn.Module):
        def forward(self, x):
            gate.wait(10)
            return x.float().mean(dim=(1, 2, 3)).unsqueeze(1)

    gate.set()
    b = replica(Held(), "cpu", max_batch=1, max_wait_ms=0).start()
    gate.clear()
    try:
        first = b.submit(images(1)[0])
        time.sleep(0.2)  # in the model, held
        late = b.submit(images(1)[0], timeout=0.2)
        time.sleep(0.4)
        gate.set()
        first.result(10)
        with pytest.raises(DeadlineExceeded, match="past its deadline"):
            late.result(5)
        assert b.stats()["expired"] == 1 and b.stats()["waiting"] == 0
    finally:
        gate.set()
        b.stop()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5))

    def forward(self, x):
        return self.net(x)


@pytest.mark.parametrize("dtype, tol", [("bf16", 0.05), ("fp16", 0.01)])
def test_half_precision_outputs_match_fp32_on_a_fixed_input(dtype, tol):
    data = images(4)
    outs = {}
    for name in ("fp32", dtype):
        with replica(Tiny(), "cpu", dtype=name, max_batch=4, max_wait_ms=50) as b:
            outs[name] = torch.stack([f.result(30) for f in [b.submit(d) for d in data]])
            assert b.stats()["dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[name]
    ref, got = outs["fp32"], outs[dtype]
    assert got.dtype == torch.float32  # answers come back as float32 whatever the model ran in
    assert not torch.equal(got, ref)  # it really ran in lower precision
    assert (got - ref).abs().max() <= tol * ref.abs().max() + 1e-3


def test_simulated_device_sleeps_fixed_plus_per_item():
    m = SimulatedDevice(20.0, 5.0, num_classes=3)
    t0 = time.perf_counter()
    out = m(torch.ones(4, 3, 8, 8))
    took = (time.perf_counter() - t0) * 1e3
    assert out.shape == (4, 3) and torch.equal(out[0], torch.tensor([0.0, 1.0, 2.0]))
    assert 40.0 <= took < 2000.0  # 20 + 5 * 4 ms of sleep (bounded above loosely: a busy machine)


gpu = pytest.mark.gpu


@gpu
def test_cuda_replica_in_bf16_matches_cpu_fp32_on_a_fixed_input():
    data = images(4)
    outs = {}
    for device, dtype in (("cpu", "fp32"), ("cuda", "bf16")):
        b = DynamicBatcher(Tiny(), preprocess=EvalTransform(32, 40), device=device, dtype=dtype, max_batch=4,
                           max_wait_ms=50)
        with b:
            outs[device] = torch.stack([f.result(30) for f in [b.submit(d) for d in data]])
    assert outs["cuda"].device.type == "cpu" and outs["cuda"].dtype == torch.float32
    assert (outs["cuda"] - outs["cpu"]).abs().max() <= 0.05 * outs["cpu"].abs().max() + 1e-3


@gpu
def test_cuda_out_of_memory_on_a_batch_is_retried_on_the_cpu_fallback():
    class OomOnCuda(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fail = False
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            if self.fail and x.is_cuda:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
            return x.float().mean(dim=(1, 2, 3)).unsqueeze(1) * self.w

    model = OomOnCuda()
    gpu_replica = DynamicBatcher(model, preprocess=EvalTransform(32, 40), device="cuda", name="cuda:0",
                                 max_batch=2, max_wait_ms=1)
    fallback = DynamicBatcher(OomOnCuda(), preprocess=EvalTransform(32, 40), device="cpu", name="cpu-fallback",
                              max_batch=2, max_wait_ms=1)
    router = Router([gpu_replica], fallback=fallback, probe_interval_s=30).start()
    try:
        model.fail = True
        outs = [f.result(30) for f in [router.submit(d) for d in images(3)]]
        s = router.stats()
    finally:
        router.stop()
    assert len(outs) == 3 and s["unhealthy"] == ["cuda:0"] and s["retried"] >= 1
    assert s["fallback"]["completed"] == 3
