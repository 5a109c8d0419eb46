"""``fastload profile compare A/profile.json B/profile.json``: two runs of the user's script side by side.

Owns: telling a ``profile.json`` from a recipe's ``results.json`` (a clear error naming the file
for the wrong kind), the side-by-side figures (images/s, data wait, idle, the sample breakdown)
with B/A ratios, and whether the difference is outside the noise of the steps measured.

Noise: each profile keeps its measured steps' count, mean and standard deviation
(``step_stats``). The difference of the mean step times is called real when it exceeds twice
its standard error, ``2 * sqrt(sd_a^2 / n_a + sd_b^2 / n_b)`` (about 95% for independent steps;
steps that drift together, e.g. a machine that gets busier, make it optimistic).

Rounds (``--verify-fix``): the within-run test above cannot see the machine's load changing between
two runs (a 1.50x "outside the noise" was that drift). ``compare_rounds`` takes baseline/changed
pairs run interleaved (A1 B1 A2 B2 ...): the measured ratio is the geometric mean of the rounds' B/A
ratios, and the noise is the larger of the spread of those ratios (max - min) and the drift of the
baseline runs (max / min - 1). The difference is called real only when every round moves the same
way and ``|ratio - 1|`` exceeds that noise; rounds that disagree by more than ``TOO_NOISY`` times, or
straddle both 1.0 and the prediction, are "cannot tell" (``too_noisy``), not a measurement.

Must not: run anything, import torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastload.errors import ProfileError

__all__ = ["read_profile", "read_result_or_profile", "compare_figures", "compare_rounds", "compare_profiles",
           "is_compare_call"]


def _kind(data: Any) -> str | None:
    if isinstance(data, dict) and "stages" in data:
        return "results"
    if isinstance(data, dict) and {"verdict", "recommendations", "loader", "images_per_s"} <= data.keys():
        return "profile"
    return None


def read_result_or_profile(path: Path) -> tuple[str, dict[str, Any]]:
    """``("profile" | "results", content)`` of a JSON file.

    Raises:
        ProfileError: unreadable, not JSON, or neither kind; the message names the file.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ProfileError(f"{path}: cannot read it as JSON ({exc})") from exc
    kind = _kind(data)
    if kind is None:
        raise ProfileError(f"{path}: neither a profile.json (from `fastload profile`) nor a results.json (from "
                           "`fastload recipe run`)")
    return kind, data


def read_profile(path: Path) -> dict[str, Any]:
    """A ``profile.json``; a recipe's ``results.json`` or any other file is refused by name."""
    kind, data = read_result_or_profile(path)
    if kind != "profile":
        raise ProfileError(f"{path} is a recipe's results.json, not a profile.json\nHINT: compare two results.json "
                           "with `fastload recipe compare A/results.json B/results.json`")
    return data


def is_compare_call(command: tuple[str, ...] | list[str]) -> bool:
    """``fastload profile compare A B``: the subcommand (a program called ``compare`` given two existing
    ``.json`` files is taken as the subcommand too)."""
    return (len(command) == 3 and command[0] == "compare"
            and all(Path(p).suffix == ".json" and Path(p).is_file() for p in command[1:]))


