"""fastload.serve.DynamicBatcher: the batching policy, backpressure, errors, identical preprocessing."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

from fastload.errors import CorruptSampleError, Overloaded
from fastload.load.transforms import EvalTransform, eval_transform, normalize
from fastload.serve import BatchPolicy, DynamicBatcher
from helpers import EXIT_TIMER, exit_handler_seconds, exits_cleanly, jpeg_bomb, jpeg_bytes, photo, png_bytes

gpu = pytest.mark.gpu


class FakeModel:
    """Records batch sizes; returns each image's mean as a 1-element row; can be held or made to fail."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.inputs: list[torch.Tensor] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.wait(10)
        self.sizes.append(len(x))
        self.inputs.append(x.clone())
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("model exploded")
        return x.mean(dim=(1, 2, 3), keepdim=False).unsqueeze(1)


def images(n: int, size: int = 48) -> list[bytes]:
    return [jpeg_bytes(photo(size + 8, size + 4, seed=i)) for i in range(n)]


def make(model, **kw) -> DynamicBatcher:
    kw.setdefault("preprocess", EvalTransform(32, 40))
    kw.setdefault("device", "cpu")
    return DynamicBatcher(model, **kw).start()


def test_policy_full_batch_goes_now_partial_after_the_window():
    p = BatchPolicy(max_batch=4, max_wait_s=0.010)
    assert p.decide(100.0, []) == (0, float("inf"))
    assert p.decide(100.0, [100.0] * 4) == (4, 0.0)
    assert p.decide(100.0, [100.0] * 9) == (4, 0.0)  # never more than max_batch
    n, wait = p.decide(100.004, [100.0, 100.003])
    assert n == 0 and wait == pytest.approx(0.006)
    assert p.decide(100.010, [100.0, 100.003]) == (2, 0.0)
    assert BatchPolicy(4, 0.0).decide(5.0, [5.0]) == (1, 0.0)  # no window: send what is there


def test_warm_up_runs_one_full_batch_before_ready():
    model = FakeModel()
    b = DynamicBatcher(model, preprocess=EvalTransform(32, 40), max_batch=6, device="cpu")
    assert not b.ready.is_set()
    with pytest.raises(RuntimeError, match="not accepting"):
        b.submit(images(1)[0])
    b.start()
    assert b.ready.is_set() and model.sizes == [6]
    b.stop()


def test_partial_batch_waits_for_the_window_then_goes():
    model = FakeModel()
    with make(model, max_batch=8, max_wait_ms=150) as b:
        t0 = time.perf_counter()
        futures = [b.submit(d) for d in images(3)]
        outs = [f.result(5) for f in futures]
        elapsed = time.perf_counter() - t0
    assert model.sizes[1:] == [3]  # after the warm-up batch: one batch of all three
    assert 0.14 <= elapsed < 2.0
    assert all(o.shape == (1,) for o in outs)


def test_full_batches_go_immediately_and_never_exceed_max_batch():
    model = FakeModel()
    with make(model, max_batch=4, max_wait_ms=5_000, max_queue=64) as b:
        model.gate.clear()  # hold the model so requests pile up
        futures = [b.submit(d) for d in images(10)]
        time.sleep(0.3)  # let preprocessing finish
        model.gate.set()
        time.sleep(1.0)
        # the three full batches went at once; the last two wait out the 5 s window
        assert sum(f.done() for f in futures) == 8
        for f in futures:
            f.result(10)
    assert model.sizes[1:] == [4, 4, 2]


def test_serve_tensors_equal_training_eval_tensors():
    model = FakeModel()
    data = images(3, size=300) + [png_bytes(photo(280, 260, seed=9))]
    with make(model, preprocess=eval_transform(224, 256), max_batch=4, max_wait_ms=200) as b:
        for f in [b.submit(d) for d in data]:
            f.result(10)
    served = model.inputs[-1]  # one batch of all four, in the order preprocessing finished
    trained = normalize(torch.stack([eval_transform(224, 256).from_bytes(d) for d in data]))
    assert len(served) == 4
    for t in trained:
        assert any(torch.equal(t, s) for s in served)


def test_overload_refuses_immediately_and_accepted_requests_complete():
    model = FakeModel()
    with make(model, max_batch=2, max_wait_ms=1, max_queue=4) as b:
        model.gate.clear()
        accepted = [b.submit(d) for d in images(4)]
        t0 = time.perf_counter()
        with pytest.raises(Overloaded, match="max_queue=4"):
            for d in images(8):
                accepted.append(b.submit(d))
        assert time.perf_counter() - t0 < 0.5
        model.gate.set()
        for f in accepted:
            assert f.result(10).shape == (1,)
        assert b.stats()["rejected"] >= 1


