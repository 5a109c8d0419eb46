"""``run_instrumented``: a real training step around ``StepTimer``.

Owns: the measured loop (next batch → to device → forward, loss, backward, optimizer
step), the simulated device step for machines without a GPU, model construction by
torchvision name, and gathering per-rank results under ``torch.distributed``. No printing.

The simulated step (``SimulatedStep(step_ms)``) sleeps for the time a GPU would take for
one batch. Sleeping releases the CPU exactly as an asynchronous GPU does (the host only
launches kernels, then waits), so on a CPU-only machine the loaders compete for the CPUs
the way they would beside a real GPU, and the result answers "would this pipeline keep a
GPU busy at N images/s?". The simulated device also stands in for the GPU's share of the
input work: on the CPU, batches are not moved or converted on the host (on a GPU the
copy is DMA and uint8 → float is device work, part of ``step_ms``); loaders that convert
to float in their workers (torchvision's ToTensor/Normalize, DALI CPU) still pay for it
there, as they would beside a GPU.

Must not: build loaders (``recipe.py``) or write files (``report.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from fastload.errors import RecipeError
from fastload.load.prefetch import prepare_batch
from fastload.measure.timing import NvmlSampler, StageResult, StepTimer

__all__ = ["SimulatedStep", "build_model", "run_instrumented", "gather_results"]


@dataclass(frozen=True)
class SimulatedStep:
    """A stand-in for a GPU step: ``step_ms`` of device time per batch, no CPU used."""

    step_ms: float

    def __post_init__(self) -> None:
        if self.step_ms < 0:
            raise ValueError(f"step_ms must be >= 0, got {self.step_ms}")


def build_model(name: str, *, num_classes: int, step_ms: float | None = None) -> torch.nn.Module | SimulatedStep:
    """``"simulated"`` (needs ``step_ms``) or any ``torchvision.models`` name, randomly initialised.

    Raises:
        RecipeError: an unknown model name (the message lists the valid ones).
    """
    if name == "simulated":
        if step_ms is None:
            raise RecipeError("model = 'simulated' needs step_ms (the device time per batch, in ms).")
        return SimulatedStep(step_ms)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if name not in names:
        raise RecipeError(f"Unknown value {name!r} for field model. Valid values are 'simulated' or a "
                          f"torchvision classification model: {', '.join(sorted(names))}.")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def run_instrumented(model: torch.nn.Module | SimulatedStep, loader: Iterable, *, steps: int, warmup: int = 5,
                     device: str | torch.device | None = None, optimizer: torch.optim.Optimizer | None = None,
                     amp: str | None = None, channels_last: bool = False, name: str = "stage",
                     batch_size: int | None = None, nvml: bool = True,
                     on_step: Callable[[], None] | None = None) -> StageResult:
    """Train ``model`` on ``loader`` for ``warmup + steps`` steps and measure every step.

    Args:
        model: an ``nn.Module`` taking the batch's images and returning logits, or a
            ``SimulatedStep``.
        loader: any iterable of ``(images, labels)``; restarted when an epoch ends (the
            restart counts as data wait, as it does in training).
        steps: measured steps; warm-up steps come first and are excluded from every figure.
        device: where the step runs (default: cuda when available, else cpu). Batches are
            moved there; ``uint8`` images are normalised there.
        optimizer: default ``SGD(lr=0.01, momentum=0.9)``.
        amp: None, ``"bf16"`` or ``"fp16"`` autocast (fp16 with a GradScaler on CUDA).
        channels_last: model and images in ``torch.channels_last``.
        on_step: called after every step (progress bars).

    Returns:
        A ``StageResult``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if amp not in (None, "none", "bf16", "fp16"):
        raise ValueError(f"Unknown value {amp!r} for argument amp. Valid values are None, 'bf16', 'fp16'.")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
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
    timer = StepTimer(str(device), warmup=warmup)
    it = iter(loader)
    seen_batch_size = batch_size or 0
    sampler = NvmlSampler(device.index or 0) if (nvml and device.type == "cuda") else contextlib.nullcontext()
    with sampler:
        for _ in range(warmup + steps):
            timer.begin()
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            timer.got_batch()
            if simulated and device.type == "cpu":
                labels = batch[1]  # the simulated GPU does the copy and conversion within step_ms
            else:
                images, labels = prepare_batch(batch, device, dtype=None, channels_last=channels_last,
                                               non_blocking=True)[:2]
            seen_batch_size = seen_batch_size or len(labels)
            timer.copied()
            if simulated:
                time.sleep(model.step_ms / 1e3)
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
    result = timer.summarize(name, seen_batch_size,
                             nvml=sampler.result() if isinstance(sampler, NvmlSampler) else None)
    result.extra.update({"model": "simulated" if simulated else type(model).__name__, "amp": amp or "none",
                         "channels_last": channels_last,
                         **({"step_ms": model.step_ms} if simulated else {})})
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
