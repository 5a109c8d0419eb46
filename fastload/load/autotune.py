"""A thread loader that sizes itself while it trains: ``DataLoader(backend="threads", num_workers="auto")``.

Owns: the controller (``AutoTuner``) and its policy, the options (``AutotuneOptions``), what one
measured window is (``Window``) and what was decided on it (``Decision``), and the meter the
thread iterator feeds (``WindowMeter``). The iterator (``threads.py``) measures and applies;
this module only decides, so the policy is tested by feeding it windows, without timing.

What is measured, per window of batches in the training thread: the wall time between batches
handed out, the part of it spent waiting inside ``next()`` (the data wait), the process's CPU
time (loader threads and the step together) and the training thread's own CPU time outside
``next()`` (the step's host work).

The policy: the smallest thread count and prefetch depth that keep the data wait under
``target_wait`` (2 %), never starving the step of CPU.

* Data wait above the target: one more thread, when at least ``headroom`` CPUs were idle in the
  window (another thread then runs on a free core, not on the step's); with no CPU free, one
  more batch of prefetch depth instead (absorbs uneven batches, costs no CPU); at both limits,
  hold. Right after a shrink, the shrink is undone instead, and the setting before it becomes
  the floor (the smallest that kept the wait under the target) for the next settled stretch.
* Data wait under half the target: one thread fewer (then one batch less depth), down to the
  floor. Fewer threads leave the step the CPU and the GIL, which matters when the step is slow.
* In between: hold. Windows start at ``first_window`` batches while the setting moves and
  double on every hold up to ``window`` (a few hundred batches); at that length the floor
  is forgotten, so a step that got slower is followed down again.

Every decision is logged (logger ``fastload``, INFO when the setting changes, DEBUG on a hold)
and kept in ``AutoTuner.decisions``, which ``fastload profile`` reports with the loader.

Must not: start or stop threads, time anything, or read the clock (the iterator and the
meter do that).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

__all__ = ["AutotuneOptions", "Window", "Decision", "AutoTuner", "WindowMeter"]

log = logging.getLogger("fastload")


@dataclass(frozen=True, kw_only=True)
class AutotuneOptions:
    """How the thread loader sizes itself.

    Args:
        target_wait: the data wait (share of the loop's wall time) to stay under.
        first_window: batches per window while the setting is moving.
        window: batches per window once settled (windows double from ``first_window`` up to it).
        min_threads, max_threads: the thread count's range (``max_threads`` None: the CPUs this
            process may use).
        min_depth, max_depth: the prefetch depth's range (batches being filled ahead).
        headroom: idle CPUs a window must show before another thread is started.
    """

    target_wait: float = 0.02
    first_window: int = 16
    window: int = 256
    min_threads: int = 1
    max_threads: int | None = None
    min_depth: int = 2
    max_depth: int = 8
    headroom: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.target_wait < 1.0:
            raise ValueError(f"target_wait must be in (0, 1), got {self.target_wait!r}")
        if not 1 <= self.first_window <= self.window:
            raise ValueError(f"1 <= first_window <= window is required, got {self.first_window}, {self.window}")
        if self.min_threads < 1 or (self.max_threads is not None and self.max_threads < self.min_threads):
            raise ValueError(f"1 <= min_threads <= max_threads is required, got {self.min_threads}, "
                             f"{self.max_threads}")
        if not 1 <= self.min_depth <= self.max_depth:
            raise ValueError(f"1 <= min_depth <= max_depth is required, got {self.min_depth}, {self.max_depth}")
        if self.headroom < 0:
            raise ValueError(f"headroom must be >= 0, got {self.headroom!r}")


@dataclass(frozen=True)
class Window:
    """What the thread iterator measured over ``batches`` batches (seconds)."""

    batches: int
    wall_s: float  # from the first batch handed out to the last
    wait_s: float  # of which inside next(), waiting for a batch
    process_cpu_s: float  # CPU time of the whole process (loader threads and the step)
    step_cpu_s: float  # CPU time of the training thread outside next()

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy_cpus(self) -> float:
        return self.process_cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def step_cpus(self) -> float:
        return self.step_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """One decision: the setting it leaves, what it did and why, and the window it was made on."""

    threads: int
    depth: int
    action: str  # "grow", "deepen", "shrink", "shallow", "undo", "hold"
    reason: str
    wait_fraction: float
    busy_cpus: float  # CPUs the whole process used in the window
    step_cpus: float  # of which the training thread outside next() (the step's host work)
    batch: int  # batches handed out in this loader's life when it was made

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class AutoTuner:
    """The controller: fed one ``Window`` at a time, it returns the setting to run next.

    The loader keeps one for its life (the setting learned in one epoch starts the next).
    Subclass and override ``decide`` for another policy; ``observe`` records and logs.

    Args:
        threads, depth: the setting to start from.
        cpus: the CPUs this process may use (``fastload.system.available_cpus()``).
        options: ``AutotuneOptions``.
    """

    threads: int
    depth: int
    cpus: int
    options: AutotuneOptions = field(default_factory=AutotuneOptions)
    decisions: list[Decision] = field(default_factory=list)
    next_window: int = 0  # batches in the next window (0: options.first_window)
    batches: int = 0
    _floor: tuple[int, int] | None = None  # the smallest setting known to keep the wait under target
    _before_shrink: tuple[int, int] | None = None
    meter: WindowMeter = field(default_factory=lambda: WindowMeter(), repr=False, compare=False)

    def __post_init__(self) -> None:
        o = self.options
        self.threads = min(max(self.threads, o.min_threads), self.max_threads)
        self.depth = min(max(self.depth, o.min_depth), o.max_depth)
        self.next_window = self.next_window or o.first_window

    @property
    def max_threads(self) -> int:
        return self.options.max_threads if self.options.max_threads is not None else max(1, self.cpus)

    def decide(self, w: Window) -> Decision:
        """The policy (module docstring), without side effects other than the tuner's own memory."""
        o = self.options
        wait, busy = w.wait_fraction, w.busy_cpus
        free = self.cpus - busy
        t, d = self.threads, self.depth
        pct = f"data wait {wait:.1%}"

        def out(action: str, threads: int, depth: int, reason: str) -> Decision:
            return Decision(threads, depth, action, reason, wait, busy, w.step_cpus, self.batches)

        if wait > o.target_wait:
            if self._before_shrink is not None:
                back = self._before_shrink
                self._floor, self._before_shrink = back, None
                return out("undo", *back, f"{pct} > {o.target_wait:.0%} after shrinking: back to {back[0]} "
                           f"thread(s), depth {back[1]}, the smallest that kept it under")
            self._floor = None
            if t < self.max_threads and free >= o.headroom:
                return out("grow", t + 1, d, f"{pct} > {o.target_wait:.0%}, {free:.1f} of {self.cpus} CPUs idle")
            if d < o.max_depth:
                why = (f"{free:.1f} of {self.cpus} CPUs idle (another thread would take the step's)"
                       if t < self.max_threads else f"at max_threads={self.max_threads}")
                return out("deepen", t, d + 1, f"{pct} > {o.target_wait:.0%}, {why}: one batch more ahead")
            return out("hold", t, d, f"{pct} > {o.target_wait:.0%}, at the limits (threads {t}, depth {d}, "
                       f"{free:.1f} CPUs idle)")
        self._before_shrink = None
        if wait < o.target_wait / 2:
            floor_t, floor_d = self._floor or (o.min_threads, o.min_depth)
            if t > max(o.min_threads, floor_t):
                self._before_shrink = (t, d)
                return out("shrink", t - 1, d, f"{pct} < {o.target_wait / 2:.0%}: trying one thread fewer")
            if d > max(o.min_depth, floor_d) and t == max(o.min_threads, floor_t):
                self._before_shrink = (t, d)
                return out("shallow", t, d - 1, f"{pct} < {o.target_wait / 2:.0%}: trying one batch less ahead")
        return out("hold", t, d, f"{pct}, {busy:.1f} of {self.cpus} CPUs busy ({w.step_cpus:.1f} the step's)")

    def observe(self, w: Window) -> Decision:
        """Decide on ``w``, take the setting, size the next window, record and log the decision."""
        self.batches += w.batches
        d = self.decide(w)
        d = Decision(d.threads, d.depth, d.action, d.reason, d.wait_fraction, d.busy_cpus, d.step_cpus, self.batches)
        self.threads, self.depth = d.threads, d.depth
        o = self.options
        if d.action == "hold":
            self.next_window = min(o.window, self.next_window * 2)
            if self.next_window == o.window:
                self._floor = None  # settled: look for a smaller setting again next time
        else:
            self.next_window = o.first_window
        self.decisions.append(d)
        log.log(logging.DEBUG if d.action == "hold" else logging.INFO,
                "fastload: autotune after %d batches: %s -> %d thread(s), prefetch depth %d (%s)",
                self.batches, d.action, d.threads, d.depth, d.reason)
        return d


