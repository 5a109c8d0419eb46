"""Recipes: one TOML file describes a dataset, a model and the loader stages to A/B.

Owns: reading and validating ``recipes/*.toml`` (stdlib ``tomllib``; every error names
the field and the valid choices, before any stage runs), applying CLI overrides, making
the data ready (the embedded default dataset; a store converted on first use), building
each stage's loader on the same data, and running the stages in turn.

Stages (``[[stage]] type = ...``):

* ``baseline``: torchvision ``ImageFolder`` + torchvision transforms + torch ``DataLoader``, 0 workers.
* ``workers``: the same with ``num_workers="auto"``, pinned memory, persistent workers.
* ``lmdb``: ``LMDBImageDataset`` + torchvision transforms + ``fastload.DataLoader``, auto workers.
* ``fast``: LMDB + fast decode presets + ``uint8`` collate + ``DevicePrefetcher``.
* ``dali-cpu`` / ``dali-gpu``: ``fastload.dali.DALILoader`` on the store, CPU or GPU mode.

A stage that cannot run here (no GPU, DALI missing) is reported as skipped with the
reason, never silently dropped.

Must not: print (the CLI does) or compute figures (``train.py``, ``report.py``).
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

from fastload.errors import FastloadError, RecipeError

__all__ = ["STAGE_TYPES", "Recipe", "RecipeData", "RecipeRun", "RecipeStage", "load_recipe", "StageOutcome",
           "run_recipe", "prepare_data"]

STAGE_TYPES = ("baseline", "workers", "lmdb", "fast", "dali-cpu", "dali-gpu")
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
    """``[dataset]``: ``folder`` (an ImageFolder tree, or ``"default"`` for the embedded data) and
    ``store`` (an LMDB store of it; converted from ``folder`` on first use; default: in the cache),
    ``max_side`` (convert at reduced resolution)."""

    folder: str = "default"
    store: str | None = None
    max_side: int | None = None

    FIELDS = frozenset({"folder", "store", "max_side"})


@dataclass(frozen=True, kw_only=True)
class RecipeRun:
    """``[run]``: what every stage shares."""

    model: str = "simulated"
    step_ms: float | None = None
    batch_size: int = 64
    image_size: int = 224
    steps: int = 30
    warmup: int = 5
    device: str = "auto"
    amp: str = "none"
    channels_last: bool = False
    seed: int = 0

    FIELDS = frozenset({"model", "step_ms", "batch_size", "image_size", "steps", "warmup", "device", "amp",
                        "channels_last", "seed"})

    def __post_init__(self) -> None:
        _int(self.batch_size, "run.batch_size", 1)
        _int(self.image_size, "run.image_size", 8)
        _int(self.steps, "run.steps", 1)
        _int(self.warmup, "run.warmup", 0)
        _choice(self.device, _DEVICES, "run.device")
        _choice(self.amp, _AMP, "run.amp")
        if self.model == "simulated" and (self.step_ms is None or self.step_ms < 0):
            raise RecipeError("Field run.step_ms (device milliseconds per batch, >= 0) is required when "
                              "run.model = 'simulated'.")


@dataclass(frozen=True, kw_only=True)
class RecipeStage:
    """``[[stage]]``: a loader configuration. ``workers``: ``"auto"`` or an int."""

    type: str
    name: str = ""
    workers: int | str | None = None
    prefetch_factor: int | None = None

    FIELDS = frozenset({"type", "name", "workers", "prefetch_factor"})

    def __post_init__(self) -> None:
        _choice(self.type, STAGE_TYPES, "stage.type")
        if not self.name:
            object.__setattr__(self, "name", self.type)
        if self.workers is not None and self.workers != "auto":
            _int(self.workers, f"stage {self.name!r} workers", 0)
        if self.prefetch_factor is not None:
            _int(self.prefetch_factor, f"stage {self.name!r} prefetch_factor", 1)

    def resolved_workers(self, default: int | str) -> int:
        from fastload.load.workers import auto_num_workers

        w = self.workers if self.workers is not None else default
        return auto_num_workers() if w == "auto" else int(w)


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
                              "'default' for the embedded dataset, or an existing dataset.store.")
    if d.max_side is not None:
        _int(d.max_side, "dataset.max_side", 8)
    needs_folder = {"baseline", "workers"} & {s.type for s in recipe.stages}
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


def prepare_data(data: RecipeData, *, progress: bool = True) -> PreparedData:
    """The embedded default dataset made if needed; the store converted from the folder if missing.

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
        tag = hashlib.sha256(f"{folder}|{data.max_side}".encode()).hexdigest()[:10]
        store = cache_dir() / "stores" / f"{folder.name}-{tag}.lmdb"
    if folder.is_dir():
        convert(folder, store, ConvertOptions(max_side=data.max_side, progress=progress))
    reader = StoreReader(store)
    return PreparedData(folder if folder.is_dir() else None, store, len(reader.classes))


@dataclass
class StageOutcome:
    stage: RecipeStage
    result: Any | None = None  # StageResult
    skipped: str | None = None
    ranks: list[dict] | None = None
    workers: int | None = None

    @property
    def status(self) -> str:
        return "ran" if self.result is not None else "skipped"


