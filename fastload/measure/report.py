"""What a recipe run leaves behind: the comparison table, the verdict, and the files.

Owns: the table (stage, median images/s with its 95% interval, data wait %, GPU idle %,
speedup vs the baseline or else the first stage, "~" where the stage's interval overlaps
the reference's: within noise), the one-line verdict, ``results.json`` (every figure and
every round, the resolved recipe, the environment from ``env.py``), ``results.csv``,
``comparison.png`` (matplotlib, from the ``plot`` extra), one Chrome-trace JSON per stage
(the round nearest the median; opens in Perfetto or ``chrome://tracing``), and
``recipe compare`` of two ``results.json`` (ratios marked "~" where intervals overlap).

Must not: run anything.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from fastload.measure.env import environment
from fastload.measure.rounds import overlap

__all__ = ["environment", "results_json", "format_table", "verdict", "write_outputs", "compare_results",
           "chrome_trace", "CONTRACT"]

#: What every stage hands the step (``stages.py``); printed under the table.
CONTRACT = ("every stage hands the step float32 NCHW batches normalised with the ImageNet mean/std, "
            "and int64 labels, on the run's device; each pays for that inside the timed loop")

#: Below this data-wait (or idle) fraction a stage counts as not waiting on data.
DATA_BOUND_THRESHOLD = 0.10


def _stage_row(outcome) -> dict[str, Any]:
    row: dict[str, Any] = {"name": outcome.stage.name, "type": outcome.stage.type, "status": outcome.status}
    if outcome.skipped:
        row["reason"] = outcome.skipped
        return row
    res = outcome.result
    row.update(res.to_json(with_records=False))
    row["workers"] = outcome.workers
    row["normalises"] = outcome.normalises
    row["images_per_s_ci95"] = list(outcome.images_per_s_ci95) if outcome.images_per_s_ci95 else None
    row["rounds"] = [{"round": k, "position": pos, **r.to_json(with_records=False)}
                     for k, pos, r in zip(outcome.round_index, outcome.position, outcome.rounds)]
    for rr in row["rounds"]:
        rr.pop("extra", None)
    if outcome.autotune:
        row["autotune"] = outcome.autotune
    if outcome.evictions:
        row["cache_evictions"] = outcome.evictions
        row["eviction_confirmed"] = all(e["confirmed"] for e in outcome.evictions)
    if outcome.ranks and len(outcome.ranks) > 1:
        slowest = min(outcome.ranks, key=lambda x: x["images_per_s"])
        row["ranks"] = outcome.ranks
        row["slowest_rank"] = slowest.get("rank")
        row["images_per_s_total"] = sum(x["images_per_s"] for x in outcome.ranks)
    return row


def results_json(recipe, outcomes, data) -> dict[str, Any]:
    """Every figure of a run: per stage the median over rounds, its interval, every round,
    the speedup vs the reference stage (``reference_row``: the baseline, else the first
    that ran; kept under the key ``speedup_vs_baseline``) and per round the ratio to the
    reference within the same round."""
    rows = [_stage_row(o) for o in outcomes]
    base = reference_row(rows)
    for r in rows:
        if r["status"] == "ran" and base:
            r["speedup_vs_baseline"] = r["images_per_s"] / base["images_per_s"]
            r["within_noise_of_baseline"] = r is not base and overlap(r["images_per_s_ci95"],
                                                                     base["images_per_s_ci95"])
            base_rounds = {x["round"]: x["images_per_s"] for x in base["rounds"]}
            for x in r["rounds"]:
                if x["round"] in base_rounds:
                    x["ratio_vs_baseline"] = x["images_per_s"] / base_rounds[x["round"]]
    return {"stages": rows, "reference_stage": base["name"] if base else None, "recipe": recipe.to_json(),
            "contract": CONTRACT,
            "data": {"name": data.name, "folder": str(data.folder) if data.folder else None,
                     "store": str(data.store), "images": data.images, "classes": data.num_classes},
            "environment": environment(), "verdict": verdict(rows)}


def reference_row(rows: list[dict]) -> dict | None:
    """What ratios are against: the ``baseline`` stage when it ran, else the first stage that ran."""
    ran = [r for r in rows if r["status"] == "ran"]
    return next((r for r in ran if r["type"] == "baseline"), ran[0] if ran else None)


def verdict(rows: list[dict]) -> str:
    """Which stage removes most of the wait, and what bounds the best stage."""
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return "no stage ran."
    best = max(ran, key=lambda r: r["images_per_s"])
    base = reference_row(rows)
    idle_name = "GPU idle" if best["idle_source"] == "cuda-events" else "device idle"
    parts = []
    if base and best is not base:
        ratio = best["images_per_s"] / base["images_per_s"]
        parts.append(f"'{best['name']}' removes most of the wait: {ratio:.1f}x '{base['name']}', data wait "
                     f"{base['data_wait_fraction']:.0%} -> {best['data_wait_fraction']:.0%}")
    else:
        parts.append(f"'{best['name']}' is fastest")
    rivals = [r["name"] for r in ran if r is not best and overlap(r.get("images_per_s_ci95"),
                                                                  best.get("images_per_s_ci95"))]
    if rivals:
        parts.append(f"within noise of {', '.join(repr(n) for n in rivals)} (95% intervals overlap)")
    waiting = max(best["data_wait_fraction"], best["gpu_idle_fraction"])
    if waiting > DATA_BOUND_THRESHOLD:
        parts.append(f"it is still data-bound ({idle_name} {best['gpu_idle_fraction']:.0%}): more CPUs, a "
                     "reduced-resolution store (--max-side) or DALI on the GPU would help")
    else:
        parts.append(f"the remaining bottleneck is compute ({idle_name} {best['gpu_idle_fraction']:.0%}): "
                     "faster loading will not speed this up")
    return "; ".join(parts) + "."


def _ci(r: dict) -> str:
    ci = r.get("images_per_s_ci95")
    return f"{ci[0]:.0f}-{ci[1]:.0f}" if ci else "-"


def format_table(rows: list[dict]) -> str:
    """The comparison table: median images/s over rounds with its 95% interval, ratios
    against the reference stage (``reference_row``)."""
    ref = reference_row(rows)
    vs = "vs " + (ref["name"] if ref else "baseline")
    head = (f"{'stage':<16}{'workers':>8}{'images/s':>10}{'95% interval':>15}{'data wait':>11}{'GPU idle':>10}"
            f"{vs:>{max(13, len(vs) + 2)}}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ran":
            lines.append(f"{r['name']:<16}{'':>8}{'skipped':>10}  {r['reason']}")
            continue
        idle = f"{r['gpu_idle_fraction']:.0%}" + ("" if r["idle_source"] == "cuda-events" else "*")
        speed = "-"
        if "speedup_vs_baseline" in r:
            speed = ("~" if r.get("within_noise_of_baseline") else "") + f"{r['speedup_vs_baseline']:.2f}x"
        lines.append(f"{r['name']:<16}{r.get('workers') or 0:>8}{r['images_per_s']:>10.0f}{_ci(r):>15}"
                     f"{r['data_wait_fraction']:>11.0%}{idle:>10}{speed:>{max(13, len(vs) + 2)}}")
        if r.get("ranks"):
            lines.append(f"{'':<16}{len(r['ranks'])} ranks: slowest rank {r['slowest_rank']}, "
                         f"{r['images_per_s_total']:.0f} images/s in total")
    ran = [r for r in rows if r["status"] == "ran"]
    if ran:
        n = len(ran[0]["rounds"])
        lines.append(f"images/s: median of {n} interleaved round{'s' if n != 1 else ''} (stage order rotated "
                     "each round); interval: 95% hierarchical bootstrap over rounds, then steps")
    if any(r.get("within_noise_of_baseline") for r in ran):
        lines.append(f"~ within noise: the stage's interval overlaps {ref['name'] if ref else 'the baseline'}'s")
    if any(r["idle_source"] == "host-clock" for r in ran):
        lines.append("* no CUDA: device idle from host clocks (time outside the model step)")
    for r in ran:
        if r.get("autotune"):
            ends = ", ".join(f"{a['threads']}/{a['depth']}" for a in r["autotune"])
            changes = sum(a["changes"] for a in r["autotune"])
            lines.append(f"{r['name']}: started at {r.get('workers') or 0} thread(s); ended each round at "
                         f"threads/prefetch depth {ends} ({changes} change(s) in "
                         f"{sum(a['decisions'] for a in r['autotune'])} decisions)")
    if ran:
        lines.append(f"same output: {CONTRACT}. Where each stage normalises:")
        width = max(14, *(len(r["name"]) + 2 for r in ran))  # a long stage name still leaves a gap
        lines += [f"  {r['name']:<{width}}{r['normalises']}" for r in ran if r.get("normalises")]
    for r in ran:
        if "eviction_confirmed" in r:
            ev = r["cache_evictions"]
            state = "confirmed (mincore)" if r["eviction_confirmed"] else "NOT confirmed: " + next(
                e["note"] for e in ev if not e["confirmed"])
            lines.append(f"cold cache, {r['name']}: {ev[0]['files']} files evicted before each of "
                         f"{len(ev)} rounds, {state}")
    return "\n".join(lines)


def chrome_trace(result, *, pid: int = 1) -> dict[str, Any]:
    """Chrome trace events of one stage: data wait / copy / compute spans per step (+ GPU busy on CUDA)."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"stage {result.name}"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "host step loop"}},
    ]
    if result.idle_source == "cuda-events":
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 2, "args": {"name": "GPU (CUDA events)"}})
    gpu_t = None
    for rec in result.records:
        t = rec.t0 * 1e6
        for name, dur in (("data wait", rec.data_wait), ("copy", rec.copy), ("compute", rec.compute)):
            events.append({"name": name, "cat": name, "ph": "X", "pid": pid, "tid": 1, "ts": round(t, 3),
                           "dur": round(dur * 1e6, 3), "args": {"step": rec.step}})
            t += dur * 1e6
        if rec.gpu_busy is not None:
            # the GPU timeline is anchored at the first step's copy end, then advances by its own gaps
            if gpu_t is None:
                gpu_t = (rec.t0 + rec.data_wait + rec.copy) * 1e6
            else:
                gpu_t += (rec.gpu_idle or 0.0) * 1e6
            events.append({"name": "GPU busy", "cat": "gpu", "ph": "X", "pid": pid, "tid": 2, "ts": round(gpu_t, 3),
                           "dur": round(rec.gpu_busy * 1e6, 3), "args": {"step": rec.step,
                                                                        "idle_before_ms": (rec.gpu_idle or 0) * 1e3}})
            gpu_t += rec.gpu_busy * 1e6
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_tensorboard(outcomes, logdir: Path) -> str | None:
    """Per-step scalars of every stage that ran, one TensorBoard run per stage under ``logdir``:
    ``step/data_wait_ms``, ``step/idle_ms`` (the GPU's idle gap on CUDA, else the step's time
    outside compute), ``step/images_per_s``; steps numbered across rounds in the order they ran.

    Returns a note when TensorBoard is not installed (the ``plot`` extra brings it), else None.
    """
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return "tensorboard/ skipped: tensorboard is not installed (pip install 'fastload[plot]')"
    from torch.utils.tensorboard import SummaryWriter

    for o in outcomes:
        if o.result is None:
            continue
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in o.stage.name)
        writer = SummaryWriter(str(logdir / safe))
        try:
            step = 0
            for res in o.rounds:
                for rec in res.records:
                    idle = rec.gpu_idle if rec.gpu_idle is not None else rec.total - rec.compute
                    writer.add_scalar("step/data_wait_ms", rec.data_wait * 1e3, step)
                    writer.add_scalar("step/idle_ms", idle * 1e3, step)
                    writer.add_scalar("step/images_per_s", rec.images / rec.total if rec.total > 0 else 0.0, step)
                    step += 1
        finally:
            writer.close()
    return None


