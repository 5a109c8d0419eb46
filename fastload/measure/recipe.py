"""Recipes: one TOML file describes a dataset, a model and the loader stages to A/B.

Owns: reading and validating ``recipes/*.toml`` (stdlib ``tomllib``; every error names
the field and the valid choices, before any stage runs), applying CLI overrides, making
the data ready (the generated default dataset; a store converted on first use), and
running the stages in interleaved rounds on the same data: round ``k`` runs every stage
once, in the recipe's order rotated by ``k`` (``rounds.py``), each stage's loader built
fresh (``stages.py``), its workers shut down and joined, and torch's thread count put back
before the next stage is timed. With ``[dataset] cache = "cold"`` the folder's files and
the store are evicted from the page cache before every stage of every round
(``cache.py``), and whether the eviction was confirmed is recorded.

Stage types and what each does: ``stages.py``. A stage that cannot run here (no GPU,
DALI missing) is reported as skipped with the reason, never silently dropped.

Must not: print (the CLI does) or compute figures (``train.py``, ``rounds.py``, ``report.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.errors import RecipeError
from fastload.image import DEFAULT_SIZE
from fastload.measure.stages import FOLDER_STAGES, STAGE_TYPES

__all__ = ["STAGE_TYPES", "Recipe", "RecipeData", "RecipeRun", "RecipeStage", "load_recipe", "StageOutcome",
           "run_recipe", "prepare_data"]

_CACHE = ("warm", "cold")
_DEVICES = ("auto", "cpu", "cuda")
_AMP = ("none", "bf16", "fp16")


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise RecipeError(f"Unknown field {where}{unknown[0]!r}. Valid fields are: {', '.join(sorted(allowed))}.")


def _choice(value: Any, choices: Iterable, where: str) -> Any:
    if value not in choices:
        raise RecipeError(f"Unknown value {value!r} for field {where}. Valid values are "
                          f"{', '.join(repr(c) for c in choices)}.")
    return value


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RecipeError(f"Field {where} must be an integer >= {minimum}, got {value!r}.")
    return value


@dataclass(frozen=True, kw_only=True)
class RecipeData:
    """``[dataset]``: ``folder`` (an ImageFolder tree, or ``"default"`` for the generated default data) and
    ``store`` (an LMDB store of it; converted from ``folder`` on first use; default: in the cache),
    ``max_side`` (convert at reduced resolution), ``cache`` (``"warm"``: as the page cache
    happens to be; ``"cold"``: the files evicted before every stage of every round) and
    ``read_delay_ms`` (emulated latency per file opened, the same rule for folder and store:
    ``stages.FileOpenDelay``)."""

    folder: str = "default"
    store: str | None = None
    max_side: int | None = None
    cache: str = "warm"
    read_delay_ms: float = 0.0

    FIELDS = frozenset({"folder", "store", "max_side", "cache", "read_delay_ms"})

    def __post_init__(self) -> None:
        _choice(self.cache, _CACHE, "dataset.cache")
        if isinstance(self.read_delay_ms, bool) or not isinstance(self.read_delay_ms, (int, float)) \
                or self.read_delay_ms < 0:
            raise RecipeError(f"Field dataset.read_delay_ms must be a number >= 0, got {self.read_delay_ms!r}.")


@dataclass(frozen=True, kw_only=True)
class RecipeRun:
    """``[run]``: what every stage shares. ``steps`` and ``warmup`` are per stage per round.

    ``host_ms`` (simulated model only): the host-side CPU time of each step, spent holding
    the GIL before the device time is slept (``train.SimulatedStep``); default
    ``train.DEFAULT_HOST_MS``, the measured launch cost of a ResNet-50 step, written into the
    resolved recipe; 0 gives the pure-sleep device of fastload <= 0.3."""

    model: str = "simulated"
    step_ms: float | None = None
    host_ms: float | None = None
    batch_size: int = 64
    image_size: int = DEFAULT_SIZE
    steps: int = 30
    warmup: int = 5
    device: str = "auto"
    amp: str = "none"
    channels_last: bool = False
    seed: int = 0
    rounds: int = 1

    FIELDS = frozenset({"model", "step_ms", "host_ms", "batch_size", "image_size", "steps", "warmup", "device", "amp",
                        "channels_last", "seed", "rounds"})

    def __post_init__(self) -> None:
        _int(self.rounds, "run.rounds", 1)
        _int(self.batch_size, "run.batch_size", 1)
        _int(self.image_size, "run.image_size", 8)
        _int(self.steps, "run.steps", 1)
        _int(self.warmup, "run.warmup", 0)
        _choice(self.device, _DEVICES, "run.device")
        _choice(self.amp, _AMP, "run.amp")
        if self.model == "simulated" and (self.step_ms is None or self.step_ms < 0):
            raise RecipeError("Field run.step_ms (device milliseconds per batch, >= 0) is required when "
                              "run.model = 'simulated'.")
        if self.host_ms is not None and (isinstance(self.host_ms, bool) or not isinstance(self.host_ms, (int, float))
                                         or self.host_ms < 0):
            raise RecipeError(f"Field run.host_ms must be a number >= 0 (host CPU ms per step), got {self.host_ms!r}.")
        if self.model == "simulated" and self.host_ms is None:
            from fastload.measure.train import DEFAULT_HOST_MS

            object.__setattr__(self, "host_ms", DEFAULT_HOST_MS)


@dataclass(frozen=True, kw_only=True)
class RecipeStage:
    """``[[stage]]``: a loader configuration. ``workers``: ``"auto"`` or an int. ``prefetch_ahead``:
    ``DevicePrefetcher``'s ``ahead`` (false: each batch converted when the step asks for it, in the
    training thread; the A/B of preparing the next batch during the step)."""

    type: str
    name: str = ""
    workers: int | str | None = None
    prefetch_factor: int | None = None
    prefetch_ahead: bool = True

    FIELDS = frozenset({"type", "name", "workers", "prefetch_factor", "prefetch_ahead"})

    def __post_init__(self) -> None:
        _choice(self.type, STAGE_TYPES, "stage.type")
        if not self.name:
            object.__setattr__(self, "name", self.type)
        if self.workers is not None and self.workers != "auto":
            _int(self.workers, f"stage {self.name!r} workers", 0)
        if self.prefetch_factor is not None:
            _int(self.prefetch_factor, f"stage {self.name!r} prefetch_factor", 1)
        if not isinstance(self.prefetch_ahead, bool):
            raise RecipeError(f"Field stage {self.name!r} prefetch_ahead must be true or false, "
                              f"got {self.prefetch_ahead!r}.")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    name: str
    description: str = ""
    dataset: RecipeData = field(default_factory=RecipeData)
    run: RecipeRun = field(default_factory=RecipeRun)
    stages: tuple[RecipeStage, ...] = ()
    path: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, **overrides: Any) -> Recipe:
        """A copy with ``run.<field>`` / ``dataset.<field>`` values replaced (None: keep)."""
        run = {k[4:]: v for k, v in overrides.items() if k.startswith("run.") and v is not None}
        data = {k[8:]: v for k, v in overrides.items() if k.startswith("dataset.") and v is not None}
        try:
            return dataclasses.replace(self, run=dataclasses.replace(self.run, **run),
                                       dataset=dataclasses.replace(self.dataset, **data))
        except TypeError as exc:
            raise RecipeError(f"bad override: {exc}") from None


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read a recipe file and check its structure (``validate`` checks paths and the model,
    after CLI overrides; ``run_recipe`` calls it before any stage runs).

    Raises:
        RecipeError: unreadable TOML, an unknown field or stage type, or a bad value. The
            message names the field and the valid choices.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file.") from None
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None
    try:
        return _parse(raw, path)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc}") from None


def _parse(raw: dict, path: Path) -> Recipe:
    _check_keys(raw, {"name", "description", "dataset", "run", "stage"}, "")
    data = raw.get("dataset", {})
    run = raw.get("run", {})
    _check_keys(data, set(RecipeData.FIELDS), "dataset.")
    _check_keys(run, set(RecipeRun.FIELDS), "run.")
    stages = raw.get("stage", [])
    if not isinstance(stages, list) or not stages:
        raise RecipeError("A recipe needs at least one [[stage]] with a type: " + ", ".join(STAGE_TYPES) + ".")
    parsed_stages = []
    for k, st in enumerate(stages):
        _check_keys(st, set(RecipeStage.FIELDS), f"stage[{k}].")
        if "type" not in st:
            raise RecipeError(f"stage[{k}] has no type. Valid values are {', '.join(STAGE_TYPES)}.")
        try:
            parsed_stages.append(RecipeStage(**st))
        except TypeError as exc:
            raise RecipeError(f"stage[{k}]: {exc}") from None
    names = [s.name for s in parsed_stages]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RecipeError(f"Stage names must be unique; {dupes[0]!r} is used twice. Give each a name = '...'.")
    return Recipe(name=str(raw.get("name") or path.stem), description=str(raw.get("description", "")),
                  dataset=RecipeData(**data), run=RecipeRun(**run), stages=tuple(parsed_stages), path=str(path))


def validate(recipe: Recipe) -> None:
    """Checks that need the outside world: the dataset paths exist, the model exists.

    Raises:
        RecipeError: naming the field, what was wrong and what would be valid.
    """
    d = recipe.dataset
    if d.folder != "default" and not Path(d.folder).expanduser().is_dir():
        if not (d.store and Path(d.store).expanduser().exists()):
            raise RecipeError(f"Field dataset.folder: {d.folder} is not a folder. Give an ImageFolder tree, "
                              "'default' for the generated default dataset, or an existing dataset.store.")
    if d.max_side is not None:
        _int(d.max_side, "dataset.max_side", 8)
    needs_folder = FOLDER_STAGES & {s.type for s in recipe.stages}
    if needs_folder and d.folder != "default" and not Path(d.folder).expanduser().is_dir():
        raise RecipeError(f"Field dataset.folder: stages {sorted(needs_folder)} read the image folder, and "
                          f"{d.folder} is not one.")
    if recipe.run.model != "simulated":
        from fastload.measure.train import build_model

        build_model(recipe.run.model, num_classes=2)  # raises RecipeError for an unknown name


@dataclass
class PreparedData:
    folder: Path | None
    store: Path
    num_classes: int
    images: int = 0
    name: str = ""  # what the output calls the data: the folder's name, or "default (generated)"

    def describe(self) -> str:
        where = f"{self.folder}, store {self.store}" if self.folder else f"store {self.store}"
        return f"{self.name}: {self.images:,} images, {self.num_classes} classes ({where})"


def _prepare_data_once(data: RecipeData, *, progress: bool) -> PreparedData:
    """Under torch.distributed, rank 0 makes the data ready while the other ranks wait, then they all
    open it: one conversion per store (a second writer is refused by the store's lock)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return prepare_data(data, progress=progress)
    if dist.get_rank() == 0:
        try:
            return prepare_data(data, progress=progress)
        finally:  # also when it fails: the other ranks then fail on the same data instead of waiting forever
            dist.barrier()
    dist.barrier()
    return prepare_data(data, progress=False)  # complete now: a no-op that opens it


def prepare_data(data: RecipeData, *, progress: bool = True) -> PreparedData:
    """The generated default dataset made if needed; the store converted from the folder if missing.

    A conversion interrupted here resumes on the next run (it is ``fastload convert``).
    """
    from fastload.datasets import cache_dir, ensure_default_dataset
    from fastload.store.reader import StoreReader
    from fastload.pack.convert import ConvertOptions, convert

    folder = ensure_default_dataset(progress=progress) if data.folder == "default" else \
        Path(data.folder).expanduser().resolve()
    if data.store:
        store = Path(data.store).expanduser()
    else:
        # "jpeg95": non-JPEG sources stored as JPEG q95 (fastload 0.2); stores cached before it get a new name
        tag = hashlib.sha256(f"{folder}|{data.max_side}|jpeg95".encode()).hexdigest()[:10]
        store = cache_dir() / "stores" / f"{folder.name}-{tag}.lmdb"
    if folder.is_dir():
        convert(folder, store, ConvertOptions(max_side=data.max_side, progress=progress))
    reader = StoreReader(store)
    classes, images = len(reader.classes), len(reader)
    reader.close()  # no handle kept mapped in this process (it would pin pages a cold round evicts)
    name = "default (generated)" if data.folder == "default" else (folder.name if folder.is_dir() else store.name)
    return PreparedData(folder if folder.is_dir() else None, store, classes, images, name)




@dataclass
class StageOutcome:
    """One stage over every round: the per-round results, and the figures across rounds.

    ``result`` pools every round's measured steps (fractions, percentiles) and carries the
    median over rounds as ``images_per_s``; ``images_per_s_ci95`` is its interval
    (``rounds.median_and_interval``); ``trace_round`` is the round nearest the median (its
    timeline is the one written as a Chrome trace).
    """

    stage: RecipeStage
    rounds: list[Any] = field(default_factory=list)  # StageResult per round
    round_index: list[int] = field(default_factory=list)  # the round each entry ran in
    position: list[int] = field(default_factory=list)  # where in its round the stage ran (0 = first)
    evictions: list[dict] = field(default_factory=list)
    result: Any | None = None  # StageResult over all rounds
    images_per_s_ci95: tuple[float, float] | None = None
    trace_round: Any | None = None
    skipped: str | None = None
    ranks: list[dict] | None = None
    workers: int | None = None
    normalises: str | None = None
    autotune: list[dict] = field(default_factory=list)  # threads-autotune: where its tuner ended, per round

    @property
    def status(self) -> str:
        return "ran" if self.result is not None else "skipped"


def _stage_options(r: RecipeRun, d: RecipeData, stage: RecipeStage, device) -> Any:
    from fastload.measure.stages import StageOptions

    return StageOptions(batch_size=r.batch_size, image_size=r.image_size, workers=stage.workers,
                        prefetch_factor=stage.prefetch_factor, device=device, seed=r.seed,
                        channels_last=r.channels_last, read_delay_ms=float(d.read_delay_ms),
                        prefetch_ahead=stage.prefetch_ahead)


def resolve_device(name: str):
    """``run.device`` as a ``torch.device`` (``fastload.system.resolve_device``), errors as RecipeError."""
    from fastload.system import resolve_device as resolve

    try:
        return resolve(name, what="Field run.device")
    except ValueError as exc:
        raise RecipeError(str(exc)) from None


def run_recipe(recipe: Recipe, *, progress: bool = True, only: Iterable[str] | None = None,
               on_stage: Callable[[StageOutcome], None] | None = None,
               on_step: Callable[[str], None] | None = None) -> tuple[list[StageOutcome], PreparedData]:
    """Run every stage of ``recipe`` (or those named in ``only``) on the same data, in
    ``run.rounds`` interleaved rounds.

    Args:
        on_stage: called with each stage's outcome once its last round is done.
        on_step: called with the stage's name after every step (and once per step a
            skipped stage would have run, so a progress total stays true).

    Returns:
        The outcome of each stage, in recipe order, and the data used.
    """
    import torch

    from fastload.measure.cache import evict, files_under
    from fastload.measure.rounds import interleave, median_and_interval
    from fastload.measure.stages import StageData, autotune_state, build_stage, running, skip_reason
    from fastload.measure.timing import summarize_records
    from fastload.measure.train import RunOptions, build_model, gather_results, run_instrumented

    validate(recipe)
    stages = selected_stages(recipe, only)
    r, d = recipe.run, recipe.dataset
    device = resolve_device(r.device)
    data = _prepare_data_once(d, progress=progress)
    stage_data = StageData(data.folder, data.store)
    cold_files = files_under([data.folder, data.store]) if d.cache == "cold" else []
    outcomes = {s.name: StageOutcome(s) for s in stages}
    for s in stages:
        outcomes[s.name].skipped = skip_reason(s.type, stage_data, _stage_options(r, d, s, device))
    runnable = [s for s in stages if outcomes[s.name].skipped is None]
    for s in stages:
        if outcomes[s.name].skipped and on_step:
            for _ in range(r.rounds * (r.warmup + r.steps)):
                on_step(s.name)
    def measure(name: str, k: int):
        stage, outcome = by_name[name], outcomes[name]
        if cold_files:
            outcome.evictions.append({"round": k, **evict(cold_files).to_json()})
        torch.manual_seed(r.seed + k)
        model = build_model(r.model, num_classes=data.num_classes, step_ms=r.step_ms, host_ms=r.host_ms or 0.0)
        built = build_stage(stage.type, stage_data, _stage_options(r, d, stage, device))
        outcome.workers, outcome.normalises = built.workers, built.normalises
        opts = RunOptions(channels_last=r.channels_last, name=stage.name, batch_size=r.batch_size)
        with running(built) as loader:
            result = run_instrumented(model, loader, steps=r.steps, warmup=r.warmup, device=device,
                                      amp=None if r.amp == "none" else r.amp, options=opts,
                                      on_step=(lambda: on_step(name)) if on_step else None)
            tuned = autotune_state(loader)  # where a self-sizing loader ended this round
            if tuned is not None:
                outcome.autotune.append({"round": k, **tuned})
            return result

    by_name = {s.name: s for s in runnable}
    for name, arm in interleave([s.name for s in runnable], r.rounds, measure).items():
        outcomes[name].rounds, outcomes[name].round_index, outcomes[name].position = arm.values, arm.rounds, \
            arm.positions
    for stage in stages:
        outcome = outcomes[stage.name]
        if outcome.rounds:
            first = outcome.rounds[0]
            records = [rec for res in outcome.rounds for rec in res.records]
            pooled = summarize_records(records, name=stage.name, device=first.device, batch_size=first.batch_size,
                                       warmup=first.warmup, nvml=first.nvml)
            median, ci = median_and_interval([([x.images for x in res.records], [x.total for x in res.records])
                                              for res in outcome.rounds], seed=r.seed)
            pooled.extra.update(first.extra)
            pooled.extra.update({"workers": outcome.workers, "images_per_s_pooled": pooled.images_per_s,
                                 "rounds": len(outcome.rounds)})
            pooled.images_per_s = median
            outcome.result, outcome.images_per_s_ci95 = pooled, ci
            outcome.trace_round = min(outcome.rounds, key=lambda res: abs(res.images_per_s - median))
            outcome.ranks = gather_results(pooled)
        if on_stage:
            on_stage(outcome)
    return [outcomes[s.name] for s in stages], data


def selected_stages(recipe: Recipe, only: Iterable[str] | None) -> list[RecipeStage]:
    """The recipe's stages, or those named in ``only`` (an unknown name is an error)."""
    stages = list(recipe.stages)
    if only:
        wanted = list(only)
        known = [s.name for s in stages]
        missing = [n for n in wanted if n not in known]
        if missing:
            raise RecipeError(f"Unknown stage {missing[0]!r}. This recipe's stages are: {', '.join(known)}.")
        stages = [s for s in stages if s.name in wanted]
    return stages
