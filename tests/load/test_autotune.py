"""The thread loader's autotuner: its policy fed measured windows (no timing), and the real
pool growing and shrinking within an epoch without losing, repeating or reordering samples."""

from __future__ import annotations

import logging

import pytest
import torch

from fastload.load.autotune import AutotuneOptions, AutoTuner, Decision, Window
from fastload.load.dataset import LMDBImageDataset
from fastload.load.loader import DataLoader
from fastload.load.transforms import train_transform


def window(wait: float, busy: float = 1.0, step_cpu: float = 0.5, batches: int = 16) -> Window:
    """A window of 1 s wall time: ``wait`` of it waiting for data, ``busy`` CPUs used by the process."""
    return Window(batches=batches, wall_s=1.0, wait_s=wait, process_cpu_s=busy, step_cpu_s=step_cpu)


def tuner(threads=2, depth=2, cpus=4, **kw) -> AutoTuner:
    return AutoTuner(threads=threads, depth=depth, cpus=cpus, options=AutotuneOptions(**kw))


def test_waiting_with_idle_cpus_grows_the_pool():
    t = tuner(threads=2, cpus=4)
    d = t.observe(window(wait=0.10, busy=2.0))
    assert (d.action, d.threads, d.depth) == ("grow", 3, 2) and t.threads == 3
    assert t.next_window == t.options.first_window


def test_waiting_without_idle_cpu_deepens_instead_of_taking_the_steps_cpu():
    t = tuner(threads=2, cpus=2, headroom=0.5)
    d = t.observe(window(wait=0.10, busy=1.8))  # 0.2 CPU idle: another thread would take the step's
    assert (d.action, d.threads, d.depth) == ("deepen", 2, 3)
    t = tuner(threads=2, depth=8, cpus=2, max_depth=8)
    assert t.observe(window(wait=0.10, busy=2.0)).action == "hold"  # at both limits


def test_never_grows_past_max_threads():
    t = tuner(threads=4, cpus=4)
    d = t.observe(window(wait=0.5, busy=0.5))
    assert (d.action, d.threads, d.depth) == ("deepen", 4, 3)


def test_little_wait_shrinks_to_the_smallest_setting_that_keeps_it_under_the_target():
    t = tuner(threads=4, cpus=4)
    assert t.observe(window(wait=0.001)).action == "shrink" and t.threads == 3
    assert t.observe(window(wait=0.002)).action == "shrink" and t.threads == 2
    d = t.observe(window(wait=0.08))  # 2 threads are too few: back to 3, and 3 is the floor
    assert (d.action, d.threads) == ("undo", 3)
    d = t.observe(window(wait=0.001))
    assert (d.action, d.threads) == ("hold", 3)  # not below the floor while it is known
    # at the minimum thread count the depth goes down, then holds
    t = tuner(threads=1, depth=3, cpus=4)
    assert t.observe(window(wait=0.0)).action == "shallow" and t.depth == 2
    assert t.observe(window(wait=0.0)).action == "hold" and (t.threads, t.depth) == (1, 2)


def test_holding_doubles_the_window_and_a_settled_tuner_probes_again():
    t = tuner(threads=1, cpus=4, first_window=16, window=64)
    sizes = []
    for _ in range(3):
        t.observe(window(wait=0.015))  # between half the target and the target: hold
        sizes.append(t.next_window)
    assert sizes == [32, 64, 64]
    t = tuner(threads=3, cpus=4, first_window=16, window=32)
    t.observe(window(wait=0.0)), t.observe(window(wait=0.05))  # shrink to 2, undo to 3: floor 3
    t.observe(window(wait=0.0))  # hold at the floor; window 32 = settled: the floor is forgotten
    assert t.observe(window(wait=0.0)).action == "shrink"


def test_decisions_are_logged_and_recorded(caplog):
    t = tuner(threads=2, cpus=4)
    with caplog.at_level(logging.INFO, logger="fastload"):
        t.observe(window(wait=0.10, busy=2.0, batches=16))
    assert t.decisions[0].batch == 16 and t.decisions[0].as_dict()["action"] == "grow"
    assert "autotune after 16 batches: grow -> 3 thread(s)" in caplog.text


def test_options_and_loader_arguments_are_checked(tiny_store):
    with pytest.raises(ValueError, match="first_window"):
        AutotuneOptions(first_window=300, window=200)
    ds = LMDBImageDataset(tiny_store, transform=train_transform(32))
    with pytest.raises(ValueError, match="HINT: DataLoader"):
        DataLoader(ds, batch_size=4, num_workers=2, autotune=True)  # processes
    with pytest.raises(ValueError, match="argument autotune"):
        DataLoader(ds, batch_size=4, num_workers=2, backend="threads", autotune="yes")
    assert DataLoader(ds, batch_size=4, num_workers="auto", backend="threads").autotuner is not None
    assert DataLoader(ds, batch_size=4, num_workers=2, backend="threads").autotuner is None
    assert DataLoader(ds, batch_size=4, num_workers="auto", backend="threads", autotune=False).autotuner is None


class Scripted(AutoTuner):
    """A policy that plays a fixed list of settings, one per window: the pool's resizing without timing."""

    def __init__(self, plan: list[tuple[int, int]], **kw) -> None:
        super().__init__(threads=1, depth=2, cpus=4, options=AutotuneOptions(first_window=1, window=1), **kw)
        self.plan = list(plan)

    def decide(self, w: Window) -> Decision:
        threads, depth = self.plan.pop(0) if self.plan else (self.threads, self.depth)
        return Decision(threads, depth, "grow" if threads > self.threads else "shrink", "scripted",
                        w.wait_fraction, w.busy_cpus, w.step_cpus, 0)


