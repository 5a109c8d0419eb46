"""From the files the probe left in the out dir to figures, a verdict and ranked recommendations.

Owns: reading ``probe-rank*.json`` / ``samples-rank*.json`` (and the ``steps-rank*.jsonl`` of a
process that ended abruptly), the per-rank figures, the merge across ranks, and the text
``fastload profile`` prints.

The gain model: ``_gain.py``; the recommendations: ``_recommend.py``.

Must not: run anything, import torch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from fastload.stats import percentiles

FLOAT_TRANSFORMS = ("ToTensor", "Normalize", "ConvertImageDtype", "ToDtype", "ConvertDtype")


def read_steps_file(path: Path) -> dict[str, Any] | None:
    """A probe record rebuilt from the append-only ``steps-rank<R>-<pid>.jsonl`` of a process that ended
    abruptly (``os._exit``, SIGKILL, an OOM kill) before writing its probe file; None if it holds no step.

    A line cut short by the kill is ignored; the worker CPU and the GPU timeline are not in this file.
    """
    head: dict[str, Any] | None = None
    tracks: dict[int, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "process" in row:
            head = row["process"]
        elif isinstance(row, dict) and "track" in row:
            tracks[row["track"]] = {k: v for k, v in row.items() if k != "track"}
            tracks[row["track"]].update(steps=[], worker_pids=[], event_idle=None)
        elif isinstance(row, list) and row and row[0] in tracks:
            tracks[row[0]]["steps"].append(row[1:])
    if head is None or not any(t["steps"] for t in tracks.values()):
        return None
    return {**head, "cuda": None, "ended": "abrupt", "training": None, "tracks": list(tracks.values()),
            "worker_cpu": {}, "kineto": None}


def read_files(out: Path) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """The probe file with most steps per rank (a process that ended abruptly: its steps file), and every
    samples file per rank."""
    ranks: dict[int, dict] = {}
    written = {p.name[len("probe-"):-len(".json")] for p in out.glob("probe-rank*.json")}
    abrupt = [p for p in sorted(out.glob("steps-rank*.jsonl")) if p.name[len("steps-"):-len(".jsonl")] not in written]
    for path in sorted(out.glob("probe-rank*.json")) + abrupt:
        data = json.loads(path.read_text()) if path.suffix == ".json" else read_steps_file(path)
        if data is None:
            continue
        best = ranks.get(data["rank"])
        steps = max((len(t["steps"]) for t in data["tracks"]), default=0)
        if best is None or steps > max((len(t["steps"]) for t in best["tracks"]), default=0):
            ranks[data["rank"]] = data
    samples: dict[int, list[dict]] = {}
    for path in sorted(out.glob("samples-rank*.json")):
        data = json.loads(path.read_text())
        samples.setdefault(int(data["rank"]), []).append(data)
    return ranks, samples


def _sample_figures(files: list[dict], dataset: str | None) -> dict[str, Any] | None:
    keys = ("n", "total_s", "cpu_s", "read_s", "decode_s", "transform_s", "runqueue_s", "runqueue_wall_s",
            "download_s")
    total: dict[str, Any] = {k: 0 for k in keys}
    total["transforms"] = {}
    for f in files:
        d = f["by_dataset"].get(dataset or "")
        if d is None:
            continue
        for k in keys:
            total[k] += d.get(k, 0.0)
        for k, v in d["transforms"].items():
            total["transforms"][k] = total["transforms"].get(k, 0.0) + v
    if not total["n"] or total["total_s"] <= 0:
        return None
    s = total["total_s"]
    parts = {k: total[k + "_s"] / s for k in ("read", "decode", "transform")}
    if total["download_s"] > 0:  # a remote store: blocked on a shard download (only then a part of its own)
        parts["download"] = min(1.0, total["download_s"] / s)
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    floats = sum(v for k, v in total["transforms"].items() if k in FLOAT_TRANSFORMS) / s
    cpu_share = min(1.0, total["cpu_s"] / s)
    rq = total["runqueue_s"] / total["runqueue_wall_s"] if total["runqueue_wall_s"] > 0 else None
    return {"n": total["n"], "per_sample_ms": s / total["n"] * 1e3, "cpu_share": cpu_share,
            "runqueue_share": None if rq is None else min(1.0 - cpu_share, rq),
            "blocked_share": max(0.0, 1.0 - cpu_share - (rq or 0.0)),
            "parts": parts, "float_transform_share": floats, "shard_cache": _cache_figures(files),
            "transforms": {k: v / s for k, v in sorted(total["transforms"].items(), key=lambda kv: -kv[1])}}


def _cache_figures(files: list[dict]) -> dict[str, Any] | None:
    """The shard cache's counters summed over this rank's processes (training process and workers), or None
    when no process read a remote store."""
    seen = [f["shard_cache"] for f in files if f.get("shard_cache")]
    if not seen:
        return None
    return {k: sum(c.get(k, 0) for c in seen) for k in ("downloads", "bytes_downloaded", "hits", "wait_s",
                                                         "download_s")}


def rank_figures(probe: dict, samples: list[dict]) -> dict[str, Any]:
    """Figures of one rank's training loader (the loader that yielded most batches)."""
    tracks = sorted(probe["tracks"], key=lambda t: -len(t["steps"]))
    track = tracks[0]
    warmup = probe["warmup"]
    notes = []
    steps = track["steps"][warmup:]
    if not steps:
        steps = track["steps"][1:] or track["steps"]
        notes.append(f"only {len(track['steps'])} steps ran (--warmup {warmup}): warm-up not excluded")
    wall = sum(s[2] for s in steps)
    wait = sum(s[1] for s in steps)
    images = sum(s[3] for s in steps)
    meta = track["meta"]
    workers = int(meta.get("num_workers") or 0)
    cpu = probe["worker_cpu"]
    util = [cpu[str(p)]["cpu_s"] / cpu[str(p)]["wall_s"] for p in track["worker_pids"]
            if str(p) in cpu and cpu[str(p)]["wall_s"] > 0.2]
    cpus_per_process = max(1, probe["cpus"]["available"] // max(1, probe["local_world_size"]))
    batch_bytes = track["batch_bytes"] or 0
    shm = None
    if workers and Path("/dev/shm").is_dir():
        usage = shutil.disk_usage("/dev/shm")
        need = batch_bytes * workers * int(meta.get("prefetch_factor") or 2)
        shm = {"total_bytes": usage.total, "free_bytes": usage.free, "needed_bytes": need, "ok": need <= usage.free}
    kineto = probe.get("kineto") or None
    wait_fraction = wait / wall if wall > 0 else 0.0
    step_s = [s[2] for s in steps]
    mean = wall / len(steps) if steps else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in step_s) / (len(steps) - 1)) if len(steps) > 1 else 0.0
    # the step's own part (next() returned .. next call): its wall time and the process's CPU time in it
    own = [s for s in steps if len(s) >= 6]
    own_wall = sum(s[2] - s[1] for s in own)
    step_cpu = None
    if own and own_wall > 0:
        step_cpu = {"cpu_s": sum(s[4] for s in own) / len(own), "main_thread_cpu_s": sum(s[5] for s in own) / len(own),
                    "wall_s": own_wall / len(own), "cores": sum(s[4] for s in own) / own_wall,
                    "main_thread_share": sum(s[5] for s in own) / own_wall, "wanted_cores": None}
        # CPUs the step wanted: its CPU time plus its threads' wait for a CPU (other users' load hides the first)
        sampled = [s for s in own if len(s) >= 7 and s[6] >= 0 and s[2] > s[1]]
        if sampled:
            step_cpu["wanted_cores"] = sum(s[4] + s[6] for s in sampled) / sum(s[2] - s[1] for s in sampled)
            step_cpu["runqueue_share"] = sum(s[6] for s in sampled) / sum(s[2] - s[1] for s in sampled)
    fig: dict[str, Any] = {
        "rank": probe["rank"], "steps": len(steps), "warmup": warmup, "ended": probe["ended"],
        "images_per_s": images / wall if wall > 0 else 0.0, "steps_per_s": len(steps) / wall if wall > 0 else 0.0,
        "images_per_step": images / len(steps) if steps else 0.0,
        "step_stats": {"n": len(steps), "mean_s": mean, "sd_s": sd,
                       "wait_mean_s": wait / len(steps) if steps else 0.0},
        "step_cpu": step_cpu, "applied": probe.get("applied") or {},
        "not_applied": probe.get("not_applied") or {},
        "seconds_limit": probe.get("seconds_limit"),
        "data_wait_fraction": wait_fraction, "compute_fraction": 1.0 - wait_fraction,
        "percentiles_ms": {"step": {k: v * 1e3 for k, v in percentiles([s[2] for s in steps]).items()},
                           "data_wait": {k: v * 1e3 for k, v in percentiles([s[1] for s in steps]).items()}},
        "loader": {"key": track["key"], "class": meta.get("class"), "num_workers": workers,
                   "backend": meta.get("backend"),
                   "pin_memory": meta.get("pin_memory"), "pinned": track["pinned"],
                   "created_at": meta.get("created_at"), "iterated_at": meta.get("iterated_at"),
                   "dataset": meta.get("dataset"), "image_folder": meta.get("image_folder"),
                   "prefetch_factor": meta.get("prefetch_factor"), "batch_size": meta.get("batch_size"),
                   "persistent_workers": meta.get("persistent_workers"), "batch_bytes": batch_bytes,
                   "worker_cpu_util": util, "worker_cpu_util_mean": sum(util) / len(util) if util else None,
                   "cpus_per_process": cpus_per_process, "shm": shm, "autotune": meta.get("autotune")},
        "samples": _sample_figures(samples, meta.get("dataset")),
        "other_loaders": [{"key": t["key"], "steps": len(t["steps"])} for t in tracks[1:]],
        "cpus": probe["cpus"], "cuda": probe["cuda"], "notes": notes,
        "timeline": [[s[0] - steps[0][0], s[1], s[2]] for s in steps] if steps else [],
    }
    events = track.get("event_idle")
    if events:
        first = len(track["steps"]) - len(steps)  # index of the first measured step
        idle = sum(v for i, v in events if i >= first and i < len(track["steps"]))
        fig["event_input_bound_idle_fraction"] = idle / wall if wall > 0 else 0.0
    if kineto and "gpu_idle_fraction" in kineto:
        fig.update(gpu_idle_fraction=kineto["gpu_idle_fraction"], idle_source="cuda",
                   input_bound_idle_fraction=kineto["input_bound_idle_fraction"], kineto=kineto)
    elif events:  # CUDA without a Kineto window: the hand-off events see the idle the waits caused, not the rest
        fig.update(gpu_idle_fraction=fig["event_input_bound_idle_fraction"], idle_source="cuda-events",
                   input_bound_idle_fraction=fig["event_input_bound_idle_fraction"], kineto=kineto)
    else:
        fig.update(gpu_idle_fraction=wait_fraction, idle_source="host-clock", input_bound_idle_fraction=wait_fraction,
                   kineto=kineto)
    # the loop's wait attributed to the parts of the sample time in proportion (exact with num_workers=0, where
    # the wait is the samples' time): the download part's share is the time the loop waited for shard downloads
    sm = fig["samples"]
    fig["download_wait_fraction"] = fig["input_bound_idle_fraction"] * sm["parts"].get("download", 0.0) if sm else 0.0
    return fig


