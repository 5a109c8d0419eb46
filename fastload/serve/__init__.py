"""``fastload.serve``: the training preprocessing reused for inference, with dynamic batching.

``DynamicBatcher`` batches requests in a short time window; ``Router`` puts one per device behind
one front with run-time fallback; two HTTP fronts (standard library, uvicorn) answer the same
routes. Its modules: docs/layout.md; its benchmarks live in ``fastload/bench/``.

Must not: import ``measure/``, ``profiling/`` or ``bench/`` (they stand beside it or above).
"""
from fastload.serve.app import ServeOptions, run_server
from fastload.serve.batcher import BatchPolicy, DynamicBatcher, RequestTiming
from fastload.serve.http import FrontOptions, make_server, serve_forever
from fastload.serve.replicas import Router

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming", "Router", "FrontOptions", "make_server",
           "serve_forever", "ServeOptions", "run_server"]