def compare_figures(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B/A ratios and whether the step-time difference is outside the noise (see the module doc)."""
    ra = b["images_per_s"] / a["images_per_s"] if a["images_per_s"] else float("nan")
    sa, sb = a.get("step_stats"), b.get("step_stats")
    outside = None
    se = None
    if sa and sb and sa["n"] > 1 and sb["n"] > 1:
        se = math.sqrt(sa["sd_s"] ** 2 / sa["n"] + sb["sd_s"] ** 2 / sb["n"])
        outside = abs(sb["mean_s"] - sa["mean_s"]) > 2 * se
    return {"images_per_s_ratio": ra, "outside_noise": outside, "step_diff_s": None if not (sa and sb) else
            sb["mean_s"] - sa["mean_s"], "step_diff_se_s": se}


TOO_NOISY = 1.5  #: rounds whose B/A ratios differ by more than this factor measure the machine, not the change


def compare_rounds(pairs: list[tuple[dict[str, Any], dict[str, Any]]],
                   predicted: float | None = None) -> dict[str, Any]:
    """Baseline/changed ``(A, B)`` profiles of interleaved rounds: the B/A ratio and whether it is outside the
    run-to-run noise (see the module doc). Needs at least two rounds to judge; with one, ``outside_noise`` is
    None (unknown), never True.

    ``too_noisy`` (then nothing is measured: "cannot tell"): the largest round ratio is more than ``TOO_NOISY``
    times the smallest, or the rounds straddle both 1.0 and ``predicted`` (they cannot tell the change from no
    change, nor from the prediction)."""
    ratios = [b["images_per_s"] / a["images_per_s"] for a, b in pairs if a["images_per_s"] > 0]
    base = [a["images_per_s"] for a, _ in pairs if a["images_per_s"] > 0]
    if not ratios:
        return {"ratio": float("nan"), "round_ratios": [], "noise": None, "baseline_drift": None,
                "outside_noise": None, "too_noisy": None}
    ratio = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if all(r > 0 for r in ratios) else 0.0
    spread = max(ratios) - min(ratios)
    drift = max(base) / min(base) - 1.0
    noise = max(spread, drift)
    outside = None
    if len(ratios) >= 2:
        same_way = all(r > 1 for r in ratios) or all(r < 1 for r in ratios)
        outside = same_way and abs(ratio - 1.0) > noise
    too_noisy = None
    if len(ratios) >= 2:
        lo, hi = min(ratios), max(ratios)
        straddles = predicted is not None and lo < 1.0 < hi and lo < predicted < hi
        too_noisy = (lo <= 0 or hi / lo > TOO_NOISY or straddles) and not outside
    return {"ratio": ratio, "round_ratios": ratios, "noise": noise, "ratio_spread": spread,
            "baseline_drift": drift, "outside_noise": outside, "too_noisy": too_noisy}


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.0%}" if pct else str(v) if isinstance(v, int) else f"{v:.1f}"


def compare_profiles(a: dict[str, Any], b: dict[str, Any], *, names: tuple[str, str] = ("A", "B")) -> str:
    """The table ``fastload profile compare`` prints."""
    cmp = compare_figures(a, b)
    rows: list[tuple[str, str, str, str]] = []

    def row(label: str, va: float | None, vb: float | None, pct: bool = False) -> None:
        ratio = "-" if not va or vb is None else f"{vb / va:.2f}x"
        rows.append((label, _fmt(va, pct), _fmt(vb, pct), ratio))

    row("images/s", a["images_per_s"], b["images_per_s"])
    row("step p50 ms", a["percentiles_ms"]["step"]["p50"], b["percentiles_ms"]["step"]["p50"])
    row("data wait", a["data_wait_fraction"], b["data_wait_fraction"], pct=True)
    row("device idle" if a.get("idle_source") != "host-clock" else "idle (host clocks)",
        a["gpu_idle_fraction"], b["gpu_idle_fraction"], pct=True)
    row("num_workers", a["loader"]["num_workers"], b["loader"]["num_workers"])
    ca, cb = a.get("step_cpu") or {}, b.get("step_cpu") or {}
    row("step CPUs busy", ca.get("cores"), cb.get("cores"))
    sa, sb = a.get("samples") or {}, b.get("samples") or {}
    row("sample ms", sa.get("per_sample_ms"), sb.get("per_sample_ms"))
    for part in ("read", "decode", "transform", "other"):
        row(f"  {part}", (sa.get("parts") or {}).get(part), (sb.get("parts") or {}).get(part), pct=True)
    row("steps measured", a["steps"], b["steps"])
    width = max(len(r[0]) for r in rows)
    lines = [f"A: {names[0]}", f"B: {names[1]}",
             f"{'':<{width}}  {'A':>10}  {'B':>10}  {'B/A':>7}"]
    lines += [f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>10}  {r[3]:>7}" for r in rows]
    if cmp["outside_noise"] is None:
        lines.append("noise: unknown (a profile from an older fastload has no per-step spread)")
    else:
        noise = 2 * cmp["step_diff_se_s"] * 1e3
        lines.append(f"mean step {cmp['step_diff_s'] * 1e3:+.1f} ms (B - A), noise +/-{noise:.1f} ms (2 standard "
                     "errors of the steps within each run; drift of the machine's load between the runs is not "
                     "in it: rerun both to check): " + ("the difference is outside the noise" if cmp["outside_noise"]
                                   else "within the noise: measure more steps to tell them apart"))
    if a.get("verdict") != b.get("verdict"):
        lines += [f"verdict A: {a.get('verdict')}", f"verdict B: {b.get('verdict')}"]
    return "\n".join(lines)
