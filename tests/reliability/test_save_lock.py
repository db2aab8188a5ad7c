"""One training run at a time in a --save directory, and the ways a save in progress is stopped.

Two runs started together on one --save: exactly one trains, the other is refused in one line naming the
holder (host, pid, start time). The run that trains is stopped by Ctrl-C during a save that hangs (its
writers stalled by the --debug-stall-during-save hook): the first Ctrl-C says a save is in progress, the
second aborts it (exit 130, one line naming the incomplete folder and the last complete checkpoint), and
the lock is gone. The lock's own rules (a gone holder's lock taken over, a live or unknowable one refused,
a release that leaves another run's lock alone) are checked on the functions, and --save DIR --load DIR of
a directory with nothing to lose starts from scratch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.test_training_faults import tiny_args, wait_for_text
from tests.training.test_pretrain import PRETRAIN, REPO, _env

TRACKER = "latest_checkpointed_iteration.txt"


def _ns(**kw):
    import argparse

    base = dict(load=None, save=None, overwrite_checkpoints=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _dead_pid():
    """The pid of a process of this host that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _zombie():
    """A child of this process that has ended and is not collected yet: (pid, wait for it)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    while True:  # until it has ended; waitid with WNOWAIT leaves it a zombie
        if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return proc.pid, proc.wait
        time.sleep(0.01)


def test_a_holder_that_ended_but_is_not_collected_is_gone():
    """A rank SIGKILLed with its launcher is a zombie until init reaps it: the pid answers signal 0 and keeps
    its start time, but the process writes nothing more (a resume started at once found it alive)."""
    from megatron_lev.checkpoint.lock import _process_start, holder_is_gone, this_process

    pid, collect = _zombie()
    try:
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert holder_is_gone(dict(this_process(), pid=pid, pid_start=_process_start(pid)))
    finally:
        collect()
    assert not holder_is_gone(this_process())  # a live one is not


def test_a_live_holder_is_refused_in_one_line_and_a_gone_one_taken_over(tmp_path):
    from megatron_lev.checkpoint import LOCK_NAME, SaveLockError, take_save_lock
    from megatron_lev.checkpoint.lock import read_lock, this_process

    root = tmp_path / "ck"
    lock = take_save_lock(str(root))
    record = read_lock(str(root / LOCK_NAME))
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    # Held by a live process (this one): refused, naming it.
    with pytest.raises(SaveLockError) as e:
        take_save_lock(str(root))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--save {root}: another run is writing its checkpoints there (host "
                                              f"{socket.gethostname()}, pid {os.getpid()}, started {record['started']};")
    assert f"lock file {root / LOCK_NAME}" in msg
    lock.release()
    assert not (root / LOCK_NAME).exists()

    # A holder that is gone (a dead pid of this host, or a pid another process now has): taken over with a notice.
    for gone in ({"pid": _dead_pid()}, {"pid": os.getpid(), "pid_start": "1"}):
        stale = dict(this_process(), **gone)
        (root / LOCK_NAME).write_text(json.dumps(stale))
        lines = []
        lock = take_save_lock(str(root), log=lines.append)
        assert lines == [f"WARNING: --save {root}: took over the lock of a run that is gone (host {stale['host']}, "
                         f"pid {stale['pid']}, started {stale['started']})"], lines
        assert read_lock(str(root / LOCK_NAME))["token"] == lock.record["token"]
        lock.release()
    assert sorted(os.listdir(root)) == []  # nothing left aside

    # Another host's, or another pid namespace's (a container sharing the host name): not checkable, refused.
    for other in ({"host": "elsewhere", "pid": _dead_pid()}, {"pid_namespace": "pid:[1]", "pid": _dead_pid()}):
        (root / LOCK_NAME).write_text(json.dumps(dict(this_process(), **other)))
        with pytest.raises(SaveLockError, match="another run is writing its checkpoints there"):
            take_save_lock(str(root))
    # Not a record: named, with the way out.
    (root / LOCK_NAME).write_text("garbage")
    with pytest.raises(SaveLockError, match="not a lock record this release reads; remove it"):
        take_save_lock(str(root))


def test_a_release_leaves_another_runs_lock_alone(tmp_path):
    from megatron_lev.checkpoint import LOCK_NAME, take_save_lock
    from megatron_lev.checkpoint.lock import this_process

    lock = take_save_lock(str(tmp_path))
    other = dict(this_process(), pid=os.getpid())  # taken over (wrongly) by another run: its token
    (tmp_path / LOCK_NAME).write_text(json.dumps(other))
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == other["token"]


def test_evaluation_and_the_conversions_do_not_take_the_lock():
    """Readers never need it: only training's start takes it (a static look at the callers)."""
    callers = sorted(str(p.relative_to(REPO)) for p in (REPO / "megatron_lev").rglob("*.py")
                     if "take_save_lock(" in p.read_text() and p.parent.name != "checkpoint")
    assert callers == ["megatron_lev/training/loop.py"], callers


