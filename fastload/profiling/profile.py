"""``fastload profile -- COMMAND``, ``watch()`` and ``profile()``: where the user's own training step waits.

Owns: running the user's unmodified command with the probe injected, the headspace rerun,
merging the per-rank files, and the outputs (``profile.json``, ``profile.png``,
``trace.json``, ``kineto-rank<R>.json`` on CUDA, optional TensorBoard scalars); and the
in-script faces ``watch(loader)`` and ``with profile(out=...) as p``.

Injection: the child gets ``fastload/profiling/_inject`` first on ``PYTHONPATH`` (the user's
PYTHONPATH kept after it). Python imports ``sitecustomize`` from there at start-up in
every interpreter the command starts (``python train.py``, ``python -m pkg.train``,
``torchrun`` and each of its ranks, spawned DataLoader workers); it imports the user's
own ``sitecustomize`` if there is one, then the probe (``_probe.py``) patches
``torch.utils.data.DataLoader.__iter__`` when torch's dataloader module is imported. No
user file is edited. The GPU timeline on CUDA comes from ``torch.profiler`` (Kineto) for a
window of steps: a maintained tracer that sees every kernel and copy of the process,
which CUDA events around our own code cannot; two CUDA events per step at the hand-off
(as ``next()`` starts and returns) add the idle each wait caused, on every step.
psutil reads the workers' CPU time (portable across Linux/macOS, where ``/proc`` parsing
by hand would not be); without it the worker CPU figures are left out. Interval arithmetic: ``_kineto.py``; the
verdict and gain model: ``_profile_report.py``.

The command runs in its own process group: SIGTERM, SIGINT and SIGHUP sent to ``fastload
profile`` are passed to that group (the script, its DataLoader workers, torchrun's ranks), which
gets ``GRACE_S`` to end before it is killed; what was measured is then written all the same, and
``fastload profile`` exits with the command's status. ``--verify-fix`` reruns the command with the
top change applied to the training loader from outside (``_probe.APPLICABLE``; the uint8 presets on a
torchvision ImageFolder: ``_uint8.py``) and compares (``compare.py``) with the prediction for
what the rerun applied (``_recommend.verify_prediction``). ``_MachineLoad`` measures what other processes
took of the CPUs while the command ran, for the verdict on a shared machine; the store advice's preset is
timed on the user's own files in this process after the run (``summarize_dir``).

Must not: edit the user's files, import torch at import time, or print (the CLI prints).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.errors import MissingDependencyError, ProfileError
from fastload.profiling import _probe
from fastload.profiling import _profile_report as report
from fastload.profiling import _recommend

__all__ = ["ProfileOptions", "run_profile", "watch", "profile", "Profile", "summarize_dir", "format_summary",
           "INJECT_DIR"]

INJECT_DIR = Path(__file__).resolve().parent / "_inject"
GRACE_S = 10.0  #: after a forwarded SIGTERM/Ctrl-C, how long the command may take to end before SIGKILL
format_summary = report.format_summary


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How ``fastload profile`` runs the command.

    Args:
        out: output folder [default: ``runs/profile-<timestamp>``].
        steps: measured steps after warm-up, then the command is ended (None: no step limit).
        seconds: measured seconds after warm-up, then the command is ended (None: no time budget); with
            the default a profile ends in well under a minute.
        verify_fix: rerun the command with the top applicable recommendation applied from outside
            (worker count, pin_memory, the uint8 presets on a torchvision ImageFolder) and report predicted
            vs measured.
        verify_change: with ``verify_fix``, verify this change instead of the top one (one of
            ``_probe.APPLICABLE``): the top recommendation that makes it, else its prediction.
        warmup: steps not measured (worker start-up, cudnn autotuning, caches).
        headspace: rerun with the training loader replaying its first batches from memory.
        kineto_steps: on CUDA, steps traced with torch.profiler (0: no GPU timeline).
        tensorboard: also write per-step scalars there (needs the ``tensorboard`` package).
    """

    out: Path | None = None
    steps: int | None = 200
    seconds: float | None = 30.0
    warmup: int = 5
    headspace: bool = False
    kineto_steps: int = 20
    tensorboard: Path | None = None
    verify_fix: bool = False
    verify_change: str | None = None

    def __post_init__(self) -> None:
        if self.verify_change is not None and self.verify_change not in _probe.APPLICABLE:
            raise ValueError(f"verify_change must be one of {_probe.APPLICABLE} or None, got {self.verify_change!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 or None, got {self.steps}")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0 or None, got {self.seconds}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.kineto_steps < 0:
            raise ValueError(f"kineto_steps must be >= 0, got {self.kineto_steps}")