class WindowMeter:
    """The clocks of a loader's training thread: call ``called()`` on entering ``next()`` and
    ``returned()`` before handing the batch out; ``returned`` gives a ``Window`` once
    ``batches`` batches have been handed out since the last one.

    It lives with the loader's tuner, so a window runs on across epochs (an epoch shorter than a
    window, say 12 batches of 64 from 800 images, would otherwise never end one); each new
    iterator calls ``epoch_started()``, and the time to its first batch (starting threads,
    filling the queue) is left out of the window, as the very first start-up is.
    """

    def __init__(self) -> None:
        self._start: tuple[float, float] | None = None  # (wall, process CPU) at this stretch's first hand-out
        self._last: tuple[float, float] | None = None  # ... at its latest hand-out
        self._last_return: float | None = None  # training thread's CPU time when next() last returned
        self._entered = (0.0, 0.0)
        self.batches = 0
        self.wait_s = self.step_cpu_s = 0.0
        self.wall_s = self.cpu_s = 0.0  # of the stretches of this window in earlier epochs
        self._step_at_last = 0.0  # step_cpu_s as of the latest hand-out (where a stretch closes)

    def epoch_started(self) -> None:
        """A new iterator: close this window's stretch at its latest hand-out; the next one starts at
        the new epoch's first hand-out."""
        if self._start is not None and self._last is not None:
            self.wall_s += self._last[0] - self._start[0]
            self.cpu_s += self._last[1] - self._start[1]
        # the step after the epoch's last batch (counted by the next() that ended it) lies past the close
        self.step_cpu_s = self._step_at_last
        self._start = self._last = self._last_return = None

    def called(self) -> None:
        self._entered = (time.perf_counter(), time.thread_time())
        if self._last_return is not None:
            self.step_cpu_s += self._entered[1] - self._last_return

    def returned(self, batches: int) -> Window | None:
        now, cpu = time.perf_counter(), time.process_time()
        self._last_return = time.thread_time()
        if self._start is None:  # the first hand-out starts the stretch (the first wait is the start-up)
            self._start = self._last = (now, cpu)
            self._step_at_last = self.step_cpu_s
            return None
        self._last = (now, cpu)
        self.wait_s += now - self._entered[0]
        self.batches += 1
        self._step_at_last = self.step_cpu_s
        if self.batches < batches:
            return None
        w = Window(self.batches, self.wall_s + now - self._start[0], self.wait_s,
                   self.cpu_s + cpu - self._start[1], self.step_cpu_s)
        self._start, self.batches, self.wait_s, self.step_cpu_s = (now, cpu), 0, 0.0, 0.0
        self.wall_s = self.cpu_s = self._step_at_last = 0.0
        return w
