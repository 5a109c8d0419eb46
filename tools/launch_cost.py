"""The host-side CPU time of one ResNet-50 training step's kernel launches: the default
``host_ms`` of the simulated device step (``fastload.measure.train.DEFAULT_HOST_MS``).

Method (no GPU needed; torch's own profiler on the CPU):

1. Count the aten ops one training step dispatches: ResNet-50 forward under bf16
   autocast, cross-entropy, backward, ``SGD(momentum=0.9, foreach=True)`` step, profiled
   with ``torch.profiler`` on a tiny batch (2 x 3 x 32 x 32; the op count does not depend
   on the batch or image size, only the kernels' run time does).
2. Measure the CPU time of dispatching one aten op from Python: ``torch.add`` on
   one-element tensors in a loop (argument parsing + dispatcher + a kernel that does
   almost nothing), one intra-op thread, median of 5 runs.
3. host time = ops x per-op time.

Assumptions, stated: every aten op (nested ones too) costs about one dispatch from Python
(nested ops skip Python's argument parsing, module calls and hooks add some: the two
roughly cancel at this precision); CUDA's own per-kernel launch cost (cudaLaunchKernel,
a few microseconds) is NOT included, so on a real GPU the host time is this or more. The
figure is CPU time, so it depends on the machine's per-core speed.

    python tools/launch_cost.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torchvision


def count_ops() -> int:
    from torch.profiler import ProfilerActivity, profile

    model = torchvision.models.resnet50(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    x, y = torch.randn(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def per_op_seconds(n: int = 20_000) -> float:
    a, b = torch.ones(1), torch.ones(1)
    for _ in range(1000):
        torch.add(a, b)
    runs = []
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(n):
            torch.add(a, b)
        runs.append((time.process_time() - t0) / n)
    return statistics.median(runs)


def main() -> None:
    torch.set_num_threads(1)
    ops = count_ops()
    per_op = per_op_seconds()
    print(f"aten ops per ResNet-50 training step (bf16 autocast, foreach SGD): {ops}")
    print(f"CPU time per aten op dispatched from Python: {per_op * 1e6:.2f} us (median of 5 x 20,000)")
    print(f"host time per step: {ops} x {per_op * 1e6:.2f} us = {ops * per_op * 1e3:.1f} ms "
          "(excludes CUDA's per-kernel launch cost: a lower bound)")


if __name__ == "__main__":
    main()