def _plot(rows: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "comparison.png skipped: matplotlib is not installed (pip install 'fastload[plot]')"
    ran = [r for r in rows if r["status"] == "ran"]
    if not ran:
        return "comparison.png skipped: no stage ran"
    names = [r["name"] for r in ran]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, [r["images_per_s"] for r in ran], color="#4C72B0")
    ax1.set_ylabel("images/s")
    ax1.set_title("Throughput")
    cuda = ran[0]["idle_source"] == "cuda-events"
    ax2.bar(names, [100 * r["gpu_idle_fraction"] for r in ran], color="#DD8452",
            label="GPU idle (CUDA events)" if cuda else "device idle (host clock)")
    ax2.bar(names, [100 * r["data_wait_fraction"] for r in ran], color="none", edgecolor="black",
            hatch="//", label="host data wait")
    ax2.set_ylabel("% of step time")
    ax2.set_ylim(0, 100)
    ax2.set_title("Where the step waits")
    ax2.legend(loc="upper right")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def check_out(out: Path, *, force: bool) -> None:
    """Refuse to write over the results of an earlier run in ``out`` unless ``force``.

    Raises:
        RecipeError: ``out`` already holds a results.json.
    """
    from fastload.errors import RecipeError

    if (out / "results.json").exists() and not force:
        raise RecipeError(f"{out} already holds the results of an earlier run (results.json).\n"
                          "HINT: pass --force to overwrite them, or another --out folder.")


