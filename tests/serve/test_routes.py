"""What a failed request is answered with, on both fronts (``routes.Routes.failure``)."""

from __future__ import annotations

import pytest

from fastload.errors import CorruptSampleError, DeadlineExceeded, DeviceFailure, Overloaded
from fastload.serve.routes import Routes


@pytest.mark.parametrize("exc,submitting,status", [
    (RuntimeError("the batcher is not started"), True, 503),  # come back later
    (RuntimeError("torch: odd tensor"), False, 500),  # a failure of this request: retrying will not help
    (Overloaded("queue full"), True, 503),
    (DeviceFailure("CUDA error"), False, 503),
    (DeadlineExceeded("late"), False, 504),
    (CorruptSampleError("bad bytes", index=0, relpath=None), False, 400),
    (ValueError("x"), False, 500),
])
def test_failure_status(exc, submitting, status):
    reply = Routes.failure(exc, submitting=submitting)
    assert reply.status == status
    if status == 503:
        assert "Retry-After" in (reply.headers or {})
