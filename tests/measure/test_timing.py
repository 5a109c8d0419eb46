"""run_instrumented / StepTimer: the figures are true to a constructed workload."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import pytest
import torch

from fastload.measure.timing import StepTimer, percentiles
from fastload.measure.train import RunOptions, SimulatedStep, build_model, run_instrumented
from fastload.errors import RecipeError

gpu = pytest.mark.gpu


class SlowLoader:
    """Yields (images, labels) after sleeping ``delay_s`` per batch: a loader of known speed.

    ``took`` holds each batch's time on the loader's own clock: on a loaded machine a sleep
    overshoots, so the truth a measurement is held to is what this run's loader really took.
    """

    def __init__(self, delay_s: float, batches: int = 1000, batch_size: int = 4) -> None:
        self.delay, self.batches, self.bs = delay_s, batches, batch_size
        self.took: list[float] = []

    def __iter__(self):
        for _ in range(self.batches):
            t0 = time.perf_counter()
            time.sleep(self.delay)
            batch = torch.zeros(self.bs, 3, 8, 8, dtype=torch.uint8), torch.zeros(self.bs, dtype=torch.int64)
            self.took.append(time.perf_counter() - t0)
            yield batch


@dataclass(frozen=True)
class TimedStep(SimulatedStep):
    """A ``SimulatedStep`` that keeps each step's time on its own clock (``took``)."""

    took: list[float] = field(default_factory=list)

    def run(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = super().run()
        self.took.append(time.perf_counter() - t0)
        return out


@pytest.mark.parametrize("delay_ms, step_ms", [(30, 10), (5, 30)], ids=["data-bound", "compute-bound"])
def test_data_wait_fraction_is_honest(delay_ms, step_ms):
    loader, step = SlowLoader(delay_ms / 1e3), TimedStep(step_ms)
    result = run_instrumented(step, loader, steps=25, warmup=3, device="cpu")
    # the truth from this run's own clocks (the loader's and the step's), not from the nominal sleeps: a loaded
    # machine stretches both, and the timer is right when it reports what really happened
    waited, computed = loader.took[3:28], step.took[3:28]
    assert len(waited) == len(computed) == 25
    truth = sum(waited) / (sum(waited) + sum(computed))
    assert (truth > 0.5) == (delay_ms > step_ms), truth  # the workload is the one the case is named for
    assert abs(result.data_wait_fraction - truth) < 0.05, (result.data_wait_fraction, truth)
    assert abs(result.gpu_idle_fraction - truth) < 0.05, (result.gpu_idle_fraction, truth)
    assert result.idle_source == "host-clock"
    assert result.steps == 25 and len(result.records) == 25  # warm-up excluded
    assert result.records[0].step == 3
    own_rate = 4 * 25 / (sum(waited) + sum(computed))
    assert abs(result.images_per_s - own_rate) / result.images_per_s < 0.15, (result.images_per_s, own_rate)
    assert result.percentiles_ms["data_wait"]["p50"] == pytest.approx(statistics.median(waited) * 1e3, abs=4)


def test_epoch_restart_and_real_model_on_cpu():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 3))
    before = [p.detach().clone() for p in model.parameters()]
    loader = SlowLoader(0.0, batches=3)  # 3 batches per epoch, 7 steps: restarts twice
    result = run_instrumented(model, loader, steps=5, warmup=2, device="cpu", amp="bf16")
    assert result.steps == 5 and result.batch_size == 4
    assert result.compute_fraction > 0.2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the optimizer stepped
    assert result.extra["amp"] == "bf16"


def test_bad_arguments():
    with pytest.raises(ValueError, match="steps >= 1"):
        run_instrumented(SimulatedStep(1), SlowLoader(0), steps=0)
    with pytest.raises(ValueError, match="Valid values are None, 'bf16', 'fp16'"):
        run_instrumented(SimulatedStep(1), SlowLoader(0), steps=1, amp="fp8")
    with pytest.raises(RecipeError, match="Valid values are 'simulated' or a torchvision"):
        build_model("resnet5000", num_classes=2)
    assert isinstance(build_model("resnet18", num_classes=7), torch.nn.Module)