def new_run_folder(runs: Path, recipe_name: str, data_name: str) -> Path:
    """``runs/<recipe>-<data>``, or the first of ``-2``, ``-3``, ... that holds no results yet:
    a run never overwrites the last one's folder."""
    data = "".join(c if c.isalnum() or c in "-_." else "_" for c in data_name.split(" (")[0]) or "data"
    base = runs / f"{recipe_name}-{data}"
    out, k = base, 1
    while (out / "results.json").exists():
        k += 1
        out = base.with_name(f"{base.name}-{k}")
    return out


def write_outputs(out: Path, recipe, outcomes, data) -> tuple[dict[str, Any], list[str]]:
    """Write results.json, results.csv, comparison.png and traces/<stage>.json; return the results and notes."""
    out.mkdir(parents=True, exist_ok=True)
    results = results_json(recipe, outcomes, data)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    cols = ["name", "type", "status", "workers", "images_per_s", "ci95_low", "ci95_high", "steps_per_s",
            "data_wait_fraction",
            "copy_fraction", "compute_fraction", "gpu_idle_fraction", "idle_source", "speedup_vs_baseline", "reason"]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for row in results["stages"]:
            ci = row.get("images_per_s_ci95") or [None, None]
            w.writerow({**row, "ci95_low": ci[0], "ci95_high": ci[1]})
    notes = []
    for note in (_plot(results["stages"], out / "comparison.png"), write_tensorboard(outcomes, out / "tensorboard")):
        if note:
            notes.append(note)
    (out / "traces").mkdir(exist_ok=True)
    for pid, o in enumerate(outcomes, 1):
        if o.result is not None:
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in o.stage.name)
            trace = chrome_trace(o.trace_round if o.trace_round is not None else o.result, pid=pid)
            (out / "traces" / f"{safe}.json").write_text(json.dumps(trace))
    return results, notes


