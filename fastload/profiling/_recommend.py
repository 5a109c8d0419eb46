"""The verdict and the ranked recommendations of a profile, from a small model of the loader fitted
to the measurement; each recommendation with its predicted images/s ratio and its code change. The model
the rules read (and the module doc of how it predicts): ``_gain.py``.

The uint8 presets as ``--verify-fix`` applies them (alone, at today's worker count: ``s["uint8_presets"]``)
have two predictions, one per place the normalising can run: on the CUDA device, where it is taken as
free (``t_b`` and ``t_cpu`` lose the ToTensor/Normalize share); or, without CUDA in the training
process, in that process after each batch arrives: the float share of a batch, ``t_b × share``, is
taken to cost the same there and is added to the step's own time ``c`` (one CPU busy), while the
samples lose it. Both are ratios of the model's steps at today's worker count (new over today's), so
its error at today's point cancels: with 0 workers the main-process variant is the same work in the
same process, 1.0x. The verify output prints the one for where the rerun normalised
(``verify_prediction``).

Must not: run anything, import torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastload.profiling._gain import (Model, cpu_bound_verdict, fit_model, own_machine, predict_step,
                                      storage_bound, workers_value)
from fastload.profiling._snippet import loader_snippet, store_snippet, uint8_snippet

INPUT_BOUND = 0.10  #: below this input-bound share faster loading cannot buy more than ~11%
FASTLOAD_DATASETS = ("fastload.load.dataset.LMDBImageDataset",)  #: already read from a store: no convert advice
STORE_DOMINANT = 0.5  #: decode + transforms at least this share of sample time: the store and presets come first
#: the training loader's dataset classes --verify-fix can swap the uint8 presets into (``_uint8.py`` checks the rest)
FOLDER_DATASETS = ("torchvision.datasets.folder.ImageFolder", "torchvision.datasets.folder.DatasetFolder",
                   "torch.utils.data.dataset.Subset")
UINT8_CHANGE = "train_transform + collate_uint8 + DevicePrefetcher (uint8 to the device, normalise there)"
UINT8_ASSUMPTION = ("normalised in the training process after each batch (no CUDA there): taken to cost what "
                    "ToTensor/Normalize measured per sample, now in the step; fastload's own decode and crop are "
                    "taken to cost what torchvision's did")


def change_to_verify(s: dict[str, Any], only: str | None = None) -> dict[str, Any] | None:
    """What ``--verify-fix`` applies: the top recommendation fastload can apply from outside, else (nothing
    to apply, e.g. CPU-bound training) the worker count a user would try, with its predicted ratio.

    ``only`` (``--verify-change``): the top recommendation that changes that alone (``num_workers``, ``pin_memory``,
    ``uint8_presets``; not the store's, which also sets the workers), else its prediction (a worker count, or the
    uint8 presets on their own).
    """
    for r in s["recommendations"]:  # with ``only``: a recommendation that changes that alone (not the store's)
        if r.get("apply") and (only is None or set(r["apply"]) == {only}):
            return {**r, "verify_why": "the top recommendation that can be applied from outside" if only is None
                    else f"the top recommendation that changes {only}"}
    if only == "uint8_presets" and s.get("uint8_presets"):
        u = s["uint8_presets"]
        return {"change": UINT8_CHANGE, "stage": "fast", "apply": {"uint8_presets": True}, "verify_gain": u,
                "expected_gain": u["device"] if u["device"] is not None else u["main process"],
                "verify_why": "asked for (--verify-change) though not recommended: checking its prediction",
                **({"bound": True} if s["loader"].get("backend") == "threads" else {})}  # no thread model: a bound
    if only not in (None, "num_workers"):
        return None
    recs = s["recommendations"]
    no_gain = only is None and recs and recs[0].get("stage") is None and recs[0]["expected_gain"] <= 1.0
    for p in s.get("predictions", []):
        if "num_workers" in p.get("apply", {}) and p["apply"]["num_workers"] != s["loader"]["num_workers"]:
            # one prediction per run: the recommendation's "no gain", not the model's figure it would not promise
            if no_gain and p["expected_gain"] > 1.0:
                p = {k: v for k, v in p.items() if k != "bound"}
                p.update(expected_gain=recs[0]["expected_gain"], advice=True)
            return {**p, "verify_why": "no recommendation to apply: checking the prediction that this worker "
                                       "count does not help" if only is None else
                                       "asked for (--verify-change) though not recommended: checking its prediction"}
    return None


def verify_prediction(pick: dict[str, Any], applied: dict[str, Any]) -> tuple[float | None, str | None]:
    """The predicted ratio for what the rerun applied, and the assumption behind it (None: the usual model).

    The uint8 presets have two: normalised on the CUDA device, or in the training process (no CUDA there).
    """
    variants, done = pick.get("verify_gain"), applied.get("uint8_presets")
    if not variants or not isinstance(done, dict):
        return pick["expected_gain"], None
    if pick.get("stage") == "store":  # the preset timed on the user's own files, not taken from torchvision's
        measured = "the preset's CPU time per sample measured on the files themselves (fastload profile's process)"
        return (variants["main process"], measured + "; normalised in the training process (no CUDA there)") \
            if done.get("normalise") == "main process" else (variants["device"] or pick["expected_gain"], measured)
    if done.get("normalise") == "main process":
        return variants["main process"], UINT8_ASSUMPTION
    return variants["device"], f"normalised on {done.get('normalise')}: the float conversion is taken as free there"


FOREIGN_CPUS = 0.25  #: other processes took at least this many of the CPUs during the run: a shared machine
CONTENDED_RQ = 0.25  #: samples or the step waited for a CPU at least this share of their time


def recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """The verdict and the ranked ``{change, why, expected_gain, stage, code, apply}`` list for a summary.

    Also sets ``s["predictions"]``: the predicted images/s ratio of every worker count tried.

    Where other processes took CPUs during the run (``s["machine_load"]``, measured by ``fastload profile``)
    and the samples or the step waited for a CPU, the advice is the one for the machine as the user's own
    (``own_machine``): the same profile under more or less load gives the same advice, and the verdict says
    what was measured, what other processes took, and what the run read under that load when it differs.
    """
    load = s.get("machine_load") or {}
    rq = max((s.get("samples") or {}).get("runqueue_share") or 0.0, (s.get("step_cpu") or {}).get(
        "runqueue_share") or 0.0)
    if (load.get("other_cpus") or 0.0) < FOREIGN_CPUS or rq < CONTENDED_RQ:
        return _recommend(s, plan_workers=plan_workers, has_gpu=has_gpu)
    loaded = {**s, "machine_load": None}
    loaded_verdict, loaded_recs = _recommend(loaded, plan_workers=plan_workers, has_gpu=has_gpu)
    quiet = own_machine(s)
    verdict, recs = _recommend(quiet, plan_workers=plan_workers, has_gpu=has_gpu)
    for key in ("predictions", "uint8_presets"):
        if key in quiet:
            s[key] = quiet[key]
    la = load.get("load_average")
    said = (f"shared machine: other processes took {load['other_cpus']:.1f} of the {load.get('cpus', '?')} CPUs "
            f"during the run" + (f" (load average {la:.1f})" if la is not None else "")
            + f", and this run's samples or step waited for a CPU up to {rq:.0%} of their time")
    if loaded_verdict.split(":", 1)[0] != verdict.split(":", 1)[0] or (
            loaded_recs[:1] and recs[:1] and loaded_recs[0]["change"] != recs[0]["change"]):
        said += (f"; the advice below is for the machine as your own (those waits removed); under this load the "
                 f"run read: {loaded_verdict.split(';', 1)[0]} (top: {loaded_recs[0]['change']})" if loaded_recs
                 else "")
    else:
        said += "; the advice is the same with those waits removed (the machine as your own)"
    for r in recs:
        r["why"] += "; for the machine as your own (other processes' load removed)"
    return f"{verdict.split(':', 1)[0]} ({said}):{verdict.split(':', 1)[1]}", recs


@dataclass(kw_only=True)
class Recommendation:
    """One ranked change: what to change (``change``), the loader stage it belongs to (``stage``; None: not
    the loader), why, and the predicted images/s ratio (``expected_gain``; ``bound``: an upper bound, not a
    prediction); the code change, what ``--verify-fix`` applies (``apply``) and its own prediction
    (``verify_gain``, ``verify_part``) where there are."""

    change: str
    stage: str | None
    why: str
    expected_gain: float
    code: str | None = None
    apply: dict[str, Any] | None = None
    bound: bool = False
    verify_gain: Any = None
    verify_part: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record profile.json and the report read: the optional keys only where they are set."""
        d: dict[str, Any] = {"change": self.change, "stage": self.stage, "why": self.why,
                             "expected_gain": self.expected_gain}
        for key in ("code", "apply", "verify_gain", "verify_part"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.bound:
            d["bound"] = True
        return d


# ---- the rules: one function each, in the order their advice is listed before ranking (a tie keeps it) ----

def rule_workers(m: Model) -> list[Recommendation]:
    """More (or fewer) DataLoader workers, when the model predicts at least 5% for the best count."""
    if not m.samples or (m.contended and (m.best > m.w_now or m.best_gain < 1.05)):
        return []
    best, w_now, s = m.best, m.w_now, m.s
    if best == w_now or m.ratio[best] < 1.05:
        return []
    value = workers_value(best, m.plan_workers)
    change = f'num_workers="auto" (-> {best})' if value == "auto" else f"num_workers={best}"
    if best < w_now:
        why = (f"the step wants {m.cores:.1f} of {m.cpus} CPUs; {w_now} workers take CPUs it needs: "
               f"{best} predicted faster")
    elif w_now == 0:
        why = (f"the loader runs in the training process: each step waits for {s['images_per_step']:.0f} "
               f"samples of {m.samples['per_sample_ms']:.1f} ms")
    else:
        why = (f"{w_now} workers deliver a batch every {m.tb / w_now * 1e3:.0f} ms; the step needs one every "
               f"{m.c * 1e3:.0f} ms")
    if m.io_bound and best > m.cpus:
        why += (f"; samples spend {m.samples.get('blocked_share', 1 - m.share):.0%} of their time blocked "
                f"(I/O, sleep), so workers beyond the {m.cpus} CPUs overlap the waiting")
    if m.shares_step_cpus(best):
        why += (f"; an upper bound: the step's {m.cores:.1f} threads would share CPUs with busy workers, and "
                "a multi-threaded step then waits for its threads at every parallel region (check with "
                f"--verify-fix); torch.set_num_threads({max(1, m.cpus - best)}) in the script keeps the step "
                "off the workers' CPUs")
    return [Recommendation(change=change, stage="workers", why=why, expected_gain=m.ratio[best],
                           apply={"num_workers": best}, bound=m.shares_step_cpus(best),
                           code=_code(m.created, {"num_workers": value}))]


def rule_storage(m: Model) -> list[Recommendation]:
    """A store in object storage whose samples mostly wait for shard downloads: cache, prefetch, shard size."""
    if not storage_bound(m):
        return []
    warm = m.gain(m.tb * (1 - m.parts["download"]), m.tcpu, m.n_after)
    return [Recommendation(**r) for r in _storage_recs(m.s, warm)]


def _store_applies(m: Model) -> bool:
    folder = m.s["loader"].get("image_folder") or {}
    return bool(m.samples) and bool(folder.get("root")) and m.s["loader"].get("dataset") not in FASTLOAD_DATASETS \
        and m.parts.get("decode", 0.0) + m.parts.get("transform", 0.0) >= STORE_DOMINANT


def rule_store(m: Model) -> list[Recommendation]:
    """A torchvision ImageFolder whose decode and transforms dominate: the store + uint8 presets."""
    if not _store_applies(m):
        return []
    rec = _store_rec(m.s, m.s["loader"]["image_folder"], tb=m.tb, tcpu=m.tcpu, c=m.c, cores=m.cores, cpus=m.cpus,
                     w_now=m.w_now, plan_workers=m.plan_workers, cap=m.load_cap, has_gpu=m.has_gpu, cuda=m.cuda,
                     threads=m.threads)
    return [Recommendation(**rec)]


def rule_lmdb(m: Model) -> list[Recommendation]:
    """Small files opened and read per sample (and no store advice already): convert to a store."""
    if not m.samples or m.parts["read"] < 0.15 or m.s["loader"].get("dataset") in FASTLOAD_DATASETS \
            or _store_applies(m):
        return []
    read = m.parts["read"]
    return [Recommendation(change="fastload convert DIR store.lmdb, then LMDBImageDataset(store.lmdb)", stage="lmdb",
                           why=f"{read:.0%} of sample time is opening and reading small files",
                           expected_gain=m.gain(m.tb * (1 - read), m.tcpu * (1 - read), m.n_after),
                           code=store_snippet(m.created))]


def _uint8_variants(m: Model) -> None:
    """``s["uint8_presets"]``: the uint8 presets alone at today's worker count, as --verify-fix applies them:
    normalised on the device (free there), or, without CUDA in the process, in the training process after
    each batch, taken to cost what ToTensor/Normalize cost in the samples (UINT8_ASSUMPTION), relative to the
    model's own step at today's count, so that its error there cancels: the same work moved within one
    process is 1.0x, not the model's error."""
    floats, tb, tcpu, w_now = m.floats, m.tb, m.tcpu, m.w_now
    tb_u8, tcpu_u8 = tb * (1 - floats), tcpu * (1 - floats)
    moved = tb * floats
    host = device = None
    if m.threads:
        device = m.gain(tb_u8, tcpu_u8, (w_now,)) if m.has_gpu else None  # a bound only (no thread model)
    else:
        now = m.step_time(w_now)
        t_host = predict_step(w_now, c=m.c + moved, tb=tb_u8, tcpu=tcpu_u8, cpus=m.cpus,
                              step_cores=(m.c * m.cores + moved) / (m.c + moved))
        host = min(m.load_cap, m.cpu_cap(tb_u8), now / t_host)
        if m.has_gpu:
            device = min(m.load_cap, m.cpu_cap(tb_u8), now / m.step_time(w_now, tb_u8, tcpu_u8))
    m.s["uint8_presets"] = {"float_transform_share": floats, "main process": host, "device": device}


def rule_uint8(m: Model) -> list[Recommendation]:
    """ToTensor/Normalize on the CPU: the uint8 presets, normalised on the device."""
    if not m.samples:
        return []
    floats = m.floats
    if floats > 0:
        _uint8_variants(m)
    if floats < 0.10:
        return []
    s, has_gpu = m.s, m.has_gpu
    rec = Recommendation(change=UINT8_CHANGE, stage="fast",
                         why=f"{floats:.0%} of sample time is ToTensor/Normalize (float conversion on the CPU, "
                             "4x the bytes through worker queues)"
                             + ("" if has_gpu else "; without a GPU the normalising moves to the step's CPUs"),
                         expected_gain=1.0, code=uint8_snippet(m.created))
    # one prediction per run: the figure is the presets alone at today's worker count (what --verify-fix
    # applies), normalised on the device where there is one, else in the training process; where the
    # rerun would normalise elsewhere (a GPU this script does not use) that figure is said here too
    u = s.get("uint8_presets") or {}
    variant = u.get("device") if has_gpu else u.get("main process")
    rec.expected_gain = variant if variant is not None else m.gain(
        m.tb * (1 - floats), m.tcpu * (1 - floats), m.n_after) if has_gpu else 1.0
    if has_gpu and not m.cuda and u.get("main process") is not None:
        rec.verify_part = "normalising in the training process (this script used no CUDA)"
        rec.why += (f"; --verify-fix normalises in the training process, as this script uses no CUDA: "
                    f"predicted {u['main process']:.2f}x for that")
    if s["loader"].get("dataset") in FOLDER_DATASETS:  # --verify-fix can swap it in (_uint8.py)
        rec.apply, rec.verify_gain = {"uint8_presets": True}, s["uint8_presets"]
    return [rec]


def rule_dali_gpu(m: Model) -> list[Recommendation]:
    """Saturated CPUs decoding JPEGs, with a GPU: decode on the GPU."""
    if not (m.samples and m.has_gpu and m.saturated and m.parts["decode"] >= 0.25):
        return []
    cut = m.parts["decode"] + m.floats
    return [Recommendation(change='DALILoader(device="gpu") (nvJPEG decode on the GPU)', stage="dali-gpu",
                           why=f"the CPUs are saturated and {m.parts['decode']:.0%} of sample time is JPEG decode",
                           expected_gain=m.gain(m.tb * (1 - cut), m.tcpu * (1 - cut), m.n_after),
                           code="from fastload.dali import DALILoader\n"
                                "loader = DALILoader(\"store.lmdb\", batch_size=..., device=\"gpu\")")]


def rule_pin_memory(m: Model) -> list[Recommendation]:
    """Host-to-device copies from pageable memory in the GPU timeline: pinned batches."""
    s = m.s
    if not (m.has_gpu and s["loader"]["pinned"] is False and s.get("kineto") and s["kineto"].get("htod_copy_fraction")):
        return []
    h = s["kineto"]["htod_copy_fraction"]
    return [Recommendation(change="pin_memory=True (and .to(device, non_blocking=True))", stage="workers",
                           why=f"host-to-device copies from pageable memory took {h:.0%} of the window",
                           expected_gain=min(m.cap, 1.0 / (1.0 - h)), apply={"pin_memory": True},
                           code=_code(m.created, {"pin_memory": True}))]


#: Every rule of an input-bound run, in listing order: a new recommendation is one function here and one test.
RULES: list[Callable[[Model], list[Recommendation]]] = [
    rule_workers, rule_storage, rule_store, rule_lmdb, rule_uint8, rule_dali_gpu, rule_pin_memory]


def _recommend(s: dict[str, Any], *, plan_workers: int, has_gpu: bool) -> tuple[str, list[dict[str, Any]]]:
    """``recommend`` on the summary as measured (no correction for other processes' load)."""
    wait, idle, bound = s["data_wait_fraction"], s["gpu_idle_fraction"], s["input_bound_idle_fraction"]
    cuda = s["idle_source"] in ("cuda", "cuda-events")
    where = (f"the GPU was idle {idle:.0%} of measured time, {bound * 100:.0f} points of it while the training loop "
             "waited for the DataLoader" if cuda else
             f"the training loop waited for data {wait:.0%} of measured time (host clocks"
             + ("; no CUDA timeline: the GPU is idle at least while the step waits)" if has_gpu else
                "; no GPU: the step computes on the same CPUs as the loading)"))
    if bound < INPUT_BOUND:
        s["predictions"] = []
        recs: list[Recommendation] = []
        host_idle = idle - bound if cuda else 0.0
        if host_idle >= 0.15:
            recs.append(Recommendation(
                change="remove host sync points in the step (loss.item(), .cpu(), printing every step); "
                       "then CUDA graphs or torch.compile for launch overhead", stage=None,
                why=f"the GPU was idle {host_idle:.0%} of the time while the host was NOT waiting for data",
                expected_gain=1.0 / (1.0 - host_idle)))
        recs.append(Recommendation(change="none on the loading side", stage=None, expected_gain=1.0 / (1.0 - bound),
                                   why=f"compute-bound: faster loading will not help: only {bound:.0%} of the step "
                                       "was spent waiting for data"))
        kind = "host-bound" if host_idle >= 0.15 else "compute-bound"
        return f"{kind}: {where}; faster loading will not help", [r.to_dict() for r in recs]

    m = fit_model(s, plan_workers=plan_workers, has_gpu=has_gpu)
    recs = [r for rule in RULES for r in rule(m)]
    cpu_verdict = cpu_bound_verdict(m)
    storage_verdict = None
    if storage_bound(m):
        storage_verdict = (f"storage-bound: the loop waited for shard downloads "
                           f"{s.get('download_wait_fraction', bound * m.parts['download']):.0%} of the time")
        cpu_verdict = None  # the samples wait for the link: no CPU verdict (waiting takes no CPU) overrides that
    if m.threads:
        for r in recs:
            r.bound = True  # an upper bound, not a prediction (no thread model)
    recs = [r for r in recs if r.expected_gain >= 1.02]  # a change predicted to gain nothing is no advice
    if cpu_verdict:
        recs.append(Recommendation(change="none on the loading side: make the step cheaper (smaller model or batch, "
                                          "torch.compile), or train on a GPU", stage=None, expected_gain=1.0,
                                   why=cpu_verdict.split(": ", 1)[1]))
    elif not recs:
        recs.append(Recommendation(
            change="A/B the loading stages on your data: fastload recipe run", stage=None,
            why="input-bound, but no single part of the sample time stands out"
                + ("; the loading already uses every CPU this process has: only cheaper samples can "
                   "help" if m.cap < 1.02 else ""),
            expected_gain=m.cap, bound=True))
    recs.sort(key=lambda r: -r.expected_gain)
    # the store's lines include num_workers="auto": within 2% of the best (both at the same cap), it comes first
    store = next((r for r in recs if r.stage == "store"), None)
    if store is not None and store.expected_gain >= recs[0].expected_gain / 1.02:
        recs.remove(store)
        recs.insert(0, store)
    out = [r.to_dict() for r in recs]
    if storage_verdict:
        return "; ".join([storage_verdict, where, *m.details]), out
    if cpu_verdict:
        return "; ".join([cpu_verdict, where, *m.details]), out
    return "input-bound: " + "; ".join([where, *m.details]), out


def _store_rec(s: dict[str, Any], folder: dict[str, Any], *, tb: float, tcpu: float, c: float, cores: float,
               cpus: int, w_now: int, plan_workers: int, cap: float, has_gpu: bool, cuda: bool,
               threads: bool) -> dict[str, Any]:
    """The store + uint8 presets + fastload's DataLoader (the README's three lines) for a torchvision ImageFolder
    whose decode and transforms dominate the sample time (the model in docs/profile-advice.md#the-store).

    Predicted from two measurements: the profile's per-sample time of reading, decoding and transforming, and
    the preset's CPU time per sample on a few of the user's own files (``presets_measured``, timed by the
    profiler after the run) on the bytes ``fastload convert`` stores; the store's own read (an mmap'd LMDB
    record) is taken as free, and the preset's time waits for a CPU as the profile's samples did. The lines set
    ``num_workers="auto"``: predicted at the plan's worker count. Without CUDA in the training process the
    normalising moves into it (``DevicePrefetcher(loader, "cpu")``), taken at its measured cost per sample.
    ``--verify-fix`` cannot make the store (that is the ``convert``): it applies the presets to the files
    themselves with the same worker count (``_uint8.py``), whose prediction (``verify_gain``) keeps the files'
    read and times the preset on the files' own bytes. Without a measurement (the transform has no preset,
    or no file could be read) the figure is the perfect-loader bound.
    """
    from fastload.profiling._snippet import store_path_for, store_presets_snippet

    samples, parts = s["samples"], s["samples"]["parts"]
    images, per = s["images_per_step"], samples["per_sample_ms"]
    share, rq = samples["cpu_share"], samples.get("runqueue_share") or 0.0
    measured = s.get("presets_measured")
    n = plan_workers if plan_workers > 0 else w_now
    code = store_presets_snippet(folder["root"], folder.get("repr"), folder.get("mean"), folder.get("std"),
                                 s["loader"].get("created_at"), cuda=cuda)
    removed = parts.get("read", 0.0) + parts.get("decode", 0.0) + parts.get("transform", 0.0)
    store = store_path_for(folder["root"])
    head = (f"{parts.get('decode', 0.0) + parts.get('transform', 0.0):.0%} of each sample's time is decode and "
            f"transforms of {folder['root']}'s files (PIL, torchvision)")
    if not measured or threads:
        why = (head + "; the store keeps the images ready to decode, the uint8 presets decode only what the crop "
               "needs and leave the float conversion to the device. Not measured here ("
               + ("backend='threads': no thread model" if threads else folder.get("refused")
                  or "none of the dataset's files could be timed") + "): the figure is the perfect-loader bound")
        return {"change": f"pack into a fastload store (fastload convert {folder['root']} {store}) + uint8 presets "
                          "+ fastload.DataLoader", "stage": "store", "why": why, "expected_gain": cap, "bound": True,
                "code": code}
    wait_per_cpu = rq / share if share > 0 else 0.0  # the profile's samples waited this long for a CPU per CPU second

    T = 1.0 / s["steps_per_s"]

    def step_with(sample_ms: float, cut: float, moved_ms: float) -> float:
        """The ratio when the ``cut`` share of the sample time becomes ``sample_ms`` of preset CPU time (and
        ``moved_ms`` per sample of normalising joins the step)."""
        added = images * sample_ms * (1 + wait_per_cpu) / 1e3
        tb_new, tcpu_new = tb * (1 - cut) + added, tcpu * (1 - cut) + added
        moved = images * moved_ms / 1e3
        k = (c * cores + moved) / (c + moved) if moved else cores
        t = predict_step(n, c=c + moved, tb=tb_new, tcpu=tcpu_new, cpus=cpus, step_cores=k)
        return min(cap, T * cpus / max(1e-12, tcpu_new), T / t)

    norm = measured["normalise_ms"]
    full = {"device": step_with(measured["store_ms"], removed, 0.0) if has_gpu else None,
            "main process": step_with(measured["store_ms"], removed, norm)}
    files_kept = parts.get("decode", 0.0) + parts.get("transform", 0.0)  # the files are still opened and read
    files = {"device": step_with(measured["files_ms"], files_kept, 0.0) if has_gpu else None,
             "main process": step_with(measured["files_ms"], files_kept, norm)}
    where = "device" if cuda else "main process"
    gain, verify = full[where], files[where]
    auto = f'num_workers="auto" (-> {n})' if n == plan_workers and n > 0 else f"num_workers={n}"
    why = (head + f" ({per * removed:.1f} ms of {per:.1f} ms per sample); the preset measured "
           f"{measured['store_ms']:.1f} ms of CPU per sample on {measured['files']} of these images as the store "
           f"holds them" + ("" if cuda else f", and normalising in the training process {norm:.2f} ms per sample "
                            "(no CUDA there)") + f"; predicted with {auto}")
    # an upper bound, always: the store's own read is taken as free and nothing here can run the convert to check
    # it (on a 240-PNG folder under load the applied lines measured 0.44-0.64 of the figure; docs/profile-advice.md)
    rec = {"change": f"pack into a fastload store + uint8 presets + fastload.DataLoader (fastload convert "
                     f"{folder['root']} {store})", "stage": "store", "why": why, "expected_gain": gain, "code": code,
           "bound": True}
    rec["why"] += "; an upper bound: the store's own read is taken as free"
    if n > 0 and cores >= 1.2 and cores + min(n, tcpu / T) > cpus + 0.05:  # as shares_step_cpus in _recommend
        rec["why"] += (f", and the step's {cores:.1f} threads would share CPUs with busy workers "
                       f"(torch.set_num_threads({max(1, cpus - n)}) keeps the step off them)")
    if s["loader"].get("dataset") in FOLDER_DATASETS:
        rec.update(apply={"uint8_presets": True, **({"num_workers": n} if n != w_now else {})},
                   verify_gain=files, verify_part="the presets on your files" + (f" with {auto}" if n != w_now else "")
                   + ": --verify-fix cannot make the store (run the convert above)")
        rec["why"] += ("; --verify-fix applies the presets to the files themselves"
                       + (f" with {auto}" if n != w_now else "") + f", predicted {verify:.2f}x (it cannot make the "
                       "store: that is the convert)")
    return rec


def _storage_recs(s: dict[str, Any], warm_gain: float) -> list[dict[str, Any]]:
    """What shortens the wait for shard downloads: a cache that holds the store (later epochs download
    nothing: the download part is gone), deeper prefetch (when the link has room), and the shard size."""
    cache = (s.get("samples") or {}).get("shard_cache") or {}
    rate = cache["bytes_downloaded"] / cache["download_s"] / 1e6 if cache.get("download_s") else None
    per = cache["bytes_downloaded"] / cache["downloads"] / 1e6 if cache.get("downloads") else None
    return [
        {"change": "cache_limit at least the store's size (on a local disk)", "stage": "storage",
         "expected_gain": warm_gain,
         "why": "from the second epoch on every shard is read from the node cache: no download wait (the first "
                "epoch still downloads every shard once)",
         "code": 'ds = LMDBImageDataset("s3://bucket/store/", cache_dir="/local/nvme/cache", '
                 'cache_limit="<store size>")'},
        {"change": "prefetch deeper: fastload.ShardSampler(ds, window=8) as the DataLoader's sampler",
         "stage": "storage", "expected_gain": warm_gain,
         "why": "the next window's shards download while the current one is read; a bigger window starts them "
                "earlier (the cache must hold 2 windows per rank). It helps only while the link has room"
                + (f": downloads ran at {rate:.1f} MB/s per process" if rate else ""),
         "code": "loader = DataLoader(ds, batch_size=..., sampler=fastload.ShardSampler(ds, window=8), ...)"},
        {"change": "shard size: fewer, larger shards if each is small (per-request latency), smaller ones if the "
                   "first batch waits long", "stage": "storage", "expected_gain": warm_gain,
         "why": "a shard is fetched whole before any of its samples is read"
                + (f"; shards here average {per:.1f} MB" if per else ""),
         "code": "fastload convert DIR s3://bucket/store/ --shard-size 256MB"},
    ]


def _code(created: str | None, changes: dict[str, Any]) -> str:
    """The loader line with ``changes``; where it cannot be read, the keyword to add (with the import)."""
    text = loader_snippet(created, changes)
    if text is not None:
        return text
    kw = ", ".join(f"{k}={v!r}".replace("'", '"') for k, v in changes.items())
    head = "from fastload import DataLoader\n" if changes.get("num_workers") == "auto" else ""
    return f"{head}loader = DataLoader(dataset, ..., {kw})"
