"""Fixtures of the in-process bootstrap tests."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_lev import compat


@pytest.fixture()
def single_process(monkeypatch):
    """No launcher variables, no process group; records each request for the CPU backend (and whether a
    process group existed at that moment) instead of patching torch in the test process."""
    assert not dist.is_initialized() and not ps.model_parallel_is_initialized(), "a previous test leaked its groups"
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    calls = []
    monkeypatch.setattr(compat, "apply", lambda: calls.append(dist.is_initialized()))
    try:
        yield calls
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
