"""What the profiler's own instrumentation costs: the same loop, plain and profiled, interleaved.

Owns: ``bench_profile()`` and ``python -m fastload.bench.profile``. Arms: ``plain``
(a torch DataLoader loop), ``profiled`` (the same loop inside ``fastload.profile()``: the
DataLoader patch, per-sample timing, the per-step records) and, on CUDA, ``kineto`` (every
step inside the torch.profiler window). Each step does the same work in every arm: a
DataLoader batch (workers 0, a map-style dataset of small tensors) and a fixed matmul
chain on the device. Rounds are interleaved, the order rotated each round (``measure.rounds.interleave``:
no arm always runs first); the median step time of each arm and its
ratio to ``plain`` (with the spread over rounds) are reported.

Must not: assert anything about the figures (benchmarks report; tests do not time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["bench_profile"]


def _loop(steps: int, device: str, size: int) -> float:
    import torch

    class Tensors(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return steps * 8

        def __getitem__(self, i):
            return torch.full((3, 16, 16), float(i % 7))

    loader = torch.utils.data.DataLoader(Tensors(), batch_size=8)
    w = torch.randn(size, size, device=device)
    t0 = time.perf_counter()
    for x in loader:
        y = x.to(device).sum() * w
        for _ in range(4):
            y = y @ w
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def bench_profile(*, steps: int = 200, rounds: int = 5, size: int = 192) -> dict[str, Any]:
    """Median seconds per step of each arm, and ratios to ``plain`` with their min..max over rounds."""

    from fastload.measure.rounds import interleave
    from fastload.profiling.profile import profile

    from fastload.system import resolve_device

    device = resolve_device("auto").type
    arms = ["plain", "profiled"] + (["kineto"] if device == "cuda" else [])
    _loop(20, device, size)  # warm caches, kernels, the allocator
    with tempfile.TemporaryDirectory() as tmp:
        def measure(arm: str, r: int) -> float:
            if arm == "plain":
                return _loop(steps, device, size)
            with profile(out=Path(tmp) / f"{arm}-{r}", warmup=1, kineto_steps=steps + 1 if arm == "kineto" else 0):
                return _loop(steps, device, size)

        measured = interleave(arms, rounds, measure)
    times = {a: m.values for a, m in measured.items()}
    ratios = {a: m.ratios_to(measured["plain"]) for a, m in measured.items()}
    return {"device": device, "steps": steps, "rounds": rounds,
            "step_ms": {a: statistics.median(v) * 1e3 for a, v in times.items()},
            "overhead": {a: {"median": statistics.median(v) - 1, "min": min(v) - 1, "max": max(v) - 1}
                         for a, v in ratios.items() if a != "plain"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    result = bench_profile(steps=args.steps, rounds=args.rounds)
    print(f"profiler overhead, {result['steps']} steps x {result['rounds']} interleaved rounds on {result['device']}")
    print(f"  plain     {result['step_ms']['plain']:.3f} ms/step")
    for arm, o in result["overhead"].items():
        print(f"  {arm:9} {result['step_ms'][arm]:.3f} ms/step  overhead {o['median']:+.1%} "
              f"(rounds {o['min']:+.1%} .. {o['max']:+.1%})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