def merge_ranks(figs: list[dict]) -> dict[str, Any]:
    """One summary: the figures of the rank that waits most for data (it holds every rank back at the
    gradient all-reduce), images/s summed over ranks, and every rank's figures under ``ranks``."""
    figs = sorted(figs, key=lambda f: f["rank"])
    bottleneck = max(figs, key=lambda f: f["input_bound_idle_fraction"])
    summary = {k: v for k, v in bottleneck.items() if k not in ("timeline",)}
    summary["images_per_s"] = sum(f["images_per_s"] for f in figs)
    summary["world_size"] = len(figs)
    if len(figs) > 1:
        summary["bottleneck_rank"] = bottleneck["rank"]
        summary["slowest_rank"] = min(figs, key=lambda f: f["images_per_s"])["rank"]
        summary["ranks"] = [{k: v for k, v in f.items() if k not in ("timeline", "cpus", "cuda")} for f in figs]
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """What ``fastload profile`` prints."""
    lines = [f"fastload profile: {s['steps']} steps after {s['warmup']} warm-up, {s['images_per_s']:.1f} images/s"
             + (f" over {s['world_size']} ranks" if s["world_size"] > 1 else "")
             + {"cuda": "", "cuda-events": " (GPU idle from CUDA events at the hand-off; no Kineto window)"}.get(
                 s["idle_source"], " (no CUDA: host clocks)")]
    p = s["percentiles_ms"]
    has_gpu = bool((s.get("machine") or {}).get("gpus")) or s["idle_source"] != "host-clock"
    idle_note = "*" if s["idle_source"] == "host-clock" and has_gpu else ""
    lines.append(f"  data wait {s['data_wait_fraction']:.0%} of step time (p50 {p['data_wait']['p50']:.1f} ms, "
                 f"step p50 {p['step']['p50']:.1f} ms)"
                 + (f"; GPU idle {s['gpu_idle_fraction']:.0%}{idle_note}, "
                    f"input-bound idle {s['input_bound_idle_fraction']:.0%}{idle_note}" if has_gpu else ""))
    sc = s.get("step_cpu")
    if sc:
        lines.append(f"  the step itself: {sc['cpu_s'] * 1e3:.1f} ms of CPU time per {sc['wall_s'] * 1e3:.1f} ms "
                     f"= {sc['cores']:.1f} CPUs busy (main thread {sc['main_thread_share']:.0%} of its wall time)"
                     + ("" if sc.get("wanted_cores") is None or sc["wanted_cores"] < sc["cores"] + 0.1 else
                        f"; {sc['wanted_cores']:.1f} CPUs wanted (its threads waited for a CPU "
                        f"{sc['runqueue_share']:.0%} of the time)"))
    ld = s["loader"]
    lines.append(f"  loader {ld['key']}: num_workers={ld['num_workers']}, pin_memory={ld['pin_memory']}, "
                 f"{s['images_per_step']:.0f} samples/batch, {ld['batch_bytes'] / 1e3:.0f} kB/batch"
                 + (f" (iterated at {ld['iterated_at']})" if ld.get("iterated_at") and ld.get("created_at") else ""))
    tuned = ld.get("autotune")
    if tuned is not None:  # the thread loader sized itself (load/autotune.py): its changes, then where it ended
        moves = [d for d in tuned if d["action"] != "hold"]
        last = tuned[-1] if tuned else None
        lines.append("  autotune: " + (f"{len(moves)} change(s) in {len(tuned)} decisions, ended at "
                                       f"{last['threads']} thread(s), prefetch depth {last['depth']} after "
                                       f"{last['batch']} batches" if last else "no decision yet (too few batches)"))
        for d in moves[-5:]:
            lines.append(f"    batch {d['batch']}: {d['action']} -> {d['threads']} thread(s), depth {d['depth']}: "
                         f"{d['reason']}")
    if ld["worker_cpu_util"]:
        lines.append("  worker CPU: " + ", ".join(f"{u:.0%}" for u in ld["worker_cpu_util"])
                     + f" of one CPU each; {ld['cpus_per_process']} CPUs for this process")
    if ld["shm"] and not ld["shm"]["ok"]:
        lines.append(f"  /dev/shm: {ld['shm']['free_bytes'] / 1e6:.0f} MB free, workers need "
                     f"{ld['shm']['needed_bytes'] / 1e6:.0f} MB: raise it (docker --shm-size) or lower prefetch_factor")
    sm = s["samples"]
    if sm:
        lines.append(f"  sample {sm['per_sample_ms']:.2f} ms each: " + ", ".join(
            f"{k} {v:.0%}" for k, v in sm["parts"].items()) + f"; on a CPU {sm['cpu_share']:.0%}"
            + ("" if sm.get("runqueue_share") is None else f", waiting for a CPU {sm['runqueue_share']:.0%}")
            + f", blocked {sm['blocked_share']:.0%}")
    cache = (sm or {}).get("shard_cache")
    if cache:
        lines.append(f"  shard downloads: the loop waited for them {s.get('download_wait_fraction', 0.0):.0%} of "
                     f"step time; {cache['downloads']} downloads ({cache['bytes_downloaded'] / 1e6:.1f} MB), readers "
                     f"blocked {cache['wait_s']:.1f} s in all, {cache['hits']} cache hits")
    if s.get("ranks"):
        for r in s["ranks"]:
            lines.append(f"  rank {r['rank']}: {r['images_per_s']:.1f} images/s, "
                         f"data wait {r['data_wait_fraction']:.0%}")
    if idle_note:
        lines.append("  * no CUDA timeline: GPU idle from host clocks (time the step waited for data)")
    for note in s.get("notes", []):
        lines.append(f"  note: {note}")
    if s.get("ended") in ("steps", "time"):
        budget = s.get("seconds_limit")
        lines.append(f"  measured {s['steps']} steps, then ended the command ("
                     + (f"the {budget:g} s budget" if s["ended"] == "time" and budget else "--steps")
                     + "); to measure more: --seconds 120 --steps 1000, or --until-end")
    lines.append(f"verdict: {s['verdict']}")
    lines.append("recommendations:")
    for i, r in enumerate(s["recommendations"], 1):
        gain = r["expected_gain"]
        said = (f"predicted {gain:.2f}x images/s" if r.get("stage") and not r.get("bound") else
                f"up to {gain:.2f}x images/s" if gain > 1.0 else "no gain predicted")
        lines.append(f"  {i}. {r['change']}: {said}. {r['why']}")
        if r.get("code"):
            lines.extend("       " + line for line in r["code"].splitlines())
    v = s.get("verify_fix")
    if v and "skipped" in v:
        lines.append(f"verify-fix: skipped: {v['skipped']}")
    elif v and v.get("failed"):
        lines.append(f"verify-fix: FAILED: {v['change']}: {v['failed']}")
    elif v and v.get("not_applied"):
        lines.append(f"verify-fix: NOT APPLIED: {v['change']}: {v['not_applied']}")
    elif v:
        base, changed = v["images_per_s"]
        rounds = ", ".join(f"{r:.2f}x" for r in v["round_ratios"])
        judged = ("outside the noise" if v["outside_noise"] else "within the noise: the change is not shown to "
                  "matter" if v["outside_noise"] is False else "noise unknown")
        predicted = ("no prediction" if v["predicted"] is None else "predicted "
                     + ("up to " if v.get("predicted_is_bound") else "") + f"{v['predicted']:.2f}x"
                     + (" (no gain: the recommendation above)" if v.get("predicted_is_advice") else "")
                     + (f" for {v['predicted_for']}" if v.get("predicted_for") else ""))
        runs = ("baseline " + "/".join(f"{x:.1f}" for x in base) + " -> changed "
                + "/".join(f"{x:.1f}" for x in changed) + " images/s")
        if v.get("too_noisy"):
            lines.append(f"verify-fix: {v['change']} ({v['why']}), applied {v['applied']}: {predicted}; measured: "
                         f"cannot tell: the machine is too noisy (the {len(base)} interleaved rounds gave {rounds}: "
                         f"{runs}); rerun on a quieter machine or with more --steps; {v['profile']}")
        else:
            lines.append(f"verify-fix: {v['change']} ({v['why']}), applied {v['applied']}: {predicted}, "
                         f"measured {v['measured']:.2f}x images/s over {len(base)} interleaved "
                         f"rounds (each {rounds}; {runs}; run-to-run noise +/-{v['noise'] or 0:.2f}: "
                         + judged + f"); {v['profile']}")
        if v.get("assumption"):
            lines.append(f"  predicted with: {v['assumption']}")
    if s.get("headspace"):
        h = s["headspace"]
        lines.append(f"headspace: {h['images_per_s']:.1f} images/s with batches replayed from memory "
                     f"(measured {s['images_per_s']:.1f}: a perfect loader gives {h['ratio']:.2f}x)")
    return "\n".join(lines)