def test_model_error_fails_that_batch_and_serving_continues():
    model = FakeModel()
    with make(model, max_batch=2, max_wait_ms=50) as b:
        model.fail_next = True
        bad = [b.submit(d) for d in images(2)]
        for f in bad:
            with pytest.raises(RuntimeError, match="model exploded"):
                f.result(5)
        good = [b.submit(d) for d in images(2)]
        assert all(f.result(5).shape == (1,) for f in good)
        s = b.stats()
    assert s["failed"] == 2 and s["completed"] == 2


@pytest.mark.parametrize("payload, reason", [
    (b"not an image", "not an image"),
    (jpeg_bytes(photo(64, 64))[:300], "decode"),
    (jpeg_bomb(), "decompression bomb"),
])
def test_undecodable_request_fails_alone(payload, reason):
    model = FakeModel()
    with make(model, max_batch=4, max_wait_ms=50) as b:
        bad = b.submit(payload)
        good = b.submit(images(1)[0])
        with pytest.raises(CorruptSampleError, match=reason):
            bad.result(5)
        assert good.result(5).shape == (1,)


def test_stop_without_drain_cancels_waiting_requests():
    model = FakeModel()
    b = make(model, max_batch=8, max_wait_ms=10_000)
    futures = [b.submit(d) for d in images(3)]
    time.sleep(0.2)
    b.stop(drain=False)
    assert all(f.cancelled() for f in futures)


@pytest.mark.slow  # the script runs three times (exits_cleanly): 10-18 s, in CI's slow suite
def test_a_script_that_ends_without_stop_exits_cleanly(tmp_path):
    # CPython ends daemon threads with pthread_exit while it finalises: the batcher's thread, caught inside
    # the model, unwound through C++ frames and aborted the process (exit status 134) in 6 of 6 runs
    script = tmp_path / "leave.py"
    script.write_text(
        "import io, torch\n"
        "from PIL import Image\n"
        "from fastload.serve import DynamicBatcher\n"
        "buf = io.BytesIO(); Image.new('RGB', (640, 480), (120, 30, 200)).save(buf, 'JPEG')\n"
        "model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, 2, 3), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3),\n"
        "                            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())\n"
        "b = DynamicBatcher(model, max_batch=16, max_wait_ms=1, device='cpu').start()\n"
        "futures = [b.submit(buf.getvalue()) for _ in range(200)]\n"
        "futures[0].result()\n"
        "print('left with work queued', flush=True)\n")
    exits_cleanly(script, "left with work queued")


def test_batchers_stuck_in_their_models_at_exit_share_one_exit_budget(tmp_path):
    # each batcher's exit handler waited EXIT_JOIN_S for its model thread: three batchers, three times as long
    script = tmp_path / "stuck.py"
    script.write_text(
        EXIT_TIMER +  # its exit handler runs last, after fastload's
        "import io, threading, torch\n"
        "from PIL import Image\n"
        "import fastload.exiting, fastload.serve.batcher\n"
        "from fastload.serve import DynamicBatcher\n"
        "fastload.serve.batcher.EXIT_JOIN_S = 1.5  # per batcher\n"
        "fastload.exiting.EXIT_BUDGET_S = 1.0  # all of them\n"
        "gate = threading.Event()\n"
        "class Stuck(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.calls = 0\n"
        "    def forward(self, x):\n"
        "        self.calls += 1\n"
        "        if self.calls > 1: gate.wait()  # after the warm-up: never returns\n"
        "        return x.float().mean(dim=(1, 2, 3))\n"
        "buf = io.BytesIO(); Image.new('RGB', (64, 48), (120, 30, 200)).save(buf, 'JPEG')\n"
        "bs = [DynamicBatcher(Stuck(), max_batch=1, max_wait_ms=0, device='cpu', name=f'b{k}').start() for k in range(3)]\n"
        "fs = [b.submit(buf.getvalue()) for b in bs]\n"
        "time.sleep(1.0)  # every batcher's model thread is inside its model\n"
        "print('leaving', time.time(), flush=True)\n")
    out, waited = exit_handler_seconds(script)
    # one budget of 1 s for the three, not 3 x 1.5 s
    assert 0.8 < waited < 3.0, f"the exit handlers took {waited:.1f} s: {out}"


def test_a_stopped_batcher_is_not_kept_alive_by_its_exit_handler():
    b = make(FakeModel())
    b.stop()
    ref = weakref.ref(b)
    del b
    gc.collect()
    assert ref() is None


