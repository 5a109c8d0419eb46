"""fastload: keep GPUs busy during PyTorch image training.

The public surface is ``__all__``. Names are imported on first use (PEP 562), so
``import fastload`` is cheap, works without the optional extras (DALI, matplotlib, NVML)
and does not import torch until a torch-facing name is touched; conversion worker
processes rely on that.

Must not: import a room at import time; export a name that is not in ``__all__`` (a test
holds ``__all__`` against the modules, another the API reference against ``__all__``).
"""

import importlib as _importlib
from typing import Any as _Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # errors
    "FastloadError": "fastload.errors",
    "StoreError": "fastload.errors",
    "NotAStoreError": "fastload.errors",
    "IncompleteStoreError": "fastload.errors",
    "StoreVersionError": "fastload.errors",
    "ChecksumError": "fastload.errors",
    "StoreDamagedError": "fastload.errors",
    "StoreChangedError": "fastload.errors",
    "StoreLockedError": "fastload.errors",
    "ShardCacheError": "fastload.errors",
    "ShardIntegrityError": "fastload.errors",
    "CacheFullError": "fastload.errors",
    "ConvertError": "fastload.errors",
    "SourceError": "fastload.errors",
    "CorruptSampleError": "fastload.errors",
    "TooManyCorruptSamplesError": "fastload.errors",
    "RecipeError": "fastload.errors",
    "ProfileError": "fastload.errors",
    "MissingDependencyError": "fastload.errors",
    "WorkerStartError": "fastload.errors",
    "SharedMemoryError": "fastload.errors",
    "ResumeStateError": "fastload.errors",
    "Overloaded": "fastload.errors",
    "ServeError": "fastload.errors",
    "DeadlineExceeded": "fastload.errors",
    "DeviceFailure": "fastload.errors",
    "ManifestError": "fastload.errors",
    "RemoteStoreError": "fastload.errors",
    # pack
    "convert": "fastload.pack.convert",
    "ConvertOptions": "fastload.pack.convert",
    "ConvertReport": "fastload.pack.convert",
    "convert_sharded": "fastload.pack.engines",
    "EngineOptions": "fastload.pack.engines",
    # load
    "LMDBImageDataset": "fastload.load.dataset",
    "DataLoader": "fastload.load.loader",
    "AutotuneOptions": "fastload.load.autotune",
    "ShardSampler": "fastload.load.shards",
    "DevicePrefetcher": "fastload.load.prefetch",
    "prepare_batch": "fastload.load.prefetch",
    "auto_num_workers": "fastload.load.workers",
    "worker_plan": "fastload.load.workers",
    "shm_plan": "fastload.load.workers",
    "inspect_store": "fastload.store.check",
    "verify_store": "fastload.store.check",
    "train_transform": "fastload.load.transforms",
    "eval_transform": "fastload.load.transforms",
    "collate_uint8": "fastload.load.transforms",
    "normalize": "fastload.load.transforms",
    "IMAGENET_MEAN": "fastload.load.transforms",
    "IMAGENET_STD": "fastload.load.transforms",
    # measure
    "run_instrumented": "fastload.measure.train",
    "SimulatedStep": "fastload.measure.train",
    "RunOptions": "fastload.measure.train",
    "StepTimer": "fastload.measure.timing",
    "StageResult": "fastload.measure.timing",
    "load_recipe": "fastload.measure.recipe",
    "run_recipe": "fastload.measure.recipe",
    # serve
    "DynamicBatcher": "fastload.serve.batcher",
    "Router": "fastload.serve.replicas",
    "ServeOptions": "fastload.serve.app",
    "run_server": "fastload.serve.app",
    "watch": "fastload.profiling.profile",
    "profile": "fastload.profiling.profile",
    # data
    "make_dataset": "fastload.datasets",
    "ensure_default_dataset": "fastload.datasets",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({n for n in globals() if n.startswith("_")} | set(__all__))
