"""From the files the probe left in the out dir to figures, a verdict and ranked recommendations.

Owns: reading ``probe-rank*.json`` / ``samples-rank*.json``, the per-rank figures, the merge
across ranks, the verdict, the recommendations and their expected gains (a small model of
the loader fitted to the measurement, below), and the text ``fastload profile`` prints.

The gain model. Per step of the training loop: T the measured step time, ``bound`` the
input-bound share (host data wait without CUDA; GPU idle overlapping the wait on CUDA),
so a perfect loader gives a step of ``c = T * (1 - bound)`` and no change can beat
``1 / (1 - bound)``. One batch costs ``t_b = images * seconds per sample`` of loading,
``t_cpu = t_b * cpu share`` of it on a CPU. With N workers on P CPUs for this process the
loader delivers a batch every ``max(t_b / N, t_cpu / P)``; in the main process (N = 0)
the step is ``c + t_b``. A change that removes a measured part of the sample time (read,
decode, the float transforms) shrinks ``t_b`` and ``t_cpu`` by that part. Expected gain =
T / predicted step, capped at the perfect-loader bound; it is an upper-bound estimate.

Must not: run anything, import torch.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from fastload.stats import percentiles

INPUT_BOUND = 0.10  #: below this input-bound share faster loading cannot buy more than ~11%
FLOAT_TRANSFORMS = ("ToTensor", "Normalize", "ConvertImageDtype", "ToDtype", "ConvertDtype")
PARTS = {"read": "opening files (PIL Image.open)", "decode": "image decode in PIL (load/convert)",
         "transform": "torchvision transforms", "other": "the dataset's own code outside PIL and transforms"}


def read_files(out: Path) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """The probe file with most steps per rank, and every samples file per rank."""
    ranks: dict[int, dict] = {}
    for path in sorted(out.glob("probe-rank*.json")):
        data = json.loads(path.read_text())
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
    keys = ("n", "total_s", "cpu_s", "read_s", "decode_s", "transform_s", "runqueue_s", "runqueue_wall_s")
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
    parts["other"] = max(0.0, 1.0 - sum(parts.values()))
    floats = sum(v for k, v in total["transforms"].items() if k in FLOAT_TRANSFORMS) / s
    cpu_share = min(1.0, total["cpu_s"] / s)
    rq = total["runqueue_s"] / total["runqueue_wall_s"] if total["runqueue_wall_s"] > 0 else None
    return {"n": total["n"], "per_sample_ms": s / total["n"] * 1e3, "cpu_share": cpu_share,
            "runqueue_share": None if rq is None else min(1.0 - cpu_share, rq),
            "blocked_share": max(0.0, 1.0 - cpu_share - (rq or 0.0)),
            "parts": parts, "float_transform_share": floats,
            "transforms": {k: v / s for k, v in sorted(total["transforms"].items(), key=lambda kv: -kv[1])}}


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
    fig: dict[str, Any] = {
        "rank": probe["rank"], "steps": len(steps), "warmup": warmup, "ended": probe["ended"],
        "images_per_s": images / wall if wall > 0 else 0.0, "steps_per_s": len(steps) / wall if wall > 0 else 0.0,
        "images_per_step": images / len(steps) if steps else 0.0,
        "data_wait_fraction": wait_fraction, "compute_fraction": 1.0 - wait_fraction,
        "percentiles_ms": {"step": {k: v * 1e3 for k, v in percentiles([s[2] for s in steps]).items()},
                           "data_wait": {k: v * 1e3 for k, v in percentiles([s[1] for s in steps]).items()}},
        "loader": {"key": track["key"], "class": meta.get("class"), "num_workers": workers,
                   "pin_memory": meta.get("pin_memory"), "pinned": track["pinned"],
                   "prefetch_factor": meta.get("prefetch_factor"), "batch_size": meta.get("batch_size"),
                   "persistent_workers": meta.get("persistent_workers"), "batch_bytes": batch_bytes,
                   "worker_cpu_util": util, "worker_cpu_util_mean": sum(util) / len(util) if util else None,
                   "cpus_per_process": cpus_per_process, "shm": shm},
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


def _predict(n: int, c: float, tb: float, tcpu: float, cpus: int) -> float:
    return c + tb if n == 0 else max(c, tb / n, tcpu / cpus)


def recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """The verdict and the ranked ``{change, why, expected_gain, stage}`` list for a summary."""
    wait, idle, bound = s["data_wait_fraction"], s["gpu_idle_fraction"], s["input_bound_idle_fraction"]
    cuda = s["idle_source"] in ("cuda", "cuda-events")
    where = (f"the GPU was idle {idle:.0%} of measured time, {bound * 100:.0f} points of it while the training loop "
             "waited for the DataLoader" if cuda else
             f"the training loop waited for data {wait:.0%} of measured time (no CUDA timeline: host clocks; the "
             "device is idle whenever the step waits)")
    recs: list[dict[str, Any]] = []
    if bound < INPUT_BOUND:
        host_idle = idle - bound if cuda else 0.0
        if host_idle >= 0.15:
            recs.append({"change": "remove host sync points in the step (loss.item(), .cpu(), printing every step); "
                         "then CUDA graphs or torch.compile for launch overhead", "stage": None,
                         "why": f"the GPU was idle {host_idle:.0%} of the time while the host was NOT waiting for data",
                         "expected_gain": 1.0 / (1.0 - host_idle)})
        recs.append({"change": "none on the loading side", "stage": None, "expected_gain": 1.0 / (1.0 - bound),
                     "why": f"compute-bound: faster loading will not help: only {bound:.0%} of the step was spent "
                            "waiting for data"})
        kind = "host-bound" if host_idle >= 0.15 else "compute-bound"
        return f"{kind}: {where}; faster loading will not help", recs

    loader, samples = s["loader"], s["samples"]
    T = 1.0 / s["steps_per_s"]
    cap = 1.0 / max(1e-9, 1.0 - bound)
    c = T * (1.0 - bound)
    w_now, cpus = loader["num_workers"], loader["cpus_per_process"]
    details = []
    if samples:
        tb = s["images_per_step"] * samples["per_sample_ms"] / 1e3
        share = samples["cpu_share"]
        tcpu = tb * share
        parts = samples["parts"]
        top = max(parts, key=parts.get)
        details.append(f"{parts[top]:.0%} of each sample's time is {PARTS[top]}")

        def gain(tb_new: float, tcpu_new: float, n: int = w_now) -> float:
            return min(cap, T / _predict(n, c, tb_new, tcpu_new, cpus))

        saturated = w_now > 0 and tcpu / cpus >= 0.9 * c
        util = loader["worker_cpu_util_mean"]
        if w_now and util is not None:
            details.insert(0, f"workers are {'CPU-saturated' if saturated else 'not CPU-bound'} "
                              f"({w_now} workers on {cpus} usable CPUs, {util:.0%} CPU each)")
        rq = samples.get("runqueue_share")
        starved = rq is not None and rq >= 0.25
        if starved:
            details.append(f"samples waited for a CPU {rq:.0%} of their time: the machine is oversubscribed")
        io_bound = not starved and samples.get("blocked_share", 1.0 - share) >= 0.5
        if tcpu / cpus >= c:
            best = max(w_now, plan_workers)
        elif io_bound:
            best = min(4 * cpus, max(plan_workers, math.ceil(tb / c - 1e-9)))
        else:
            best = plan_workers
        if best > w_now:
            change = f'num_workers="auto" (-> {best})' if best == plan_workers else f"num_workers={best}"
            why = (f"the loader runs in the training process: each step waits for {s['images_per_step']:.0f} samples "
                   f"of {samples['per_sample_ms']:.1f} ms" if w_now == 0 else
                   f"{w_now} workers deliver a batch every {tb / w_now * 1e3:.0f} ms; the step needs one every "
                   f"{c * 1e3:.0f} ms")
            if io_bound and best > plan_workers:
                why += (f"; samples spend {samples.get('blocked_share', 1 - share):.0%} of their time blocked "
                        f"(I/O, sleep), so workers beyond the {cpus} CPUs overlap the waiting")
            recs.append({"change": change, "stage": "workers", "why": why,
                         "expected_gain": min(cap, T / _predict(best, c, tb, tcpu, cpus))})
        n_after = max(w_now, 1)
        if parts["read"] >= 0.15:
            recs.append({"change": "fastload convert DIR store.lmdb, then LMDBImageDataset(store.lmdb)",
                         "stage": "lmdb",
                         "why": f"{parts['read']:.0%} of sample time is opening and reading small files",
                         "expected_gain": gain(tb * (1 - parts["read"]), tcpu * (1 - parts["read"]), n_after)})
        floats = samples["float_transform_share"]
        if floats >= 0.10:
            recs.append({"change": "train_transform + collate_uint8 + DevicePrefetcher (uint8 to the device, "
                                   "normalise there)", "stage": "fast",
                         "why": f"{floats:.0%} of sample time is ToTensor/Normalize (float conversion on the CPU, "
                                "4x the bytes through worker queues)",
                         "expected_gain": gain(tb * (1 - floats), tcpu * (1 - floats), n_after)})
        if has_gpu and saturated and parts["decode"] >= 0.25:
            cut = parts["decode"] + floats
            recs.append({"change": 'DALILoader(device="gpu") (nvJPEG decode on the GPU)', "stage": "dali-gpu",
                         "why": f"the CPUs are saturated and {parts['decode']:.0%} of sample time is JPEG decode",
                         "expected_gain": gain(tb * (1 - cut), tcpu * (1 - cut), n_after)})
    if has_gpu and loader["pinned"] is False and s.get("kineto") and s["kineto"].get("htod_copy_fraction"):
        h = s["kineto"]["htod_copy_fraction"]
        recs.append({"change": "pin_memory=True (and .to(device, non_blocking=True))", "stage": "workers",
                     "why": f"host-to-device copies from pageable memory took {h:.0%} of the window",
                     "expected_gain": min(cap, 1.0 / (1.0 - h))})
    if not recs:
        recs.append({"change": "A/B the loading stages on your data: fastload recipe run", "stage": None,
                     "why": "input-bound, but no single part of the sample time stands out",
                     "expected_gain": cap})
    recs.sort(key=lambda r: -r["expected_gain"])
    verdict = "input-bound: " + "; ".join([where, *details])
    return verdict, recs


def format_summary(s: dict[str, Any]) -> str:
    """What ``fastload profile`` prints."""
    lines = [f"fastload profile: {s['steps']} steps after {s['warmup']} warm-up, {s['images_per_s']:.1f} images/s"
             + (f" over {s['world_size']} ranks" if s["world_size"] > 1 else "")
             + {"cuda": "", "cuda-events": " (GPU idle from CUDA events at the hand-off; no Kineto window)"}.get(
                 s["idle_source"], " (no CUDA: host clocks)")]
    p = s["percentiles_ms"]
    idle_note = "*" if s["idle_source"] == "host-clock" else ""
    lines.append(f"  data wait {s['data_wait_fraction']:.0%} of step time (p50 {p['data_wait']['p50']:.1f} ms, "
                 f"step p50 {p['step']['p50']:.1f} ms); GPU idle {s['gpu_idle_fraction']:.0%}{idle_note}, "
                 f"input-bound idle {s['input_bound_idle_fraction']:.0%}{idle_note}")
    ld = s["loader"]
    lines.append(f"  loader {ld['key']}: num_workers={ld['num_workers']}, pin_memory={ld['pin_memory']}, "
                 f"{s['images_per_step']:.0f} samples/batch, {ld['batch_bytes'] / 1e3:.0f} kB/batch")
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
    if s.get("ranks"):
        for r in s["ranks"]:
            lines.append(f"  rank {r['rank']}: {r['images_per_s']:.1f} images/s, "
                         f"data wait {r['data_wait_fraction']:.0%}")
    if idle_note:
        lines.append("  * no CUDA: device idle from host clocks (time the step waited for data)")
    for note in s.get("notes", []):
        lines.append(f"  note: {note}")
    lines.append(f"verdict: {s['verdict']}")
    lines.append("recommendations:")
    for i, r in enumerate(s["recommendations"], 1):
        lines.append(f"  {i}. {r['change']}: up to {r['expected_gain']:.2f}x images/s. {r['why']}")
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
        for (name, share), color in zip(sm["parts"].items(), ("tab:orange", "tab:red", "tab:green", "tab:gray")):
            ax2.barh([0], [share], left=left, color=color, label=name)
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
