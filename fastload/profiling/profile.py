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

__all__ = ["ProfileOptions", "run_profile", "watch", "profile", "Profile", "summarize_dir", "format_summary",
           "INJECT_DIR"]

INJECT_DIR = Path(__file__).resolve().parent / "_inject"
GRACE_S = 5.0  #: after Ctrl-C, how long the child may take to write its results before it is interrupted
format_summary = report.format_summary


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """How ``fastload profile`` runs the command.

    Args:
        out: output folder [default: ``runs/profile-<timestamp>``].
        steps: measured steps after warm-up, then the command is ended (None: until it ends).
        warmup: steps not measured (worker start-up, cudnn autotuning, caches).
        headspace: rerun with the training loader replaying its first batches from memory.
        kineto_steps: on CUDA, steps traced with torch.profiler (0: no GPU timeline).
        tensorboard: also write per-step scalars there (needs the ``tensorboard`` package).
    """

    out: Path | None = None
    steps: int | None = 200
    warmup: int = 5
    headspace: bool = False
    kineto_steps: int = 20
    tensorboard: Path | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 or None, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.kineto_steps < 0:
            raise ValueError(f"kineto_steps must be >= 0, got {self.kineto_steps}")


def _require_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise MissingDependencyError("--tensorboard needs the tensorboard package: pip install tensorboard")


def _child_env(out: Path, options: ProfileOptions, replay_key: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(INJECT_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[_probe.ENV_OUT] = str(out.resolve())
    env[_probe.ENV_WARMUP] = str(options.warmup)
    env[_probe.ENV_KINETO] = str(options.kineto_steps)
    if options.steps is not None:
        env[_probe.ENV_STEPS] = str(options.steps)
    else:
        env.pop(_probe.ENV_STEPS, None)
    if replay_key:
        env[_probe.ENV_REPLAY] = replay_key
    else:
        env.pop(_probe.ENV_REPLAY, None)
    return env


def _run_child(command: Sequence[str], env: dict[str, str]) -> int:
    try:
        proc = subprocess.Popen(list(command), env=env)
    except FileNotFoundError as exc:
        raise ProfileError(f"cannot run {command[0]!r}: not found\nHINT: give the command after `--`, "
                           "e.g. fastload profile -- python train.py") from exc
    except PermissionError as exc:
        raise ProfileError(f"cannot run {command[0]!r}: {exc}") from exc
    interrupts, timeout = 0, None
    while True:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # Ctrl-C reached only us (kill -INT): pass it on, once
            proc.send_signal(signal.SIGINT)
            timeout = None
        except KeyboardInterrupt:
            # A terminal's Ctrl-C reaches the whole process group: the child is already writing
            # its results. Give it GRACE_S before passing the interrupt on; a third one kills it.
            interrupts += 1
            if interrupts == 1:
                timeout = GRACE_S
            elif interrupts >= 3:
                proc.kill()


def summarize_dir(out: Path) -> tuple[list[dict], dict[str, Any]]:
    """Per-rank figures and the merged summary (verdict, recommendations, machine) from an out dir.

    Raises:
        ProfileError: no probe file there, or no loader yielded a batch.
    """
    from fastload.load.workers import worker_plan
    from fastload.measure.doctor import doctor_report

    ranks, samples = report.read_files(out)
    ranks = {r: p for r, p in ranks.items() if any(t["steps"] for t in p["tracks"])}
    if not ranks:
        raise ProfileError(f"{out}: the command ran no measured loader steps (no DataLoader iterated to a second "
                           "batch).\nHINT: a custom loader that is not a torch DataLoader needs "
                           "`for batch in fastload.watch(loader):` in the script")
    figs = [report.rank_figures(p, samples.get(r, [])) for r, p in sorted(ranks.items())]
    summary = report.merge_ranks(figs)
    machine = doctor_report()
    first = ranks[min(ranks)]
    local = first["local_world_size"]
    plan = worker_plan(env={"LOCAL_WORLD_SIZE": str(local)})
    verdict, recs = report.recommend(summary, plan_workers=plan.workers, has_gpu=bool(machine["gpus"]))
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
    for stale in list(out.glob("probe-rank*.json")) + list(out.glob("samples-rank*.json")):
        stale.unlink()
    rc = _run_child(command, _child_env(out, options, None))
    try:
        figs, summary = summarize_dir(out)
    except ProfileError as exc:
        if rc == 0:
            raise
        raise ProfileError(f"{exc}\n(the command exited with status {rc}: see its output above)") from exc
    summary["command"] = list(command)
    summary["exit_status"] = rc
    summary["options"] = {"steps": options.steps, "warmup": options.warmup, "kineto_steps": options.kineto_steps,
                          "headspace": options.headspace}
    if rc != 0 and summary["ended"] == "exit":
        summary["notes"].append(f"the command exited with status {rc}")
    if options.headspace:
        hdir = out / "headspace"
        hdir.mkdir(exist_ok=True)
        for stale in hdir.glob("*-rank*.json"):
            stale.unlink()
        hopts = ProfileOptions(steps=options.steps, warmup=max(1, options.warmup), kineto_steps=0)
        _run_child(command, _child_env(hdir, hopts, summary["loader"]["key"]))
        _, hs = summarize_dir(hdir)
        measured = summary["images_per_s"]
        summary["headspace"] = {"images_per_s": hs["images_per_s"], "steps": hs["steps"],
                                "data_wait_fraction": hs["data_wait_fraction"],
                                "ratio": hs["images_per_s"] / measured if measured else 0.0,
                                "replayed_batches": max(1, min(hopts.warmup, 32))}
    summary["notes"].extend(_write(out, figs, summary, options.tensorboard))
    summary["out"] = str(out)
    return summary


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
        for stale in list(self.out.glob("probe-rank*.json")) + list(self.out.glob("samples-rank*.json")):
            stale.unlink()
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