def test_a_stopped_batcher_starts_again_and_serves():
    # the preprocessing executor was shut down by stop() and never made anew: submit() after a second
    # start() raised "cannot schedule new futures after shutdown"
    b = make(FakeModel(), max_batch=4, max_wait_ms=1)
    assert b.submit(images(1)[0]).result(10).shape == (1,)
    b.stop()
    b.start()
    try:
        assert [f.result(10).shape for f in [b.submit(d) for d in images(3)]] == [(1,)] * 3
    finally:
        b.stop()


def test_stop_from_two_threads_at_once_stops_once_without_error():
    # both calls saw the model thread, one set it to None, the other then called None.join
    model = FakeModel()
    b = make(model, max_batch=2, max_wait_ms=10_000)
    model.gate.clear()  # the next batch waits in the model
    futures = [b.submit(d) for d in images(2)]  # one full batch
    _in_model(b, 2)
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            b.stop(drain=False, timeout=5)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=stop) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # both are in stop(), the model thread still inside the model
    model.gate.set()
    for t in threads:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in threads)
    assert all(f.done() for f in futures)


def _warming_up() -> tuple[DynamicBatcher, FakeModel, threading.Thread]:
    """A batcher whose start() runs in a thread, its warm-up batch held inside the model."""
    entered = threading.Event()

    class Held(FakeModel):
        def __call__(self, x):
            entered.set()
            return super().__call__(x)

    model = Held()
    model.gate.clear()
    b = DynamicBatcher(model, preprocess=EvalTransform(32, 40), device="cpu")
    starter = threading.Thread(target=b.start)
    starter.start()
    assert entered.wait(10)  # the warm-up batch is in the model
    return b, model, starter


def test_stop_during_the_warm_up_waits_for_it_and_leaves_the_batcher_stopped():
    # stop() found no model thread yet and returned; the warm-up then finished and started the batcher
    b, model, starter = _warming_up()
    stopper = threading.Thread(target=b.stop, kwargs={"timeout": 10})
    stopper.start()
    time.sleep(0.2)
    model.gate.set()
    starter.join(10)
    stopper.join(10)
    assert not b.ready.is_set() and b._thread is None
    with pytest.raises(RuntimeError):
        b.submit(images(1)[0])


def test_a_stop_that_gives_up_waiting_for_the_warm_up_still_keeps_the_batcher_from_starting():
    b, model, starter = _warming_up()
    b.stop(timeout=0.2)  # the warm-up is still in the model: this stop gives up waiting for it
    model.gate.set()
    starter.join(10)
    assert not b.ready.is_set() and b._thread is None
    b.start()  # a later start() is a new request: it starts
    try:
        assert b.submit(images(1)[0]).result(10).shape == (1,)
    finally:
        b.stop()


def test_a_batcher_whose_model_thread_is_still_stuck_refuses_to_start_again():
    model = FakeModel()
    b = make(model, max_batch=1, max_wait_ms=0)
    model.gate.clear()
    b.submit(images(1)[0])
    _in_model(b)
    b.stop(drain=False, timeout=0.2)  # gives up on the model thread
    with pytest.raises(RuntimeError, match="still inside the model"):
        b.start()
    model.gate.set()
    deadline = time.monotonic() + 10
    while b._stuck is not None and b._stuck.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    b.start()  # the old thread has returned and ended: a new start works
    try:
        assert b.submit(images(1)[0]).result(10).shape == (1,)
    finally:
        b.stop()


def test_stats_and_trace():
    model = FakeModel()
    with make(model, max_batch=4, max_wait_ms=20) as b:
        for f in [b.submit(d) for d in images(6)]:
            f.result(5)
        s, tr = b.stats(), b.trace()
    assert s["completed"] == 6 and s["batches"] >= 2 and s["mean_batch_size"] > 1
    assert s["latency_ms"]["p99"] >= s["latency_ms"]["p50"] > 0
    names = {e["name"] for e in tr["traceEvents"] if e.get("ph") == "X"}
    assert {"preprocess", "compute"} <= names


@gpu
def test_gpu_decode_runs_on_the_gpu_for_big_batches_and_matches_cpu_closely():
    data = images(4, size=300)
    with make(torch.nn.Identity(), device="cuda", max_batch=4, max_wait_ms=500, gpu_decode_min_batch=2) as b:
        outs = [f.result(30) for f in [b.submit(d) for d in data]]
        s = b.stats()
    assert s["gpu_decoded"] == 4 and s["gpu_decode_fallbacks"] == 0 and s["cpu_decoded"] == 0, s
    with make(torch.nn.Identity(), device="cpu", max_batch=4, max_wait_ms=100) as b:
        ref = [f.result(30) for f in [b.submit(d) for d in data]]
    for a, r in zip(outs, ref):
        assert a.shape == r.shape
        assert (a - r).abs().mean() < 0.05  # normalised units: decoder rounding and DCT-scaled CPU decode