def chrome_trace(figs: list[dict]) -> dict[str, Any]:
    """Host timeline per rank: each step's data wait and compute (opens in ui.perfetto.dev)."""
    events: list[dict[str, Any]] = []
    for f in figs:
        pid = f["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}})
        for i, (t0, wait, total) in enumerate(f["timeline"]):
            events.append({"ph": "X", "name": "data wait", "cat": "data", "pid": pid, "tid": 0,
                           "ts": t0 * 1e6, "dur": wait * 1e6, "args": {"step": i}})
            events.append({"ph": "X", "name": "step", "cat": "compute", "pid": pid, "tid": 0,
                           "ts": (t0 + wait) * 1e6, "dur": max(0.0, total - wait) * 1e6, "args": {"step": i}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(figs: list[dict], summary: dict[str, Any], path: Path) -> str | None:
    """profile.png: per-step wait/compute of every rank and the sample-time breakdown; a note if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "profile.png skipped: pip install 'fastload[plot]' (matplotlib)"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    for f in figs:
        tl = f["timeline"]
        x = list(range(len(tl)))
        wait = [r[1] * 1e3 for r in tl]
        comp = [max(0.0, r[2] - r[1]) * 1e3 for r in tl]
        ax1.bar(x, wait, color="tab:red", alpha=0.7, label=f"rank {f['rank']} data wait" if len(figs) > 1
                else "data wait")
        ax1.bar(x, comp, bottom=wait, color="tab:blue", alpha=0.5, label="compute" if f is figs[0] else None)
    ax1.set(xlabel="measured step", ylabel="ms", title=f"per step: {summary['verdict'].split(':')[0]}")
    ax1.legend(fontsize=8)
    sm = summary["samples"]
    if sm:
        left = 0.0
        colors = {"read": "tab:orange", "decode": "tab:red", "transform": "tab:green", "download": "tab:purple"}
        for name, share in sm["parts"].items():
            ax2.barh([0], [share], left=left, color=colors.get(name, "tab:gray"), label=name)
            left += share
        ax2.set(xlim=(0, 1), yticks=[], title=f"sample time ({sm['per_sample_ms']:.1f} ms)")
        ax2.legend(fontsize=8, loc="lower center", ncol=2)
    else:
        ax2.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_tensorboard(figs: list[dict], logdir: Path) -> None:
    """Per-step data wait and step time scalars (``torch.utils.tensorboard``), one run per rank."""
    from torch.utils.tensorboard import SummaryWriter

    for f in figs:
        writer = SummaryWriter(str(logdir / f"rank{f['rank']}"))
        for i, (_, wait, total) in enumerate(f["timeline"]):
            writer.add_scalar("profile/data_wait_ms", wait * 1e3, i)
            writer.add_scalar("profile/step_ms", total * 1e3, i)
            writer.add_scalar("profile/data_wait_fraction", wait / total if total > 0 else 0.0, i)
        writer.close()
