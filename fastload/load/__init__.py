"""``fastload.load``: from a store to batches on the device: the dataset, the presets, the drop-in
``DataLoader`` (processes or threads) with exact resume, the shard sampler, the device prefetcher and
the DALI pipelines (imported only when used). Its modules: docs/layout.md.

Must not: import anything at package import time (``import fastload`` stays light), or
import ``measure/``, ``serve/`` or any room above it.
"""
