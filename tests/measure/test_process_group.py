"""``distributed_run``: the process group torchrun describes is joined for the block and destroyed after it
on every rank, also when the block fails; a rank that exits with a gloo group alive can abort in the
interpreter's teardown (SIGABRT, "terminate called without an active exception": pytorch/pytorch#190489)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from fastload.measure.train import distributed_run

RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from fastload.measure.train import distributed_run

    fail = sys.argv[1] == "fail"
    try:
        with distributed_run() as (rank, world):
            inside = dist.is_initialized()
            everyone = [None, None]
            dist.all_gather_object(everyone, rank)
            if fail:
                raise RuntimeError("the block failed")
    except RuntimeError as exc:
        print("raised:", exc)
    print(f"rank {rank} of {world}; inside {inside}; gathered {everyone}; after {dist.is_initialized()}")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_two_ranks_join_then_leave_the_group(how):
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "CUDA_VISIBLE_DEVICES": ""}  # gloo on every machine: rank 1 would ask a one-GPU box for cuda:1
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, how], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:  # a rank stuck past the timeout is not left running
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        assert f"rank {rank} of 2; inside True; gathered [0, 1]; after False" in out, out + err[-2000:]
        assert ("raised: the block failed" in out) == (how == "fail")


def test_outside_torchrun_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with distributed_run() as (rank, world):
        assert (rank, world) == (0, 1) and not dist.is_initialized()


def test_a_group_the_caller_joined_is_left_as_it_was(monkeypatch, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("WORLD_SIZE", "1")
        with distributed_run() as (rank, world):
            assert (rank, world) == (0, 1)
        monkeypatch.setenv("WORLD_SIZE", "2")  # as if under torchrun: the caller's group is used, not joined again
        with distributed_run() as (rank, world):
            assert (rank, world) == (0, 1)  # the group's own rank and size
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():  # the assertion above reports a group destroyed by the code under test
            dist.destroy_process_group()


def test_a_failing_teardown_does_not_hide_the_blocks_error(monkeypatch, tmp_path, caplog):
    # the block failed and leaving the group failed too (a peer already gone): the block's error is raised,
    # the teardown's is logged; before, the teardown's was raised with the block's only as its __context__
    joined, init = [], dist.init_process_group

    def join(backend):  # a one-rank group as if torchrun had said two: no peer to wait for
        init(backend, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        joined.append(backend)

    destroy = dist.destroy_process_group

    def destroy_then_fail():
        destroy()
        raise RuntimeError("the peer is gone")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "init_process_group", join)
    monkeypatch.setattr(dist, "destroy_process_group", destroy_then_fail)
    try:
        with pytest.raises(ValueError, match="the block failed"):
            with distributed_run():
                raise ValueError("the block failed")
        assert joined and not dist.is_initialized()
        assert "the peer is gone" in caplog.text
        with pytest.raises(RuntimeError, match="the peer is gone"):  # after a block that succeeded: the error
            with distributed_run():
                pass
        assert len(joined) == 2 and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            destroy()
