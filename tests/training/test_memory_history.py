"""--record-memory-history: the snapshot's write and the recording's lifetime (no CUDA needed: torch's
recorder and writer are stood in for)."""

import os
import pickle
from types import SimpleNamespace

import pytest
import torch

from megatron_lev.training import profiling


def _dump(path):
    with open(path, "wb") as f:
        pickle.dump({"iteration": 10}, f)


def _failing_dump(path):
    with open(path, "wb") as f:
        f.write(b"\x80\x04partial")  # the pickle's start, then the write fails (a full disk)
    raise OSError(28, "No space left on device")


def test_a_failed_snapshot_write_leaves_the_previous_snapshot_and_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "snapshot_0.pickle"
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", _dump)
    profiling.dump_memory_snapshot(str(path))
    assert pickle.loads(path.read_bytes()) == {"iteration": 10}

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", _failing_dump)
    with pytest.raises(OSError):
        profiling.dump_memory_snapshot(str(path))
    assert os.listdir(tmp_path) == ["snapshot_0.pickle"]
    assert pickle.loads(path.read_bytes()) == {"iteration": 10}


@pytest.mark.parametrize("rank, recorded", [(0, True), (1, False)])
def test_the_recording_stops_however_the_run_ends(monkeypatch, rank, recorded):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled, **kw: calls.append(enabled))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    rc = SimpleNamespace(run=SimpleNamespace(record_memory_history=True, profile_ranks=[0]))
    with pytest.raises(RuntimeError):
        with profiling.memory_history(rc):
            assert calls == ([True] if recorded else [])
            raise RuntimeError("the model's build failed")
    assert calls == ([True, None] if recorded else [])