def test_save_and_load_of_a_folder_with_nothing_to_lose_starts_from_scratch(tmp_path):
    """A job that died before its first save, its TensorBoard folder inside --save (Megatron-LM's mixtral
    and gpt-oss scripts): --save C --load C starts from scratch (the load's one warning); a --load elsewhere
    holding no checkpoint, or complete iter_* folders without a tracker, are still refused."""
    from megatron_lev.checkpoint import LOCK_NAME, CheckpointError, check_save_and_load

    ck = tmp_path / "ck"
    (ck / "tensorboard").mkdir(parents=True)
    (ck / LOCK_NAME).write_text("{}")  # a run's lock is no checkpoint either
    check_save_and_load(_ns(load=str(ck), save=str(ck)))
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory \(no latest_checkpointed_iteration.txt; "
                                              r"holds 'tensorboard'\)"):
        check_save_and_load(_ns(load=str(ck), save=str(tmp_path / "other")))
    (ck / "iter_0000002").mkdir()  # an unfinished first save beside it: nothing to lose either
    check_save_and_load(_ns(load=str(ck), save=str(ck)))
    for name in ("metadata.json", "config.yaml"):
        (ck / "iter_0000002" / name).write_text("{}")
    with pytest.raises(CheckpointError, match="is a complete but damaged checkpoint"):
        check_save_and_load(_ns(load=str(ck), save=str(ck)))


def test_on_two_ranks_rank_0_takes_the_lock_and_both_stop_with_its_line_or_train(tmp_path):
    """The lock is rank 0's; its verdict is sent, so a refused run stops both ranks with one line (rank 1
    does not wait in the model's first collectives). (A two-rank run that ends well removes it:
    tests/training/test_pretrain.py, the resumed TP=2 run.)"""
    from megatron_lev.checkpoint.lock import this_process
    from megatron_lev.testing import run_torchrun

    ck = tmp_path / "ck"
    ck.mkdir()
    holder = dict(this_process(), command="pretrain_lev.py (this test)")  # a live holder: this process
    (ck / "run.lock").write_text(json.dumps(holder))
    args = tiny_args(1, ["--save", str(ck), "--load", str(ck)])
    r = run_torchrun(PRETRAIN, args, nproc=2, env=_env(), cwd=str(REPO), timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert errors[0].startswith(f"error: --save {ck}: another run is writing its checkpoints there (host "
                                f"{holder['host']}, pid {os.getpid()}, started {holder['started']}; "), errors
    assert json.loads((ck / "run.lock").read_text()) == holder  # not the refused run's to remove


_SIGTERM_AT_START = """
import os, signal, sys, time
from megatron_lev.training import loop

def start(*args, **kwargs):  # SIGTERM while the model is being built
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)

loop._start = start
sys.exit(loop.pretrain(sys.argv[1:]))
"""


def test_sigterm_during_start_up_releases_the_lock_in_one_line(tmp_path):
    """SIGTERM while the run builds its model (a stand-in sends it): one line, exit 143, and --save's lock is
    gone (SIGTERM's default action would have left it)."""
    from megatron_lev.testing import run_cli

    ck = tmp_path / "ck"
    script = tmp_path / "sigterm_at_start.py"
    script.write_text(_SIGTERM_AT_START)
    r = run_cli(script, tiny_args(4, ["--save", str(ck)]), env=_env(), cwd=str(REPO), timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 143 and errors == ["error: terminated by SIGTERM outside the training loop; no checkpoint "
                                              "was saved"] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert os.listdir(ck) == []  # the lock taken, then released


def _start(args, log):
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, PRETRAIN] + args, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                cwd=str(REPO), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
def test_two_runs_on_one_save_and_ctrl_c_twice_during_a_hung_save(tmp_path):
    ck = tmp_path / "ck"
    args = tiny_args(100000, ["--save", str(ck), "--load", str(ck), "--save-interval", "2",
                              "--debug-stall-during-save", "0:4"])
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start(args, logs[0]), _start(args, logs[1])]
    try:
        deadline = time.monotonic() + 180
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        refused = [i for i, p in enumerate(procs) if p.poll() is not None]
        assert len(refused) == 1, [Path(x).read_text()[-2000:] for x in logs]
        loser, winner = refused[0], 1 - refused[0]
        text = logs[loser].read_text()
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert procs[loser].returncode == 2 and len(errors) == 1 and "Traceback" not in text, text[-3000:]
        lock = json.loads((ck / "run.lock").read_text())
        assert lock["pid"] == procs[winner].pid
        assert errors[0] == (f"error: --save {ck}: another run is writing its checkpoints there (host "
                             f"{socket.gethostname()}, pid {procs[winner].pid}, started {lock['started']}; lock file "
                             f"{ck / 'run.lock'}); wait for it to end or choose another --save (if that run is gone, "
                             "remove the lock file)"), errors
        assert " iteration " not in text  # it never trained

        # The winner trains, saves 2, and hangs in the save of 4: the first Ctrl-C is said, the second aborts.
        proc, log = procs[winner], logs[winner]
        wait_for_text(log, "stalled", proc)
        proc.send_signal(signal.SIGINT)
        notice = (f"Ctrl-C: the checkpoint of iteration 4 is being written to {ck / 'iter_0000004'}; the run stops "
                  "once it is complete (Ctrl-C again stops at once, leaving it incomplete)")
        wait_for_text(log, notice, proc, timeout=60)
        time.sleep(1)
        assert proc.poll() is None  # the save goes on
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        text = log.read_text()
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert code == 130 and len(errors) == 1 and "Traceback" not in text, text[-3000:]
        assert errors[0] == (f"error: interrupted at iteration 4, during the save of iteration 4 (incomplete, not "
                             f"loaded: {ck / 'iter_0000004'}); the last checkpoint is iteration 2 "
                             f"({ck / 'iter_0000002'}; resume with --load {ck})"), errors
        assert (ck / TRACKER).read_text().strip() == "2"
        assert not (ck / "run.lock").exists()  # released on Ctrl-C
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
