"""Does a training step that holds the GIL cost loader threads more than worker processes?

    python tools/bench_gil.py [--rounds 6] [--batches 10] [--workers 2] [--step-ms 60] [--host-ms 8]

Four arms in ONE interleaved-rounds loop (``fastload.measure.rounds.interleave``, order rotated
each round): the ``fast`` stage (worker processes) and the ``threads`` stage (a thread pool in
the training process), each followed per batch by the simulated device step with the host part
(``--host-ms``, holding the GIL) and without it (a pure sleep of ``--step-ms``). Both stages read
the generated default dataset's store with the same presets and hand out the same batches.

Printed per round: threads / processes with the GIL-holding step, the same with the pure sleep,
and their quotient, the GIL's effect on threads relative to processes (1.0: none; below 1:
threads lose more). Ratios are taken within a round, so drift of the machine cancels. Asserts
nothing.
"""

from __future__ import annotations

import argparse
import statistics

from fastload.bench.loader import _time
from fastload.measure.recipe import RecipeData, prepare_data
from fastload.measure.rounds import interleave
from fastload.measure.stages import StageData, StageOptions, build_stage, running
from fastload.measure.train import SimulatedStep


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=60.0)
    p.add_argument("--host-ms", type=float, default=8.0)
    a = p.parse_args()
    data = prepare_data(RecipeData(), progress=True)
    stage_data = StageData(data.folder, data.store)
    opts = StageOptions(batch_size=a.batch_size, workers=a.workers, device="cpu", pin_memory=False)
    steps = {"gil": SimulatedStep(a.step_ms, a.host_ms), "sleep": SimulatedStep(a.step_ms, 0.0)}
    arms = [(stage, step) for stage in ("fast", "threads") for step in steps]

    def measure(arm: tuple[str, str], k: int) -> float:
        stage, step = arm
        with running(build_stage(stage, stage_data, opts)) as loader:
            return _time(loader, a.warmup, a.batches, steps[step].run)

    got = interleave(arms, a.rounds, measure)
    gil = got[("threads", "gil")].ratios_to(got[("fast", "gil")])
    sleep = got[("threads", "sleep")].ratios_to(got[("fast", "sleep")])
    print(f"{a.batch_size} images per batch, {a.workers} workers/threads, step {a.step_ms:g} ms "
          f"({a.host_ms:g} ms holding the GIL, or a pure sleep), {a.rounds} interleaved rounds x {a.batches} batches")
    for arm, m in got.items():
        print(f"  {arm[0]:8} {arm[1]:6} images/s median {m.median():7.1f}  rounds {[round(v) for v in m.values]}")
    effect = [g / s for g, s in zip(gil, sleep)]
    print(f"threads / processes, GIL-holding step: median {statistics.median(gil):.2f} "
          f"(rounds {', '.join(f'{x:.2f}' for x in gil)})")
    print(f"threads / processes, pure sleep:       median {statistics.median(sleep):.2f} "
          f"(rounds {', '.join(f'{x:.2f}' for x in sleep)})")
    print(f"GIL effect on threads relative to processes: median {statistics.median(effect):.2f} "
          f"(rounds {', '.join(f'{x:.2f}' for x in effect)})")


if __name__ == "__main__":
    main()
