"""The rank pool behind ``run_distributed``: ranks reused across jobs, each job in its own layout and
with a clean slate, a failed job retiring the ranks it ran on."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_lev.testing import DistributedFailure, get_pool, run_distributed


def _layout_and_leftovers(leave: bool):
    import torch.distributed as dist
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.core import parallel_state as ps

    seen = {
        "pid": os.getpid(),
        "layout": (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()),
        "env": os.environ.get("LEFT_BY_A_JOB"),
        "dtype": str(torch.get_default_dtype()),
        "calculator": nmc._GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None,
        "cwd": os.getcwd(),
    }
    t = torch.ones(1)
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    seen["tp_sum"] = t.item()
    if leave:
        os.environ["LEFT_BY_A_JOB"] = "1"
        torch.set_default_dtype(torch.float64)
        nmc.init_num_microbatches_calculator(0, None, 4, 2, 1)
        os.chdir("/")
    return seen


def _fail_on_rank(rank):
    import torch.distributed as dist

    if dist.get_rank() == rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    dist.barrier()  # the other rank waits for the failed one, as a real collective would


def test_jobs_reuse_the_ranks_with_their_own_layout_and_a_clean_slate():
    first = run_distributed(_layout_and_leftovers, 2, tp=2, args=(True,), pooled=True)
    second = run_distributed(_layout_and_leftovers, 2, pp=2, args=(False,), pooled=True)
    assert [r["pid"] for r in first] == [r["pid"] for r in second], "the second job must run on the same ranks"
    assert [r["layout"] for r in first] == [(2, 1)] * 2 and [r["tp_sum"] for r in first] == [2.0, 2.0]
    assert [r["layout"] for r in second] == [(1, 2)] * 2 and [r["tp_sum"] for r in second] == [1.0, 1.0]
    for r in second:  # nothing the first job left reaches the second
        assert (r["env"], r["dtype"], r["calculator"]) == (None, "torch.float32", False), r
        assert r["cwd"] == first[0]["cwd"]


def test_a_failed_job_is_reported_and_retires_its_ranks():
    before = {r["pid"] for r in run_distributed(_layout_and_leftovers, 2, args=(False,), pooled=True)}
    with pytest.raises(DistributedFailure) as e:
        run_distributed(_fail_on_rank, 2, args=(1,), collective_timeout=30, pooled=True)
    assert "deliberate failure on rank 1" in str(e.value) and "--- rank 0 ---" not in str(e.value)
    assert not get_pool(2).alive
    after = run_distributed(_layout_and_leftovers, 2, tp=2, args=(False,), pooled=True)
    assert {r["pid"] for r in after}.isdisjoint(before) and [r["tp_sum"] for r in after] == [2.0, 2.0]


def test_fresh_jobs_get_ranks_of_their_own():
    pooled = {r["pid"] for r in run_distributed(_layout_and_leftovers, 2, args=(False,), pooled=True)}
    fresh = {r["pid"] for r in run_distributed(_layout_and_leftovers, 2, args=(False,), fresh=True)}
    assert pooled.isdisjoint(fresh) and get_pool(2).alive
