"""The simulated device step charges the host as a GPU's kernel launches do: it holds the GIL
(and a core) for ``host_ms``, then sleeps the rest of ``step_ms``."""

from __future__ import annotations

import threading
import time

import pytest

from fastload.measure.train import SimulatedStep, build_model, hold_gil


class Ticker:
    """A pure-Python thread that records a timestamp per loop turn: it runs only with the GIL."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.stamps.append(time.perf_counter())

    def __enter__(self) -> Ticker:
        self.thread.start()
        time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def between(self, a: float, b: float) -> int:
        return sum(1 for t in self.stamps if a < t < b)

    def longest_gap(self, a: float, b: float) -> float:
        """The longest stretch within [a, b] in which the ticker made no progress."""
        inside = [a] + [t for t in self.stamps if a < t < b] + [b]
        return max(y - x for x, y in zip(inside, inside[1:]))


def test_host_part_holds_the_gil_and_the_rest_sleeps():
    # long enough that an OS hiccup on a loaded machine (tens of ms) cannot pass for the hold
    # and a device time long enough that the sleep after it is long even when the hold's wall time
    # stretches (host_ms is CPU time: on a shared core its wall time can be several times longer)
    step = SimulatedStep(step_ms=1500, host_ms=150)
    with Ticker() as ticker:
        for _ in range(2):
            t0 = time.perf_counter()
            held, slept = step.run()
            t1 = time.perf_counter()
            # the ticker stood still for the whole host part (it ran in the sleep after it)...
            assert held >= 0.6 * 0.150, held
            assert ticker.longest_gap(t0, t1) >= 0.6 * 0.150
            # ...and the rest was a sleep: the ticker ran during it
            assert ticker.between(t1 - slept, t1) > 0
            assert slept >= 1.500 - held - 0.002
            assert t1 - t0 >= 1.498  # step_ms in all


def test_hold_gil_blocks_other_threads():
    with Ticker() as ticker:
        t0 = time.perf_counter()
        held = hold_gil(0.15)
        assert held >= 0.09
        assert ticker.longest_gap(t0, time.perf_counter()) >= 0.09


def test_host_longer_than_device_makes_a_host_bound_step():
    t0 = time.thread_time()
    held, slept = SimulatedStep(step_ms=5, host_ms=20).run()
    # host_ms is CPU time of this thread, calibrated once: on a shared core +-50% (13 ms seen in a CI run)
    assert time.thread_time() - t0 >= 0.010
    assert held >= 0.010 and slept < 0.003  # held > step_ms: nothing left to sleep, the step is host-bound


def test_pure_sleep_without_host_time_and_validation():
    with Ticker() as ticker:
        t0 = time.perf_counter()
        held, slept = SimulatedStep(step_ms=600).run()
        # the ticker ran all along: its longest pause is far below the 600 ms a held GIL would cause
        # (0.3 s leaves room for a loaded machine's scheduling stalls)
        assert held == 0 and ticker.longest_gap(t0, t0 + slept) < 0.3
    assert build_model("simulated", num_classes=2, step_ms=10, host_ms=3) == SimulatedStep(10, 3)
    with pytest.raises(ValueError, match="host_ms must be >= 0"):
        SimulatedStep(10, -1)