def test_float_resize_used_on_the_gpu_matches_the_cpu_uint8_resize():
    from fastload.load.transforms import _resize
    from fastload.serve.gpu_decode import resize_uint8

    img = torch.from_numpy(__import__("numpy").array(photo(300, 200, seed=4))).permute(2, 0, 1).contiguous()
    got, ref = resize_uint8(img, [112, 168]), _resize(img, [112, 168])
    assert got.dtype == torch.uint8 and got.shape == ref.shape == (3, 112, 168)
    assert (got.int() - ref.int()).abs().max() <= 1


def test_gpu_decode_failure_falls_back_to_the_cpu_counted_and_warned_once(monkeypatch, caplog):
    import fastload.serve.gpu_decode as gd

    def refuse(*args, **kwargs):
        raise RuntimeError("nvJPEG refused (injected)")

    monkeypatch.setattr(gd, "gpu_eval_batch", refuse)
    model = FakeModel()
    b = make(model, max_batch=2, max_wait_ms=200)
    b.gpu_decode_min_batch = 2  # as on CUDA: decode at batch time
    try:
        with caplog.at_level("WARNING", logger="fastload.serve"):
            for _ in range(2):
                outs = [f.result(10) for f in [b.submit(d) for d in images(2)]]
                assert [o.shape for o in outs] == [(1,), (1,)]
        s = b.stats()
    finally:
        b.stop()
    assert s["gpu_decode_fallbacks"] == 2 and s["gpu_decoded"] == 0 and s["cpu_decoded"] == 4
    assert sum("GPU decode failed" in r.getMessage() for r in caplog.records) == 1


def test_submit_async_awaits_the_result():
    import asyncio

    model = FakeModel()
    with make(model, max_batch=4, max_wait_ms=5) as b:
        async def two():
            return await asyncio.gather(*(b.submit_async(d) for d in images(2)))

        outs = asyncio.run(two())
    assert [o.shape for o in outs] == [(1,), (1,)]


def _in_model(b: DynamicBatcher, n: int = 1) -> None:
    """Wait until ``n`` accepted requests have reached the (held) model and none waits."""
    for _ in range(500):
        s = b.stats()
        if s["in_flight"] == n and s["waiting"] == 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"the held request never reached the model: {b.stats()}")


def test_submit_async_past_its_deadline_raises_and_leaves_the_queue():
    import asyncio

    from fastload.errors import DeadlineExceeded

    model = FakeModel()
    with make(model, max_batch=1, max_wait_ms=0, max_queue=2) as b:
        model.gate.clear()  # the model holds the first request: the second waits in the queue
        held = b.submit(images(1)[0])
        _in_model(b)

        async def late():
            t0 = time.perf_counter()
            with pytest.raises(DeadlineExceeded, match="deadline"):
                await b.submit_async(images(1)[0], timeout=0.3)
            return time.perf_counter() - t0

        took = asyncio.run(late())
        waiting = b.stats()["waiting"]
        model.gate.set()
        held.result(5)
    assert took > 0.25 and waiting == 0  # not before the deadline, and its queue place was freed


def test_cancelling_the_awaiting_task_cancels_the_request():
    import asyncio

    model = FakeModel()
    with make(model, max_batch=1, max_wait_ms=0, max_queue=4) as b:
        model.gate.clear()
        held = b.submit(images(1)[0])
        _in_model(b)

        async def client_gone():
            task = asyncio.ensure_future(b.submit_async(images(1)[0]))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(client_gone())
        s = b.stats()
        model.gate.set()
        held.result(5)
    assert s["waiting"] == 0 and s["expired"] == 1


class SlowPre(EvalTransform):
    """The eval preset after a fixed delay (a slow decoder)."""

    def from_bytes(self, data: bytes) -> torch.Tensor:
        time.sleep(0.5)
        return super().from_bytes(data)


@pytest.mark.parametrize("window_from, low, high", [("arrival", 0.45, 0.8), ("ready", 0.95, 3.0)])
def test_window_starts_at_arrival_or_when_preprocessing_ended(window_from, low, high):
    model = FakeModel()
    with make(model, preprocess=SlowPre(32, 40), max_batch=8, max_wait_ms=500, window_from=window_from) as b:
        t0 = time.perf_counter()
        b.submit(images(1)[0]).result(5)
        elapsed = time.perf_counter() - t0
    # arrival: the 500 ms window runs during the 500 ms decode (max of the two); ready: it starts after it (sum)
    assert low <= elapsed < high