def _torch_loader(dataset, r: RecipeRun, workers: int, stage: RecipeStage, *, pin: bool, fastload_loader: bool,
                  collate=None):
    import torch.distributed as dist
    import torch.utils.data

    from fastload.load.loader import DataLoader

    kwargs: dict[str, Any] = dict(batch_size=r.batch_size, num_workers=workers, pin_memory=pin, drop_last=True,
                                  persistent_workers=workers > 0)
    if workers > 0 and stage.prefetch_factor:
        kwargs["prefetch_factor"] = stage.prefetch_factor
    if collate is not None:
        kwargs["collate_fn"] = collate
    if fastload_loader:
        return DataLoader(dataset, shuffle=True, **kwargs)
    sampler = None
    if dist.is_available() and dist.is_initialized():  # give torch's loader the same sharding, fairly
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=r.seed, drop_last=True)
    return torch.utils.data.DataLoader(dataset, shuffle=sampler is None, sampler=sampler, **kwargs)


def build_stage_loader(stage: RecipeStage, r: RecipeRun, data: PreparedData, device) -> tuple[Iterable, int]:
    """The loader for one stage and the worker count it uses."""
    import torch
    from torchvision.datasets import ImageFolder

    from fastload.load.dataset import LMDBImageDataset
    from fastload.load.prefetch import DevicePrefetcher
    from fastload.load.transforms import collate_uint8, train_transform
    from fastload.measure.bench_loader import torchvision_train_transform

    cuda = device.type == "cuda"
    tv = torchvision_train_transform(r.image_size)
    if stage.type in ("baseline", "workers"):
        if data.folder is None:
            raise FastloadError("this stage reads the image folder, and the recipe has only a store")
        workers = stage.resolved_workers(0 if stage.type == "baseline" else "auto")
        loader = _torch_loader(ImageFolder(str(data.folder), transform=tv), r, workers, stage,
                               pin=cuda and stage.type == "workers", fastload_loader=False)
        return loader, workers
    if stage.type == "lmdb":
        workers = stage.resolved_workers("auto")
        return _torch_loader(LMDBImageDataset(data.store, transform=tv), r, workers, stage, pin=cuda,
                             fastload_loader=True), workers
    if stage.type == "fast":
        workers = stage.resolved_workers("auto")
        loader = _torch_loader(LMDBImageDataset(data.store, transform=train_transform(r.image_size)), r, workers,
                               stage, pin=cuda, fastload_loader=True, collate=collate_uint8)
        if r.model == "simulated" and not cuda:
            return loader, workers  # uint8 batches: the simulated GPU normalises within its step (train.py)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(r.amp, torch.float32)
        return DevicePrefetcher(loader, device, dtype=dtype, channels_last=r.channels_last), workers
    from fastload.load.dali import DALILoader

    threads = stage.resolved_workers("auto") or 1
    mode = "gpu" if stage.type == "dali-gpu" else "cpu"
    return DALILoader(data.store, r.batch_size, train=True, size=r.image_size, device=mode, num_threads=threads,
                      seed=r.seed, drop_last=True), threads


def skip_reason(stage: RecipeStage, device) -> str | None:
    """Why ``stage`` cannot run here, or None."""
    import importlib.util

    if stage.type.startswith("dali"):
        if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.dali") is None:
            return "DALI is not installed (pip install 'fastload[dali]')"
        if stage.type == "dali-gpu" and device.type != "cuda":
            return "needs a CUDA GPU; this run's device is " + device.type
    return None


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("Field run.device is 'cuda' but no CUDA device is available. Use 'auto' or 'cpu'.")
    return torch.device(name)


def run_recipe(recipe: Recipe, *, progress: bool = True, only: Iterable[str] | None = None,
               on_stage: Callable[[StageOutcome], None] | None = None,
               on_step: Callable[[str], None] | None = None) -> tuple[list[StageOutcome], PreparedData]:
    """Run every stage of ``recipe`` (or those named in ``only``) on the same data.

    Returns:
        The outcome of each stage, in recipe order, and the data used.
    """
    import torch

    from fastload.measure.train import build_model, gather_results, run_instrumented

    validate(recipe)
    stages = selected_stages(recipe, only)
    r = recipe.run
    device = resolve_device(r.device)
    data = prepare_data(recipe.dataset, progress=progress)
    outcomes = []
    for stage in stages:
        outcome = StageOutcome(stage)
        reason = skip_reason(stage, device)
        if reason:
            outcome.skipped = reason
            if on_step:
                for _ in range(r.warmup + r.steps):
                    on_step(stage.name)
        else:
            torch.manual_seed(r.seed)
            model = build_model(r.model, num_classes=data.num_classes, step_ms=r.step_ms)
            loader, outcome.workers = build_stage_loader(stage, r, data, device)
            try:
                result = run_instrumented(model, loader, steps=r.steps, warmup=r.warmup, device=device,
                                          amp=None if r.amp == "none" else r.amp, channels_last=r.channels_last,
                                          name=stage.name, batch_size=r.batch_size,
                                          on_step=(lambda name=stage.name: on_step(name)) if on_step else None)
            finally:
                _shutdown(loader)
            result.extra["workers"] = outcome.workers
            outcome.result = result
            outcome.ranks = gather_results(result)
        outcomes.append(outcome)
        if on_stage:
            on_stage(outcome)
    return outcomes, data


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


def _shutdown(loader) -> None:
    """Stop persistent workers now rather than at garbage collection, so stages do not overlap."""
    inner = getattr(loader, "loader", loader)
    it = getattr(inner, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    close = getattr(inner, "close", None)
    if callable(close):
        close()