def _require_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise MissingDependencyError("--tensorboard needs the tensorboard package: pip install tensorboard")


def _child_env(out: Path, options: ProfileOptions, replay_key: str | None,
               apply: dict[str, Any] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[_probe.ENV_OUT] = str(out.resolve())
    env[_probe.ENV_WARMUP] = str(options.warmup)
    env[_probe.ENV_KINETO] = str(options.kineto_steps)
    if options.steps is not None:
        env[_probe.ENV_STEPS] = str(options.steps)
    else:
        env.pop(_probe.ENV_STEPS, None)
    for name, value in ((_probe.ENV_REPLAY, replay_key), (_probe.ENV_BUDGET, options.seconds),
                        (_probe.ENV_APPLY, json.dumps(apply) if apply else None)):
        if value:
            env[name] = str(value)
        else:
            env.pop(name, None)
    return env


def exit_status(rc: int) -> int:
    """A shell's exit status for a ``Popen.returncode`` (killed by signal N: 128 + N)."""
    return 128 - rc if rc < 0 else rc


class _Terminal:
    """The command runs in its own process group (so a signal can reach it and its workers and ranks
    together); when we own the terminal, that group gets it as the foreground, as a shell does, so the
    command can still read the terminal (``breakpoint()``) and a terminal's Ctrl-C reaches it directly."""

    def __init__(self, pgid: int) -> None:
        self.fd: int | None = None
        try:
            import sys

            fd = sys.stdin.fileno()
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                os.tcsetpgrp(fd, pgid)
                self.fd = fd
        except (OSError, ValueError, AttributeError):
            self.fd = None

    def restore(self) -> None:
        if self.fd is None:
            return
        old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we are a background group until this returns
        try:
            os.tcsetpgrp(self.fd, os.getpgrp())
        except OSError:
            pass
        finally:
            signal.signal(signal.SIGTTOU, old)


class _MachineLoad:
    """What other processes took of this process's CPUs while the command ran: the busy time of the CPUs it may
    use (psutil, per CPU) minus the CPU time of the command's whole process tree (``RUSAGE_CHILDREN``: the script,
    its DataLoader workers, torchrun's ranks, once reaped) and of this process, over the wall time; and the load
    average at the end. None without psutil (an optional dependency)."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:
            self.start = None
            return
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.start = (time.monotonic(), self._busy(psutil), self._ours())

    def _busy(self, psutil) -> float:
        per = psutil.cpu_times(percpu=True)
        chosen = [per[i] for i in self.cpus if i < len(per)] if self.cpus else per
        fields = ("user", "nice", "system", "irq", "softirq", "steal")
        return sum(getattr(t, f, 0.0) for t in chosen for f in fields)

    @staticmethod
    def _ours() -> float:
        import resource

        kids, me = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
        return kids.ru_utime + kids.ru_stime + me.ru_utime + me.ru_stime

    def end(self) -> dict[str, Any] | None:
        if self.start is None:
            return None
        import psutil

        t0, busy0, ours0 = self.start
        wall = time.monotonic() - t0
        if wall <= 0:
            return None
        ours = max(0.0, self._ours() - ours0)
        other = max(0.0, self._busy(psutil) - busy0 - ours)
        return {"other_cpus": other / wall, "own_cpus": ours / wall, "cpus": len(self.cpus or psutil.cpu_times(
            percpu=True)), "wall_s": wall, "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def _run_child(command: Sequence[str], env: dict[str, str]) -> tuple[int, list[int]]:
    """Run the command in its own process group; return its ``returncode`` and the signals we forwarded.

    SIGTERM, SIGINT and SIGHUP sent to ``fastload profile`` go to the command's whole process group (its
    DataLoader workers and torchrun's ranks included); the command then has ``GRACE_S`` to write its
    results and end before the group is killed, so the caller can still write what was measured.
    """
    import threading

    try:
        proc = subprocess.Popen(list(command), env=env, process_group=0)
    except FileNotFoundError as exc:
        raise ProfileError(f"cannot run {command[0]!r}: not found\nHINT: give the command after `--`, "
                           "e.g. fastload profile -- python train.py") from exc
    except PermissionError as exc:
        raise ProfileError(f"cannot run {command[0]!r}: {exc}") from exc
    terminal = _Terminal(proc.pid)
    forwarded: list[int] = []
    deadline: list[float] = []

    def forward(signum, frame) -> None:
        forwarded.append(signum)
        if not deadline:
            deadline.append(time.monotonic() + GRACE_S)
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)} \
        if main else {}
    try:
        while True:
            try:
                return proc.wait(timeout=0.2), forwarded
            except subprocess.TimeoutExpired:
                if deadline and time.monotonic() > deadline[0]:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        proc.kill()
                    deadline[0] = float("inf")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        terminal.restore()


def summarize_dir(out: Path, machine_load: dict[str, Any] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Per-rank figures and the merged summary (verdict, recommendations, machine) from an out dir.

    ``machine_load``: what other processes took of the CPUs during the run (``_MachineLoad``); the store
    advice's preset timing on the user's own files (``_uint8.time_presets``) runs here, in this process.

    Raises:
        ProfileError: no probe file there, or no loader yielded a batch.
    """
    from fastload.load.workers import worker_plan
    from fastload.measure.doctor import doctor_report

    ranks, samples = report.read_files(out)
    ranks = {r: p for r, p in ranks.items() if any(t["steps"] for t in p["tracks"])}
    if not ranks:
        failures = sorted({p.read_text() for p in out.glob("failure-rank*.txt")})
        if failures:  # the probe's own check stopped the script (num_workers="auto" given to torch's DataLoader)
            raise ProfileError(f"{out}: the command ran no measured loader steps: " + "\n".join(failures))
        raise ProfileError(f"{out}: the command ran no measured loader steps (no DataLoader iterated to a second "
                           "batch).\nHINT: a custom loader that is not a torch DataLoader needs "
                           "`for batch in fastload.watch(loader):` in the script")
    figs = [report.rank_figures(p, samples.get(r, [])) for r, p in sorted(ranks.items())]
    summary = report.merge_ranks(figs)
    machine = doctor_report()
    first = ranks[min(ranks)]
    local = first["local_world_size"]
    plan = worker_plan(env={"LOCAL_WORLD_SIZE": str(local)})
    summary["machine_load"] = machine_load
    folder = summary["loader"].get("image_folder") or {}
    if folder.get("preset") and folder.get("files"):
        from fastload.profiling import _uint8

        summary["presets_measured"] = _uint8.time_presets(folder["files"], folder["preset"])
    verdict, recs = _recommend.recommend(summary, plan_workers=plan.workers, has_gpu=bool(machine["gpus"]))
    summary.update(verdict=verdict, recommendations=recs, local_world_size=local,
                   machine={"cpus": machine["cpus"], "gpus": machine["gpus"], "local_world_size": local,
                            "recommended_workers": plan.workers, "versions": machine["environment"],
                            "dali_available": machine["dali_available"]})
    return figs, summary


def _write(out: Path, figs: list[dict], summary: dict[str, Any], tensorboard: Path | None) -> list[str]:
    notes = []
    (out / "trace.json").write_text(json.dumps(report.chrome_trace(figs)))
    note = report.plot(figs, summary, out / "profile.png")
    if note:
        notes.append(note)
    if tensorboard is not None:
        report.write_tensorboard(figs, tensorboard)
    summary["files"] = sorted({p.name for p in out.iterdir() if p.suffix in (".json", ".png")
                               and not p.name.startswith(("probe-", "samples-"))} | {"profile.json"})
    (out / "profile.json").write_text(json.dumps(summary, indent=1))
    return notes


def run_profile(command: Sequence[str], options: ProfileOptions = ProfileOptions()) -> dict[str, Any]:
    """Run ``command`` with the probe injected; write the outputs; return the ``profile.json`` content.

    Raises:
        ProfileError: no command, it could not start, or it ran no loader steps.
        MissingDependencyError: ``tensorboard`` was asked for and is not installed.
    """
    if not command:
        raise ProfileError("no command to profile\nHINT: fastload profile -- python train.py --epochs 1")
    if options.tensorboard is not None:
        _require_tensorboard()
    out = options.out or Path("runs") / time.strftime("profile-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    _clear(out)
    load = _MachineLoad()
    rc, forwarded = _run_child(command, _child_env(out, options, None))
    status = exit_status(rc)
    try:
        figs, summary = summarize_dir(out, load.end())
    except ProfileError as exc:
        if status == 0:
            raise
        raise ProfileError(f"{exc}\n(the command exited with status {status}: see its output above)",
                           exit_status=status) from exc
    summary["command"] = list(command)
    summary["exit_status"] = status
    summary["options"] = {"steps": options.steps, "seconds": options.seconds, "warmup": options.warmup,
                          "kineto_steps": options.kineto_steps, "headspace": options.headspace}
    if forwarded:
        names = ", ".join(sorted({signal.Signals(s).name for s in forwarded}))
        summary["notes"].append(f"fastload profile received {names}: passed to the command's process group; "
                                "these are the steps measured until it ended")
    if status != 0 and summary["ended"] in ("exit", "abrupt"):
        summary["notes"].append(f"the command exited with status {status}"
                                + (" before writing its results: the steps are read from the per-step file"
                                   if summary["ended"] == "abrupt" else ""))
    if options.headspace and not forwarded:
        hdir = out / "headspace"
        hdir.mkdir(exist_ok=True)
        _clear(hdir)
        hopts = ProfileOptions(steps=options.steps, seconds=options.seconds, warmup=max(1, options.warmup),
                               kineto_steps=0)
        _run_child(command, _child_env(hdir, hopts, summary["loader"]["key"]))
        _, hs = summarize_dir(hdir)
        measured = summary["images_per_s"]
        summary["headspace"] = {"images_per_s": hs["images_per_s"], "steps": hs["steps"],
                                "data_wait_fraction": hs["data_wait_fraction"],
                                "ratio": hs["images_per_s"] / measured if measured else 0.0,
                                "replayed_batches": max(1, min(hopts.warmup, 32))}
    if options.verify_fix and not forwarded:
        summary["verify_fix"] = _verify_fix(command, out, options, summary)
    summary["notes"].extend(_write(out, figs, summary, options.tensorboard))
    summary["out"] = str(out)
    return summary


def _clear(out: Path) -> None:
    for pattern in ("probe-rank*.json", "samples-rank*.json", "steps-rank*.jsonl", "failure-rank*.txt"):
        for stale in out.glob(pattern):
            stale.unlink()


VERIFY_ROUNDS = 2  #: --verify-fix: baseline/changed rounds, interleaved (the profile itself is the first baseline)


def _verify_fix(command: Sequence[str], out: Path, options: ProfileOptions, summary: dict[str, Any]) -> dict:
    """Rerun with the top change fastload can apply from outside; predicted vs measured images/s.

    The runs interleave, A1 (the profile) B1 A2 B2, and the measured ratio is judged against the spread
    across rounds and the baseline's drift (``compare_rounds``), not only the steps' spread within a run.
    When the rerun shows the change was not applied to the training loader, nothing is compared: a ratio
    between two runs of the same code is the machine's load changing, not the change.
    """
    from fastload.profiling.compare import compare_rounds

    pick = _recommend.change_to_verify(summary, options.verify_change)
    if pick is None:
        if options.verify_change:
            return {"skipped": f"no recommendation or prediction changes {options.verify_change} here"}
        return {"skipped": "no recommendation can be applied from outside the script (only the worker count, "
                           "pin_memory and the uint8 presets on a torchvision ImageFolder can): apply it by hand "
                           "and compare with `fastload profile compare`"}
    vdir = out / "verify"
    vdir.mkdir(exist_ok=True)
    vopts = ProfileOptions(steps=options.steps, seconds=options.seconds, warmup=options.warmup, kineto_steps=0)
    apply = {"key": summary["loader"]["key"], **pick["apply"]}

    def rerun(folder: Path, change: dict[str, Any] | None) -> dict[str, Any]:
        folder.mkdir(exist_ok=True)
        _clear(folder)
        rc, _ = _run_child(command, _child_env(folder, vopts, None, change))
        try:
            _, result = summarize_dir(folder)
        except ProfileError as exc:  # no measured step: a run that failed early, judged by failed() below
            result = {"ended": "exit", "steps": 0, "error": str(exc).splitlines()[0]}
        result["exit_status"], result["out"] = exit_status(rc), str(folder)
        (folder / "profile.json").write_text(json.dumps(result, indent=1))
        return result

    base = {"change": pick["change"], "apply": pick["apply"], "why": pick.get("verify_why", "the top recommendation"),
            # the store's figure is a bound; what --verify-fix checks of it (the presets on the files) is a prediction
            "predicted": pick["expected_gain"],
            "predicted_is_bound": bool(pick.get("bound")) and pick.get("stage") != "store",
            **({"predicted_for": pick["verify_part"]} if pick.get("verify_part") else {}),
            **({"predicted_is_advice": True} if pick.get("advice") else {}),
            "profile": str(vdir / "profile.json")}
    def failed(result: dict[str, Any], which: str) -> dict[str, Any] | None:
        """A rerun that ended on its own with a failure status is no measurement of the change."""
        if result.get("steps", 0) == 0 and result["exit_status"] == 0:
            return {**base, "applied": {}, "measured": None, "outside_noise": None,
                    "failed": f"the {which} run measured no steps ({result.get('error', result['out'])}): nothing is "
                              "compared"}
        if result["exit_status"] == 0 or result.get("ended") not in ("exit", "abrupt"):
            return None
        return {**base, "applied": result.get("applied", {}), "measured": None, "outside_noise": None,
                "failed": f"the {which} run exited with status {result['exit_status']} after {result.get('steps', 0)} "
                          f"measured steps ({result.get('out', '')}): nothing is compared. Run the command with the "
                          "change by hand to see its error"}

    changed = rerun(vdir, apply)
    if (bad := failed(changed, "changed")) is not None:
        return bad
    applied = changed.get("applied", {})
    missing = {k: v for k, v in pick["apply"].items() if not _was_applied(v, applied.get(k))}
    if missing:
        reasons = changed.get("not_applied") or {}
        why = "; ".join(f"{k}: {reasons[k]}" for k in missing if k in reasons)
        return {**base, "applied": applied, "measured": None, "outside_noise": None,
                "not_applied": f"{_describe(missing)} could not be " + (f"applied: {why}. " if why else (
                    f"set on the training loader {summary['loader']['key']} from outside the script (fastload sets "
                    "it where the loader's iterator is made by torch's or fastload's DataLoader; a loader wrapped "
                    "by watch() or rebuilt by a framework is out of reach): ")) + "nothing was changed, so nothing "
                    "is measured. Apply it by hand and compare the two runs with "
                    "`fastload profile compare A/profile.json B/profile.json`"}
    base["predicted"], assumption = _recommend.verify_prediction(pick, applied)
    if base["predicted"] == pick["expected_gain"]:
        base.pop("predicted_for", None)  # the recommendation's own figure: nothing to tell apart
    if assumption:
        base["assumption"] = assumption
    pairs = [(summary, changed)]
    for i in range(2, VERIFY_ROUNDS + 1):
        pairs.append((rerun(vdir / f"round{i}-baseline", None), rerun(vdir / f"round{i}-changed", apply)))
        for result, which in zip(pairs[-1], (f"round-{i} baseline", f"round-{i} changed")):
            if (bad := failed(result, which)) is not None:
                return bad
    judged = compare_rounds(pairs, base["predicted"])
    measured = judged["ratio"]
    return {**base, "applied": applied, "measured": measured, "too_noisy": judged["too_noisy"],
            "error": measured / base["predicted"] - 1.0 if base["predicted"] and measured else None,
            "outside_noise": judged["outside_noise"], "noise": judged["noise"],
            "round_ratios": judged["round_ratios"], "baseline_drift": judged["baseline_drift"],
            "images_per_s": [[a["images_per_s"] for a, _ in pairs], [b["images_per_s"] for _, b in pairs]]}


def _was_applied(wanted: Any, done: Any) -> bool:
    """An option set to the value asked, or a change asked with ``True`` that the probe describes (a dict)."""
    return done == wanted or (wanted is True and isinstance(done, dict))


def _describe(changes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in changes.items()) or "the change"


class _Watched:
    def __init__(self, loader: Iterable, key: str) -> None:
        self.loader, self.key = loader, key

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        rec = _probe.recorder() or _standalone()
        _probe._SUPPRESS.on = True  # the DataLoader patch must not count these steps twice
        try:
            if rec.out is not None and hasattr(self.loader, "dataset"):
                from fastload.profiling._samples import prepare_loader

                prepare_loader(self.loader, rec.out)
            inner = iter(self.loader)
        finally:
            _probe._SUPPRESS.on = False
        return rec.wrap(self.loader, inner, self.key)


_STANDALONE: _probe.Recorder | None = None


def _standalone() -> _probe.Recorder:
    global _STANDALONE
    if _STANDALONE is None:
        _STANDALONE = _probe.Recorder(None, steps=None, warmup=0)
    return _STANDALONE


def watch(loader: Iterable) -> Iterable:
    """Wrap any iterable of batches (``DALILoader``, a custom loader) so each ``next()`` is a measured step.

    Yields exactly the loader's batches. Inside ``fastload profile`` or ``with fastload.profile()``
    the steps go into that run's results; elsewhere they are recorded and cost two clock reads.
    """
    import sys

    frame = sys._getframe(1)
    return _Watched(loader, f"{type(loader).__name__}@{_probe.short_path(frame.f_code.co_filename)}:{frame.f_lineno}")


class Profile:
    """``with fastload.profile(out=...) as p:`` — the code inside is measured; ``p.summary()`` after."""

    def __init__(self, out: Path, *, warmup: int, kineto_steps: int) -> None:
        self.out, self.warmup, self.kineto_steps = Path(out), warmup, kineto_steps
        self._summary: dict[str, Any] | None = None
        self._previous: _probe.Recorder | None = None

    def __enter__(self) -> Profile:
        self.out.mkdir(parents=True, exist_ok=True)
        _clear(self.out)
        self._previous = _probe.recorder()
        _probe.start(self.out, steps=None, warmup=self.warmup, kineto_steps=self.kineto_steps)
        return self

    def __exit__(self, kind, value, tb) -> bool:
        from fastload.profiling import _samples

        rec = _probe.stop()
        if rec is not None:
            rec.ended = "exit" if kind is None else kind.__name__
            rec.finish()
        _samples.stats().flush()
        if self._previous is not None:
            _probe._RECORDER = self._previous
        if rec is not None and rec.written is not None:
            figs, summary = summarize_dir(self.out)
            summary["options"] = {"warmup": self.warmup, "kineto_steps": self.kineto_steps}
            summary["notes"].extend(_write(self.out, figs, summary, None))
            summary["out"] = str(self.out)
            self._summary = summary
        return False

    def summary(self) -> dict[str, Any]:
        """The figures written to ``profile.json``.

        Raises:
            ProfileError: the block has not ended, or no loader inside it yielded two batches.
        """
        if self._summary is None:
            raise ProfileError("no profile summary: the `with` block has not ended or ran no measured loader steps")
        return self._summary


def profile(out: str | os.PathLike[str] = "runs/profile", *, warmup: int = 5, kineto_steps: int = 20) -> Profile:
    """Measure the training loop inside a ``with`` block: data wait per step, loader internals, verdict.

    Args:
        out: folder for ``profile.json``, ``profile.png``, ``trace.json``.
        warmup: steps of the training loader not measured.
        kineto_steps: on CUDA, steps traced with torch.profiler for the GPU timeline (0: off).
    """
    if warmup < 0 or kineto_steps < 0:
        raise ValueError(f"warmup and kineto_steps must be >= 0, got {warmup}, {kineto_steps}")
    return Profile(Path(out), warmup=warmup, kineto_steps=kineto_steps)
