"""run_instrumented / StepTimer: the figures are true to a constructed workload."""

from __future__ import annotations

import time

import pytest
import torch

from fastload.measure.timing import StepTimer, percentiles
from fastload.measure.train import SimulatedStep, build_model, run_instrumented
from fastload.errors import RecipeError

gpu = pytest.mark.gpu


class SlowLoader:
    """Yields (images, labels) after sleeping ``delay_s`` per batch: a loader of known speed."""

    def __init__(self, delay_s: float, batches: int = 1000, batch_size: int = 4) -> None:
        self.delay, self.batches, self.bs = delay_s, batches, batch_size

    def __iter__(self):
        for _ in range(self.batches):
            time.sleep(self.delay)
            yield torch.zeros(self.bs, 3, 8, 8, dtype=torch.uint8), torch.zeros(self.bs, dtype=torch.int64)


@pytest.mark.parametrize("delay_ms, step_ms", [(30, 10), (5, 30)], ids=["data-bound", "compute-bound"])
def test_data_wait_fraction_is_honest(delay_ms, step_ms):
    result = run_instrumented(SimulatedStep(step_ms), SlowLoader(delay_ms / 1e3), steps=25, warmup=3, device="cpu")
    expected = delay_ms / (delay_ms + step_ms)
    assert abs(result.data_wait_fraction - expected) < 0.05, (result.data_wait_fraction, expected)
    assert abs(result.gpu_idle_fraction - expected) < 0.05
    assert result.idle_source == "host-clock"
    assert result.steps == 25 and len(result.records) == 25  # warm-up excluded
    assert result.records[0].step == 3
    assert abs(result.images_per_s - 4 / ((delay_ms + step_ms) / 1e3)) / result.images_per_s < 0.15
    assert result.percentiles_ms["data_wait"]["p50"] == pytest.approx(delay_ms, abs=4)


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


@gpu
def test_gpu_idle_from_cuda_events():
    """A loader 20 ms slow per batch and ~10 ms of GPU work: the GPU is idle about 2/3 of the time."""
    a = torch.randn(2048, 2048, device="cuda")

    class Busy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="cuda"))

        def forward(self, x):
            y = a
            for _ in range(8):
                y = y @ a / 2048
            return (x.float().mean() + y.mean() + self.w).expand(x.shape[0], 3)

    result = run_instrumented(Busy(), SlowLoader(0.02), steps=15, warmup=3, device="cuda")
    assert result.idle_source == "cuda-events"
    busy = result.percentiles_ms["gpu_busy"]["mean"]
    expected = 20 / (20 + busy) if busy < 20 else 0.0
    assert abs(result.gpu_idle_fraction - expected) < 0.1