def test_percentiles():
    p = percentiles([1.0] * 98 + [10.0, 100.0])
    assert p["p50"] == 1.0 and p["p99"] > 9 and p["mean"] == pytest.approx(2.08)


def test_timer_without_steps_is_an_error():
    t = StepTimer("cpu", warmup=2)
    with pytest.raises(ValueError, match="no measured steps"):
        t.summarize("x", 4)


def test_uint8_batches_are_normalised_inside_the_timed_loop_on_cpu():
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            seen.append((x.dtype, float(x.min())))
            return self.lin(x.mean(dim=(2, 3)))

    run_instrumented(Probe(), SlowLoader(0.0), steps=2, warmup=0, device="cpu",
                     options=RunOptions(name="probe", batch_size=4))
    mean, std = 0.485, 0.229  # channel 0: uint8 zeros become (0 - mean) / std
    assert seen and all(dtype == torch.float32 and lo == pytest.approx(-2.1179, abs=1e-3) for dtype, lo in seen)
    assert -mean / std == pytest.approx(-2.1179, abs=1e-3)


def test_run_options():
    result = run_instrumented(SimulatedStep(0), SlowLoader(0.0), steps=2, warmup=0, device="cpu",
                              options=RunOptions(name="named", batch_size=9, extra={"tag": 1}))
    assert result.name == "named" and result.batch_size == 9 and result.extra["tag"] == 1
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        RunOptions(max_in_flight=0)


def _busy_model(target_ms: float):
    """A model whose forward is ~``target_ms`` of GPU work (calibrated on this GPU)."""
    a = torch.randn(2048, 2048, device="cuda")

    def work(n):
        y = a
        for _ in range(n):
            y = y @ a / 2048
        return y

    work(4)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work(20)
    end.record()
    end.synchronize()
    reps = max(1, round(target_ms / (start.elapsed_time(end) / 20)))

    class Busy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="cuda"))

        def forward(self, x):
            return (x.float().mean() + work(reps).mean() + self.w).expand(x.shape[0], 3)

    return Busy()


@gpu
def test_gpu_idle_from_cuda_events_when_the_loader_is_slower_than_the_gpu():
    """Loader 20 ms per batch, ~8 ms of GPU work per step. StepTimer lets steps run ahead,
    but a data-bound loop has nothing queued: each step's kernels start when its batch
    arrives, so the GPU works ``busy`` ms of every host step and idles the rest. The truth
    is 1 - busy / step time (about 0.6), not the synchronous loop's 20 / (20 + busy)."""
    result = run_instrumented(_busy_model(8.0), SlowLoader(0.02), steps=15, warmup=3, device="cuda")
    assert result.idle_source == "cuda-events"
    busy = result.percentiles_ms["gpu_busy"]["mean"]
    step = result.percentiles_ms["total"]["mean"]
    assert 4 < busy < 16, busy  # the calibration held: the loader, not the GPU, sets the pace
    expected = 1 - busy / step
    assert abs(result.gpu_idle_fraction - expected) < 0.08, (result.gpu_idle_fraction, expected)
    assert abs(result.gpu_idle_fraction - 20 / (20 + busy)) > 0.05  # the synchronous-loop answer is refuted


@gpu
def test_gpu_idle_near_zero_when_steps_queue_ahead():
    """No loader delay and ~8 ms of GPU work: with two steps in flight the GPU always has the
    next step queued, so it is (almost) never idle even though the host waits on it."""
    result = run_instrumented(_busy_model(8.0), SlowLoader(0.0), steps=15, warmup=3, device="cuda")
    assert result.gpu_idle_fraction < 0.1, result.gpu_idle_fraction
