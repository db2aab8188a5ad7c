"""The process bootstrap in this process (single rank, no launcher): what it creates, reuses and
destroys, when it installs the CPU backend, and its one-line errors. Multi-rank start-up runs through
the same function in every ``run_distributed`` test."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_lev.distributed import DistributedConfigError, destroy_distributed, init_distributed, spawn_ranks
from megatron_lev.distributed.bootstrap import _live_groups

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_lev"


def _one_line_error(match: str, **kw) -> str:
    with pytest.raises(DistributedConfigError, match=match) as e:
        init_distributed(**kw)
    msg = str(e.value)
    assert "\n" not in msg
    assert not dist.is_initialized(), "a failed start-up must not leave a process group behind"
    return msg


def test_start_reuse_and_teardown_of_a_single_process(single_process):
    setup = init_distributed(tp=1, pp=1)
    # The CPU backend is requested before the process group exists, and only without CUDA.
    assert single_process == ([] if torch.cuda.is_available() else [False])
    assert (setup.rank, setup.world_size) == (0, 1)
    assert setup.created_process_group and setup.created_parallel_state
    assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 1
    assert "MASTER_PORT" not in os.environ  # in-memory store: no port picked

    groups = _live_groups()
    again = init_distributed(tp=1, pp=1)  # reuses everything, creates nothing
    assert not again.created_process_group and not again.created_parallel_state
    assert _live_groups() == groups
    destroy_distributed(again)
    assert dist.is_initialized() and ps.model_parallel_is_initialized() and _live_groups() == groups

    # Another layout on top of the running one is refused, and the running one survives.
    with pytest.raises(DistributedConfigError, match="does not divide the world size 1"):
        init_distributed(tp=2)
    assert dist.is_initialized() and ps.model_parallel_is_initialized()

    assert {n: os.environ.get(n) for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE")} == \
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    destroy_distributed(setup)
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized()
    # The launcher variables it set go with it (accelerate would take the process for a distributed rank).
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"} & set(os.environ)
    destroy_distributed(setup)  # a second teardown does nothing


def test_launcher_variables_it_did_not_set_are_kept(single_process):
    os.environ.update(RANK="0", WORLD_SIZE="1")
    setup = init_distributed(tp=1, pp=1)
    assert setup.env_set == ("LOCAL_RANK",)
    destroy_distributed(setup)
    assert (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_RANK")) == ("0", "1", None)


def test_a_process_group_it_did_not_create_is_kept(single_process):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    before = _live_groups()
    setup = init_distributed(tp=1, pp=1)
    assert not setup.created_process_group and setup.created_parallel_state
    assert len(_live_groups()) > len(before)  # megatron's groups
    destroy_distributed(setup)
    # megatron's groups are destroyed (not just forgotten); the job's own group stays.
    assert dist.is_initialized() and not ps.model_parallel_is_initialized()
    assert _live_groups() == before


def test_bad_backend_layout_and_launch_are_one_line_errors(single_process):
    msg = _one_line_error("not supported", backend="mpi")
    assert "'mpi'" in msg and "nccl, gloo" in msg
    if not torch.cuda.is_available():
        assert "use gloo" in _one_line_error("needs CUDA", backend="nccl")
    # The process group created for a layout that cannot be built is destroyed again.
    assert "start a multiple of 3" in _one_line_error("does not divide the world size 1", tp=3)
    _one_line_error("must be >= 1", pp=0)
    os.environ["WORLD_SIZE"] = "2"
    assert "torchrun" in _one_line_error("MASTER_PORT is not set")
    assert "RANK" not in os.environ and "LOCAL_RANK" not in os.environ  # a failed start-up sets nothing
    # The launcher checks the layout before starting any rank.
    with pytest.raises(DistributedConfigError, match="does not divide the world size 3"):
        spawn_ranks(print, 3, tp=2)


def test_the_cpu_backend_is_applied_only_by_the_bootstrap():
    """Inside the package only distributed/bootstrap.py switches the CPU backend on."""
    applying = re.compile(r"\bcompat\.apply\(|from megatron_lev\.compat import|from megatron_lev import compat")
    found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if p.parts[-2] != "compat" and applying.search(p.read_text(encoding="utf-8")))
    assert found == ["distributed/bootstrap.py"]
