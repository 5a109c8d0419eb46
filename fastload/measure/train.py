"""``run_instrumented``: a real training step around ``StepTimer``.

Owns: the measured loop (next batch → to device → forward, loss, backward, optimizer
step), the simulated device step for machines without a GPU, model construction by
torchvision name, and gathering per-rank results under ``torch.distributed``. No printing.

The simulated step (``SimulatedStep(step_ms, host_ms=...)``) behaves like a GPU step seen
from the host: first ``host_ms`` of Python work that holds the GIL and a core (launching a
real model's kernels does: module calls, argument parsing, dispatch), then a sleep for the
rest of the device time (``step_ms - host_ms``; the GPU runs the kernels while the host
launches them, so a step takes ``max(step_ms, host_ms)``). Sleeping releases the CPU as an
asynchronous GPU does, so on a CPU-only machine the loaders compete for the CPUs, and for
the GIL, the way they would beside a real GPU, and the result answers "would this
pipeline keep a GPU busy at N images/s?". ``DEFAULT_HOST_MS`` is the measured default
(``tools/launch_cost.py`` prints the measurement and its assumptions).

The simulated device leaves no input work undone: every batch
goes through ``prepare_batch`` inside the timed loop on every device, so a loader that
hands out ``uint8`` is normalised on the host, in the measured copy time, when the device
is the CPU (recipe stages hand the step batches already normalised: ``stages.py``).

Must not: build loaders (``recipe.py``) or write files (``report.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from fastload.errors import RecipeError
from fastload.load.prefetch import prepare_batch
from fastload.measure.timing import NvmlSampler, StageResult, StepTimer

log = logging.getLogger(__name__)

__all__ = ["distributed_run", "SimulatedStep", "DEFAULT_HOST_MS", "hold_gil", "RunOptions", "build_model",
           "run_instrumented", "gather_results"]


#: Host-side ms per training step of ResNet-50 (bf16 autocast, foreach SGD): aten ops per step
#: x the CPU time of dispatching one op from Python, measured by ``tools/launch_cost.py``
#: (4,242 ops x 1.4-2.4 us = 5.8, 7.4, 8.8, 10.2 ms in four runs on the 2-core development
#: machine while shared, median ~8; CUDA's own per-kernel launch cost is not included, so
#: this is a lower bound of the real host time).
DEFAULT_HOST_MS = 8.0

_SPIN_RATE: list[float] = []  # iterations of the GIL-holding spin per CPU second, calibrated once


def _spin_rate() -> float:
    if not _SPIN_RATE:
        # best of 9 runs of ~10 ms each: a shared core inflates a short run's CPU time (cache, SMT
        # sibling), and an underestimated rate makes every later hold too short
        n, best = 1_000_000, float("inf")
        for _ in range(9):
            t0 = time.thread_time()
            sum(range(n))
            best = min(best, time.thread_time() - t0)
        _SPIN_RATE.append(n / max(best, 1e-9))
    return _SPIN_RATE[0]


def hold_gil(seconds: float) -> float:
    """Spend about ``seconds`` of this thread's CPU time without letting go of the GIL; the wall
    seconds it took.

    ``sum(range(n))`` is one C call: the interpreter's loop does not run inside it, so no
    other Python thread is offered the GIL until it returns (Python's switch interval is
    only honoured between bytecodes). ``n`` comes from a one-off calibration of this
    thread's CPU time, so ``seconds`` is CPU time, as a launch cost is: on a machine whose
    cores are shared the hold lasts longer in wall time, as launching kernels would.
    """
    n = int(seconds * _spin_rate())
    t0 = time.perf_counter()
    if n > 0:
        sum(range(n))
    return time.perf_counter() - t0


@dataclass(frozen=True)
class SimulatedStep:
    """A stand-in for a GPU step: ``host_ms`` of host work holding the GIL and a core (the
    kernel launches), then a sleep for the rest of the ``step_ms`` of device time.

    ``host_ms=0`` is a device that costs the host nothing (a pure sleep).
    """

    step_ms: float
    host_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.step_ms < 0:
            raise ValueError(f"step_ms must be >= 0, got {self.step_ms}")
        if self.host_ms < 0:
            raise ValueError(f"host_ms must be >= 0, got {self.host_ms}")
        if self.host_ms > 0:
            _spin_rate()  # calibrate now, not inside the first timed step

    def run(self) -> tuple[float, float]:
        """One step: hold the GIL for ``host_ms``, sleep the rest; (seconds held, seconds slept)."""
        held = hold_gil(self.host_ms / 1e3) if self.host_ms > 0 else 0.0
        rest = self.step_ms / 1e3 - held
        t0 = time.perf_counter()
        if rest > 0:
            time.sleep(rest)
        return held, time.perf_counter() - t0


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """The less common settings of ``run_instrumented``.

    Args:
        channels_last: model and images in ``torch.channels_last``.
        name: the stage name in the result.
        batch_size: the batch size to report (default: the first batch's).
        nvml: sample GPU utilisation with NVML on CUDA when it is installed.
        max_in_flight: steps the host may queue ahead of the GPU (``StepTimer``).
    """

    channels_last: bool = False
    name: str = "stage"
    batch_size: int | None = None
    nvml: bool = True
    max_in_flight: int = 2
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")


def build_model(name: str, *, num_classes: int, step_ms: float | None = None,
                host_ms: float = 0.0) -> torch.nn.Module | SimulatedStep:
    """``"simulated"`` (needs ``step_ms``; ``host_ms`` of GIL-holding launch work per step) or any
    ``torchvision.models`` name, randomly initialised.

    Raises:
        RecipeError: an unknown model name (the message lists the valid ones).
    """
    if name == "simulated":
        if step_ms is None:
            raise RecipeError("model = 'simulated' needs step_ms (the device time per batch, in ms).")
        return SimulatedStep(step_ms, host_ms)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        raise RecipeError(f"Unknown value {name!r} for field model. Valid values are 'simulated' or a "
                          f"torchvision classification model: {', '.join(sorted(names))}.")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def run_instrumented(model: torch.nn.Module | SimulatedStep, loader: Iterable, *, steps: int, warmup: int = 5,
                     device: str | torch.device | None = None, amp: str | None = None,
                     optimizer: torch.optim.Optimizer | None = None, options: RunOptions | None = None,
                     on_step: Callable[[], None] | None = None) -> StageResult:
    """Train ``model`` on ``loader`` for ``warmup + steps`` steps and measure every step.

    Args:
        model: an ``nn.Module`` taking the batch's images and returning logits, or a
            ``SimulatedStep``.
        loader: any iterable of ``(images, labels)``; restarted when an epoch ends (the
            restart counts as data wait, as it does in training).
        steps: measured steps; warm-up steps come first and are excluded from every figure.
        device: where the step runs (default: cuda when available, else cpu). Batches are
            moved there; ``uint8`` images are normalised there, inside the measured copy.
        amp: None, ``"bf16"`` or ``"fp16"`` autocast (fp16 with a GradScaler on CUDA).
        optimizer: default ``SGD(lr=0.01, momentum=0.9)``.
        options: ``RunOptions`` (channels_last, name, batch_size, nvml, max_in_flight).
        on_step: called after every step (progress bars).

    Returns:
        A ``StageResult``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if amp not in (None, "none", "bf16", "fp16"):
        raise ValueError(f"Unknown value {amp!r} for argument amp. Valid values are None, 'bf16', 'fp16'.")
    from fastload.system import resolve_device

    o = options or RunOptions()
    channels_last = o.channels_last
    device = resolve_device(device)
    simulated = isinstance(model, SimulatedStep)
    scaler = None
    if not simulated:
        model = model.to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        model.train()
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if amp == "fp16" and device.type == "cuda":
            scaler = torch.amp.GradScaler("cuda")
    loss_fn = torch.nn.CrossEntropyLoss()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "none")
    timer = StepTimer(str(device), warmup=warmup, max_in_flight=o.max_in_flight)
    it = iter(loader)
    seen_batch_size = o.batch_size or 0
    sampler = NvmlSampler(device.index or 0) if (o.nvml and device.type == "cuda") else contextlib.nullcontext()
    with sampler:
        for _ in range(warmup + steps):
            timer.begin()
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            timer.got_batch()
            images, labels = prepare_batch(batch, device, dtype=None, channels_last=channels_last,
                                           non_blocking=True)[:2]
            seen_batch_size = seen_batch_size or len(labels)
            timer.copied()
            if simulated:
                model.run()
            else:
                with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = loss_fn(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    optimizer.step()
            timer.computed(len(labels))
            if on_step is not None:
                on_step()
    result = timer.summarize(o.name, seen_batch_size,
                             nvml=sampler.result() if isinstance(sampler, NvmlSampler) else None)
    result.extra.update({"model": "simulated" if simulated else type(model).__name__, "amp": amp or "none",
                         "channels_last": channels_last,
                         **({"step_ms": model.step_ms, "host_ms": model.host_ms} if simulated else {}), **o.extra})
    return result


def gather_results(result: StageResult) -> list[dict] | None:
    """Under ``torch.distributed``: every rank's summary on rank 0 (None on other ranks).

    Without an initialised process group: ``[this result]``.
    """
    import torch.distributed as dist

    mine = result.to_json(with_records=False)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    mine["rank"] = dist.get_rank()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone if dist.get_rank() == 0 else None


@contextlib.contextmanager
def distributed_run() -> Iterator[tuple[int, int]]:
    """Join the process group torchrun describes (gloo on CPU, nccl on GPU) for the block; (rank, world size).

    The group joined here is destroyed when the block ends, on every rank, also on an error: a rank
    that exits with a gloo group still alive can abort in the interpreter's teardown ("terminate
    called without an active exception", SIGABRT, pytorch/pytorch#190489), which torchrun reports as
    a failed run although every figure was written. A group the caller had already joined is left as
    it was. Outside torchrun (``WORLD_SIZE`` unset or 1): ``(0, 1)`` and no group.
    """
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 0, 1
        return
    import torch.distributed as dist

    joined = False
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        joined = True
    try:
        yield dist.get_rank(), dist.get_world_size()  # the group's own: a caller's may differ from WORLD_SIZE
    except BaseException:
        # the block's error is the one to report: a teardown that fails too (a peer already gone) is logged,
        # not raised over it (it would carry the block's error only as its __context__)
        if joined and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:
                log.warning("leaving the process group after the run failed: %s", exc)
        raise
    if joined and dist.is_initialized():
        dist.destroy_process_group()
