"""Local ranks without CUDA are forked from the rank server, which imported torch and megatron-core once:
each rank still starts with its launcher's environment and working directory of that moment, has CUDA
hidden where asked, gives up the server's pipe to the launcher and dies with the server, which ends with
the launcher even while ranks run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from megatron_lev.distributed import spawn_ranks

REPO = Path(__file__).resolve().parents[2]
# What this module's import saw: in a forked rank, the environment its launcher state gave it.
_CUDA_AT_IMPORT = os.environ.get("CUDA_VISIBLE_DEVICES")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() > 0, reason="ranks that may use CUDA are spawned")


def _what_the_rank_sees():
    import ctypes
    import multiprocessing.forkserver
    import sys

    signal_number = ctypes.c_int()
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(signal_number), 0, 0, 0)  # PR_GET_PDEATHSIG
    return {"parent": os.getppid(), "value": os.environ.get("SPAWN_TEST_VALUE"), "cwd": os.getcwd(),
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "rank": os.environ["RANK"],
            "cuda_at_import": _CUDA_AT_IMPORT,
            "server_only": "PYTORCH_NVML_BASED_CUDA_CHECK" in os.environ,
            "imported": "megatron.core.models.gpt.gpt_model" in sys.modules,
            "cuda_initialised": torch.cuda.is_initialized(), "death_signal": signal_number.value,
            "server_pipe": multiprocessing.forkserver._forkserver._forkserver_alive_fd}


def test_forked_ranks_take_the_launchers_environment_and_folder_of_the_moment(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    spawn_ranks(os.getpid, 1, hide_cuda=True, quiet=True)  # the server runs from here on
    monkeypatch.setenv("SPAWN_TEST_VALUE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    seen = spawn_ranks(_what_the_rank_sees, 2, hide_cuda=True, quiet=True)
    server = seen[0]["parent"]
    assert server != os.getpid() and [s["parent"] for s in seen] == [server, server]  # forked from the server
    assert all(s["imported"] and not s["cuda_initialised"] for s in seen)  # with its imports, no CUDA
    assert [s["value"] for s in seen] == ["set after the server started"] * 2
    assert [s["cwd"] for s in seen] == [str(tmp_path)] * 2 and [s["rank"] for s in seen] == ["0", "1"]
    assert [s["cuda"] for s in seen] == ["", ""] and not any(s["server_only"] for s in seen)
    assert [s["cuda_at_import"] for s in seen] == ["", ""]  # hidden before the function's module was imported
    assert [(s["death_signal"], s["server_pipe"]) for s in seen] == [(signal.SIGKILL, None)] * 2


def mark_and_sleep(path):
    Path(path).write_text(str(os.getpid()))
    time.sleep(120)


def test_a_killed_launcher_takes_its_server_and_running_ranks_with_it(tmp_path):
    mark = tmp_path / "rank.pid"
    launcher = ("from megatron_lev.distributed import spawn_ranks\n"
                "from tests.distributed.test_spawn import mark_and_sleep\n"
                "if __name__ == '__main__':\n"
                f"    spawn_ranks(mark_and_sleep, 1, args=({str(mark)!r},), hide_cuda=True, quiet=True)\n")
    (tmp_path / "launcher.py").write_text(launcher)
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py")], cwd=str(REPO),
                            env=dict(os.environ, PYTHONPATH=str(REPO), SPAWN_TEST_TAG=tag))
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert mark.exists(), f"the rank never started (launcher exit {proc.poll()})"
        rank = int(mark.read_text())
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tagged(tag) == [], f"outlived their launcher by 10 s: {_tagged(tag)} (the rank is {rank})"
    finally:
        for pid in _tagged(tag):
            os.kill(pid, signal.SIGKILL)


def _tagged(tag):
    """Live processes whose environment at start carried SPAWN_TEST_TAG=tag (the server, its ranks)."""
    found = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if f"SPAWN_TEST_TAG={tag}".encode() in env and state != b"Z":
            found.append(int(d))
    return found
