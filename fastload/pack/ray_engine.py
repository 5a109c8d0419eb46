"""The ``ray`` engine: one plain Ray task per shard (``ray.remote``, ``max_retries``), not Ray Data.

Owns: connecting to (or starting) a cluster, submitting ``shard.convert_shard`` once per
shard, feeding the driver's progress bar from the tasks (a small actor the tasks report to)
and counting retries. Ray Data would regroup rows into its own blocks and break the
deterministic placement, so each shard's file list travels whole in its task.

Must not: decide placement (``engines.py`` does) or write stores (``shard.py`` does).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fastload.errors import ConvertError, MissingDependencyError

__all__ = ["run_on_ray", "connect", "import_ray", "start_local"]


_LOCAL_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray(*, local: bool):
    """Import Ray; ``local``: for a cluster fastload starts on this machine, so "clusters" are switched
    off first (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which Ray reads when imported and every process
    it starts inherits): Ray then keeps a 127.0.0.1 node address instead of replacing it with the
    machine's routable one (docs/convert-at-scale.md, "Ray on loopback")."""
    import sys

    if local:
        os.environ[_LOCAL_ENV] = "0"
        constants = sys.modules.get("ray._private.ray_constants")
        if constants is not None:  # imported earlier in this process: the value was read already
            constants.ENABLE_RAY_CLUSTER = False
    return require_ray()


def start_local(ray) -> None:
    """Start a local cluster advertised on 127.0.0.1 only (after ``import_ray(local=True)``)."""
    # address="local": always a new cluster of its own. Without it ray.init joins the cluster named in
    # /tmp/ray/ray_current_cluster, which any `ray start` on this machine leaves behind, even after that
    # cluster is gone (it then waited on a dead GCS until the caller gave up)
    ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False,
             _node_ip_address="127.0.0.1")


def connect(engine):
    """Join ``engine.address``, or start a local loopback cluster, unless this process is connected
    already; returns ``(ray, started_here)``. Ray is not imported before the environment is set."""
    import sys

    loaded = sys.modules.get("ray")
    if loaded is not None and loaded.is_initialized():
        return loaded, False
    ray = import_ray(local=engine.address is None)
    if engine.address is None:
        start_local(ray)
    else:
        ray.init(address=engine.address, log_to_driver=False, configure_logging=False)
    return ray, True


def run_on_ray(shards, job, engine, progress: Callable[[int, int], None], shard_done: Callable, stats: dict) -> None:
    """Run ``convert_shard`` for each shard as a Ray task; returns when all are published.

    Raises:
        ConvertError: a shard failed after its retries (the message names it and why).
    """
    from fastload.pack.shard import convert_shard

    ray, started_here = connect(engine)
    try:
        # on the driver's own node, needing no CPU: an actor placed on a worker node that dies takes the
        # progress of every task with it, and the driver's wait failed with ActorUnavailableError although
        # Ray retried the node's tasks elsewhere (a killed node in tests/load/test_multinode.py)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)

        @ray.remote(num_cpus=0, scheduling_strategy=here)
        class _Progress:
            """Files and bytes done, per shard attempt: a retried shard's earlier attempt is taken back
            (a negative count), so the bar does not pass 100%; reports of a dead attempt are ignored."""

            def __init__(self) -> None:
                self.files = self.bytes = 0
                self.attempts: dict[int, int] = {}
                self.counted: dict[int, tuple[int, int]] = {}

            def attempt(self, index: int) -> int:
                files, nbytes = self.counted.pop(index, (0, 0))
                self.files -= files
                self.bytes -= nbytes
                self.attempts[index] = self.attempts.get(index, 0) + 1
                return self.attempts[index]

            def add(self, index: int, attempt: int, files: int, nbytes: int) -> None:
                if self.attempts.get(index) != attempt:
                    return
                f, b = self.counted.get(index, (0, 0))
                self.counted[index] = (f + files, b + nbytes)
                self.files += files
                self.bytes += nbytes

            def take(self) -> tuple[int, int, int]:
                files, nbytes = self.files, self.bytes
                self.files = self.bytes = 0
                return files, nbytes, sum(n - 1 for n in self.attempts.values())

        from fastload.errors import SourceReadError

        # a source read that failed (throttling, a reset, a disk error) is retried like a dead worker
        @ray.remote(num_cpus=1, max_retries=engine.max_retries, retry_exceptions=[SourceReadError])
        def _shard_task(shard, job, reporter):
            attempt = ray.get(reporter.attempt.remote(shard.index))
            return convert_shard(shard, job, lambda f, b: reporter.add.remote(shard.index, attempt, f, b))

        reporter = _Progress.remote()
        pending = {_shard_task.remote(s, job, reporter): s for s in shards}
        try:
            _wait_all(ray, pending, job, engine, progress, shard_done, stats, reporter)
        except BaseException:
            for ref in pending:  # a shard failed (or Ctrl-C): the others stop now, on a cluster that stays up too
                ray.cancel(ref, force=True)
            raise
    finally:
        if started_here:
            ray.shutdown()


def _wait_all(ray, pending: dict, job, engine, progress, shard_done, stats: dict, reporter) -> None:
    """Collect the shard tasks as they finish (progress every half second); the first failure raises."""
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        files, nbytes, retries = ray.get(reporter.take.remote())
        stats["retries"] = retries
        progress(files, nbytes)
        for ref in done:
            shard = pending.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                    raise cause from None  # our own error (ConvertError, RemoteStoreError): already worded
                raise ConvertError(f"{job.dst}: shard {shard.name} failed: {cause}\nHINT: rerun the same "
                                   "command: published shards are kept, only missing ones are redone.") from None
            except ray.exceptions.RayError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ConvertError(
                    f"{job.dst}: shard {shard.name} failed after {engine.max_retries} retries: {first}\n"
                    "HINT: rerun the same command: published shards are kept, only missing ones are redone."
                ) from None
            shard_done(result)
    files, nbytes, retries = ray.get(reporter.take.remote())
    stats["retries"] = retries
    progress(files, nbytes)


def require_ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--engine ray needs Ray.\nHINT: pip install 'fastload[ray]'") from None
    return ray