def compare_results(a: dict, b: dict) -> str:
    """Two ``results.json`` side by side, stage by stage, with B/A ratios; a ratio is marked
    "~" (within noise) when the two stages' 95% intervals overlap."""
    rows_a = {r["name"]: r for r in a["stages"]}
    rows_b = {r["name"]: r for r in b["stages"]}
    names = list(rows_a) + [n for n in rows_b if n not in rows_a]
    head = (f"{'stage':<16}{'A images/s':>12}{'A 95%':>13}{'B images/s':>12}{'B 95%':>13}{'B/A':>8}"
            f"{'A wait':>9}{'B wait':>9}{'A idle':>9}{'B idle':>9}")
    lines = [f"A: {a['recipe']['name']} ({a['environment'].get('gpu') or 'no GPU'}, "
             f"{a['environment']['cpus']['usable']} CPUs)",
             f"B: {b['recipe']['name']} ({b['environment'].get('gpu') or 'no GPU'}, "
             f"{b['environment']['cpus']['usable']} CPUs)", head, "-" * len(head)]

    def ran(r):
        return bool(r) and r.get("status") == "ran"

    def cell(r, key, fmt):
        return format(r[key], fmt) if ran(r) else "-"

    noisy = False
    for n in names:
        ra, rb = rows_a.get(n), rows_b.get(n)
        ratio = "-"
        if ran(ra) and ran(rb):
            close = overlap(ra.get("images_per_s_ci95"), rb.get("images_per_s_ci95"))
            noisy |= close
            ratio = ("~" if close else "") + f"{rb['images_per_s'] / ra['images_per_s']:.2f}x"
        lines.append(f"{n:<16}{cell(ra, 'images_per_s', '.0f'):>12}{_ci(ra) if ran(ra) else '-':>13}"
                     f"{cell(rb, 'images_per_s', '.0f'):>12}{_ci(rb) if ran(rb) else '-':>13}{ratio:>8}"
                     f"{cell(ra, 'data_wait_fraction', '.0%'):>9}{cell(rb, 'data_wait_fraction', '.0%'):>9}"
                     f"{cell(ra, 'gpu_idle_fraction', '.0%'):>9}{cell(rb, 'gpu_idle_fraction', '.0%'):>9}")
    if noisy:
        lines.append("~ within noise: the two runs' 95% intervals overlap")
    return "\n".join(lines)