def loader(store, tuner_=None, workers=1):
    ds = LMDBImageDataset(store, transform=train_transform(32))
    return DataLoader(ds, batch_size=2, shuffle=True, num_workers=workers, backend="threads",
                      generator=torch.Generator().manual_seed(5), autotune=tuner_ if tuner_ is not None else False)


def test_the_pool_grows_and_shrinks_within_an_epoch_and_the_batches_stay_the_same(tiny_store):
    expected = [(x.clone(), y.clone()) for x, y in loader(tiny_store)]
    plan = [(3, 4), (4, 5), (2, 3), (1, 2), (3, 2), (1, 2)]
    ld = loader(tiny_store, Scripted(plan))
    it = iter(ld)
    sizes, got = [], []
    for x, y in it:
        got.append((x.clone(), y.clone()))
        sizes.append((it.pool_size, it._depth))
    assert sizes[:6] == [(1, 2), (3, 4), (4, 5), (2, 3), (1, 2), (3, 2)]  # the first hand-out starts the meter
    assert len(got) == len(expected)
    for (a, b), (c, d) in zip(got, expected):  # no sample lost, repeated or reordered; the same crops
        assert torch.equal(a, c) and torch.equal(b, d)
    assert [d["threads"] for d in ld.autotune_decisions][:6] == [3, 4, 2, 1, 3, 1]


def test_exact_resume_mid_epoch_with_the_pool_resizing(tiny_store):
    expected = [(x.clone(), y.clone()) for x, y in loader(tiny_store)]
    ld = loader(tiny_store, Scripted([(3, 3), (1, 2), (4, 6)]))
    it = iter(ld)
    for _ in range(5):
        next(it)
    state = ld.state_dict()
    it.close()
    resumed = loader(tiny_store, Scripted([(2, 2), (4, 3), (1, 2)]))
    resumed.load_state_dict(state)
    rest = [(x.clone(), y.clone()) for x, y in resumed]
    assert len(rest) == len(expected) - 5
    for (a, b), (c, d) in zip(rest, expected[5:]):
        assert torch.equal(a, c) and torch.equal(b, d)


def test_the_meter_ends_a_window_every_n_batches_after_the_first_hand_out():
    from fastload.load.autotune import WindowMeter

    meter = WindowMeter()
    got = []
    for _ in range(7):
        meter.called()
        got.append(meter.returned(3))
    assert [w is not None for w in got] == [False, False, False, True, False, False, True]
    w = got[3]
    assert w.batches == 3 and 0 <= w.wait_s <= w.wall_s and w.process_cpu_s >= 0 and w.step_cpu_s >= 0


def test_a_shrunk_pool_ends_its_surplus_threads_after_their_task_and_runs_every_task():
    import threading
    import time

    from fastload.load.threads import _Pool

    pool = _Pool(3, threading.Event())
    first = list(pool.threads)
    done, lock = [], threading.Lock()

    def task(i):
        with lock:
            done.append(i)

    try:
        pool.resize(1)
        assert pool.size == 1
        for i in range(20):
            pool.submit(task, i)
        deadline = time.monotonic() + 10  # a bound for a loaded machine, not a timing assertion
        while (len(pool.threads) > 1 or len(done) < 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(done) == list(range(20)) and len(pool.threads) == 1
        for t in first:
            if t not in pool.threads:
                t.join(10)
        assert sum(t.is_alive() for t in first) == 1  # the two surplus threads really ended
        pool.resize(4)  # grows at once: new threads, new names
        assert pool.size == 4 and [t.name for t in pool.threads][1:] == [f"fastload-loader-{k}" for k in (3, 4, 5)]
    finally:
        pool.close()


def test_a_window_runs_on_across_epochs_and_leaves_each_epochs_start_up_out(monkeypatch):
    import fastload.load.autotune as at

    clock = {"wall": 0.0, "cpu": 0.0, "thread": 0.0}
    monkeypatch.setattr(at.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(at.time, "process_time", lambda: clock["cpu"])
    monkeypatch.setattr(at.time, "thread_time", lambda: clock["thread"])
    meter = at.WindowMeter()

    def step() -> None:  # the training step: 2 s of wall, 1 s of it the training thread's CPU
        clock["wall"] += 2.0
        clock["cpu"] += 1.0
        clock["thread"] += 1.0

    def batch(wait: float) -> Window | None:
        meter.called()
        clock["wall"] += wait
        clock["cpu"] += wait
        return meter.returned(4)

    got = []
    for epoch in range(2):  # epochs of 3 batches, a window of 4: it ends only in the second epoch
        meter.epoch_started()
        clock["wall"] += 100.0  # between epochs: start-up, not the loop's
        for k in range(3):
            got.append(batch(1.0 if k else 50.0))
            step()
        meter.called()  # the next() that finds the epoch over
    assert [w is not None for w in got] == [False, False, False, False, False, True]
    w = got[-1]  # batches 2, 3 of the first epoch and 2, 3 of the second; no first waits, no gap
    assert w.batches == 4 and w.wait_s == 4.0 and w.wall_s == 12.0
    # the steps before those four hand-outs (after the first epoch's last one: not in the window)
    assert w.process_cpu_s == 8.0 and w.step_cpu_s == 4.0 and w.step_cpu_s <= w.process_cpu_s


def test_a_loader_whose_epochs_are_shorter_than_a_window_still_decides(tiny_store):
    ld = loader(tiny_store, AutoTuner(threads=1, depth=2, cpus=2, options=AutotuneOptions(first_window=16)))
    per_epoch = len(ld)
    assert per_epoch < 16
    for _ in range(-(-40 // (per_epoch - 1))):  # about 40 counted batches over several epochs
        for _ in ld:
            pass
    assert ld.autotune_decisions  # before the meter lived on the tuner, none: no epoch reached 16
