"""Local ranks without CUDA are forked from the rank server, which imported torch and megatron-core once:
each rank still starts with its launcher's environment and working directory of that moment, CUDA hidden
where asked, and the server's own environment never saw the launcher's later changes."""

from __future__ import annotations

import multiprocessing.forkserver
import os

import pytest
import torch

from megatron_lev.distributed import spawn_ranks
from megatron_lev.distributed.spawn import rank_context

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="ranks that may use CUDA are spawned, not forked")


def _what_the_rank_sees():
    import sys

    return {"parent": os.getppid(), "value": os.environ.get("SPAWN_TEST_VALUE"), "cwd": os.getcwd(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "rank": os.environ["RANK"],
            "imported": "megatron.core.models.gpt.gpt_model" in sys.modules}


def test_forked_ranks_take_the_launchers_environment_and_folder_of_the_moment(tmp_path, monkeypatch):
    rank_context(hide_cuda=True)  # the server runs from here on, with this process's environment of now
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    monkeypatch.setenv("SPAWN_TEST_VALUE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    seen = spawn_ranks(_what_the_rank_sees, 2, hide_cuda=True, quiet=True)
    assert [s["parent"] for s in seen] == [server, server]  # forked from the server, not started afresh
    assert all(s["imported"] for s in seen)  # with the server's imports
    assert [s["value"] for s in seen] == ["set after the server started"] * 2
    assert [s["cwd"] for s in seen] == [str(tmp_path)] * 2 and [s["rank"] for s in seen] == ["0", "1"]
    assert [s["cuda"] for s in seen] == ["", ""]
    with open(f"/proc/{server}/environ", "rb") as f:
        server_env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    assert b"SPAWN_TEST_VALUE" not in server_env and server_env[b"CUDA_VISIBLE_DEVICES"] == b""
