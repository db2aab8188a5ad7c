"""A stop during a checkpoint read reaches the caller as itself: torch's CheckpointException (a BaseException
that megatron-core 0.19's common-state read and every sharded read raise) wraps each rank's error, a Ctrl-C's
KeyboardInterrupt and SIGTERM's Terminated (a SystemExit carrying the exit code) included. In-process: the
read is stood in for."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lev.checkpoint import CheckpointError, files
from megatron_lev.training.faults import EXIT_TERMINATED, Terminated


def _wrapping(error: BaseException) -> CheckpointException:
    return CheckpointException("read", {0: (error, None)})


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), Terminated(EXIT_TERMINATED)])
def test_a_stop_inside_the_common_state_read_is_raised_as_itself(tmp_path, monkeypatch, stop):
    from megatron.core import dist_checkpointing

    def read(path):
        raise _wrapping(stop)

    monkeypatch.setattr(files, "unreadable_checkpoint", lambda path: None)
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", read)
    with pytest.raises(type(stop)) as e:
        files.load_common(str(tmp_path))
    assert e.value is stop  # before: a Terminated became "not a readable dist_checkpointing checkpoint (143)"


def test_another_error_inside_the_read_is_one_line_naming_the_checkpoint(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    def read(path):
        raise _wrapping(OSError(5, "Input/output error"))

    monkeypatch.setattr(files, "unreadable_checkpoint", lambda path: None)
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", read)
    with pytest.raises(CheckpointError) as e:
        files.load_common(str(tmp_path))
    assert str(e.value) == f"{tmp_path}: not a readable dist_checkpointing checkpoint ([Errno 5] Input/output error)"
