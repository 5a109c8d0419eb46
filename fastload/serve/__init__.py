"""``fastload.serve``: the training preprocessing reused for inference, with dynamic batching.

``DynamicBatcher`` (``batcher.py``; its policy and timings in ``policy.py``, per-request
decode and device choice in ``preprocess.py``, GPU decode in ``gpu_decode.py``) batches
requests in a short time window; ``Router`` (``replicas.py``) puts several of them (one
per device) behind one front with run-time fallback; ``http.py`` (with ``_conn.py``) is
the hardened HTTP front and ``metrics.py`` what it reports; ``app.py`` runs all of it
(``run_server``, what ``fastload serve`` calls) with the models of ``models.py``;
``bench.py`` load-tests it over loopback, before and after.
"""

from fastload.serve.app import ServeOptions, run_server
from fastload.serve.batcher import BatchPolicy, DynamicBatcher, RequestTiming
from fastload.serve.http import FrontOptions, make_server, serve_forever
from fastload.serve.replicas import Router

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming", "Router", "FrontOptions", "make_server",
           "serve_forever", "ServeOptions", "run_server"]
