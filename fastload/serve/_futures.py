"""Awaiting a request's ``concurrent.futures.Future`` from an event loop, with a deadline.

Owns: ``await_future``, what ``DynamicBatcher.submit_async`` and ``Router.submit_async``
return through: past the deadline the request is cancelled (it leaves the batcher's queue)
and ``DeadlineExceeded`` raised; a cancelled awaiting task cancels the request too.

Must not: hold a lock or know about batching or HTTP.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from fastload.errors import DeadlineExceeded

__all__ = ["await_future"]


async def await_future(future: concurrent.futures.Future, timeout: float | None) -> Any:
    """Await ``future`` from an event loop; past ``timeout`` cancel it (it leaves the queue): ``DeadlineExceeded``.

    ``wrap_future`` chains cancellation: a cancelled awaiting task cancels the request too.
    """
    try:
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
    except asyncio.TimeoutError as exc:
        if isinstance(exc, DeadlineExceeded):  # the batcher's own (a TimeoutError): it already left the queue
            raise
        future.cancel()
        raise DeadlineExceeded(f"no answer within the {timeout:g}s request deadline; the request was dropped") \
            from None
