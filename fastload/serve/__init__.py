"""``fastload.serve``: the training preprocessing reused for inference, with dynamic batching.

``DynamicBatcher`` (``batcher.py``; its policy and timings in ``policy.py``, per-request
decode and device choice in ``preprocess.py``, GPU decode in ``gpu_decode.py``) batches
requests in a short time window; ``Router`` (``replicas.py``) puts several of them (one
per device) behind one front with run-time fallback; ``routes.py`` is what every route
answers, served by ``http.py`` (with ``_conn.py``: the hardened standard-library front) or
``asgi.py`` (uvicorn + starlette, the ``serve`` extra); ``metrics.py`` is what they
report; ``app.py`` runs all of it (``run_server``, what ``fastload serve`` calls) with the
models of ``models.py``. Its benchmarks live in ``fastload/bench/`` (``serve.py`` load-tests it
over loopback, before and after; ``fronts.py`` puts the two fronts side by side).
"""

from fastload.serve.app import ServeOptions, run_server
from fastload.serve.batcher import BatchPolicy, DynamicBatcher, RequestTiming
from fastload.serve.http import FrontOptions, make_server, serve_forever
from fastload.serve.replicas import Router

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming", "Router", "FrontOptions", "make_server",
           "serve_forever", "ServeOptions", "run_server"]
