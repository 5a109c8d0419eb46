"""``fastload.serve``: the training preprocessing reused for inference, with dynamic batching.

``DynamicBatcher`` (``batcher.py``) batches requests in a short time window; ``http.py`` is
a small HTTP front for it; ``bench.py`` load-tests that front over loopback.
"""

from fastload.serve.batcher import BatchPolicy, DynamicBatcher, RequestTiming
from fastload.serve.http import make_server, serve_forever

__all__ = ["DynamicBatcher", "BatchPolicy", "RequestTiming", "make_server", "serve_forever"]
