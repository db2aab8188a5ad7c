"""The stop conditions the loop asks at the end of each iteration, and the NaN stop's save, in-process
(the runs of test_pretrain.py and tests/reliability/ cover the rest end to end). The cross-rank reduction
is stood in for by the flag itself: one rank."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from megatron_lev.training import faults


def _rc(*, exit_interval=None, exit_duration_in_mins=None, exit_signal_handler=False, nan_action="save-and-stop",
        save=None):
    return SimpleNamespace(
        run=SimpleNamespace(exit_interval=exit_interval, exit_duration_in_mins=exit_duration_in_mins,
                            exit_signal_handler=exit_signal_handler, nan_action=nan_action),
        checkpointing=SimpleNamespace(save=save))


@pytest.fixture
def one_rank(monkeypatch):
    monkeypatch.setattr(faults, "any_rank", lambda flag: flag)
    monkeypatch.setattr(faults, "rank_is0", lambda: True)


def _due(rc, iteration, running_s):
    """(stop, lines) of ``Stops.due`` at ``iteration``, ``running_s`` seconds after the run's start."""
    lines = []
    stops = faults.Stops(rc, SimpleNamespace(saving=None), time.time() - running_s, lines.append)
    try:
        return stops.due(iteration), lines
    finally:
        stops.release()


def test_exit_duration_and_exit_interval(one_rank):
    rc = _rc(exit_duration_in_mins=2.0)
    assert _due(rc, 7, running_s=100) == (False, [])
    assert _due(rc, 7, running_s=130) == (True, ["exiting after 2.0 minutes (--exit-duration-in-mins)"])
    rc = _rc(exit_interval=4)
    assert _due(rc, 7, running_s=0) == (False, [])
    assert _due(rc, 8, running_s=0) == (True, ["exiting at iteration 8 (--exit-interval)"])


def test_exit_signal_handler_stops_at_the_iteration_that_sees_sigterm(one_rank):
    previous = signal.getsignal(signal.SIGTERM)
    lines = []
    stops = faults.Stops(_rc(exit_signal_handler=True), SimpleNamespace(saving=None), 0.0, lines.append)
    try:
        assert stops.sigterm is None and not stops.due(3)
        signal.raise_signal(signal.SIGTERM)  # remembered, not raised: the loop saves first
        assert stops.due(4) and lines == ["exiting on SIGTERM at iteration 4"]
        stops.raise_held()  # nothing held without StopOnSigterm
    finally:
        stops.release()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_a_lost_ranks_ignored_sigterm_outlives_the_lock_holders_handler(one_rank):
    """The rank holding --save's lock installs SigtermRaises, then the loop's Stops; a run stopped on a lost
    rank leaves SIGTERM ignored (torchrun's SIGTERM to the survivors must not turn exit code 5 into a death
    by SIGTERM), and the lock holder's release afterwards must not put the default action back."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        raises = faults.SigtermRaises()
        stops = faults.Stops(_rc(), SimpleNamespace(saving=None), 0.0, lambda line: None)
        assert stops.sigterm is not None
        stops.lost = True  # what _rank_lost records
        stops.release()
        raises.release()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        # Without a lost rank the lock holder's release restores the default action.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raises = faults.SigtermRaises()
        stops = faults.Stops(_rc(), SimpleNamespace(saving=None), 0.0, lambda line: None)
        stops.release()
        raises.release()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("action, save, last_saved, saved", [
    ("save-and-stop", "/ck", 2, [3]),  # the state after the last good iteration
    ("save-and-stop", "/ck", 3, []),   # already saved
    ("save-and-stop", None, 2, []),    # no --save
    ("stop", "/ck", 2, []),
])
def test_nan_stop_saves_only_with_save_and_stop(one_rank, capsys, action, save, last_saved, saved):
    logged, written = [], []
    error = faults.NanDetected("NaN/Inf in the loss at iteration 4 (--check-for-nan-in-loss-and-grad)")
    code = faults.stop_on_nan(_rc(nan_action=action, save=save), SimpleNamespace(iteration=3, last_saved=last_saved),
                              error, logged.append, written.append)
    assert code == faults.EXIT_NAN == 3 and written == saved
    assert logged == [f"ERROR: {error}; stopping"]
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()] == [f"error: {error}"]


def test_manual_gc_leaves_the_collector_as_it_found_it(monkeypatch):
    """A process may run several trainings: --manual-gc turns Python's collector back on at the end, however
    the loop ended (Ctrl-C in its first full collection included), and leaves a collector that was off, off."""
    import gc

    from megatron_lev.training import profiling

    rc = SimpleNamespace(run=SimpleNamespace(manual_gc=True, manual_gc_interval=0))
    assert gc.isenabled()
    with profiling.manual_gc(rc):
        assert not gc.isenabled()
    assert gc.isenabled()

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(profiling.gc, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with profiling.manual_gc(rc):
            pass
    assert gc.isenabled()
    monkeypatch.undo()
    gc.disable()
    try:
        with profiling.manual_gc(rc):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_rank_that_died_is_named_and_exit_5_whether_sigterm_or_the_broken_connection_comes_first(one_rank,
                                                                                                  capsys, monkeypatch):
    # torchrun's agent SIGTERMs the survivors of a rank killed with SIGKILL: that SIGTERM, when it came before
    # the broken connection, and during the teardown after it, made the survivor exit 143 (-15 in torchrun's
    # summary) instead of 5 naming the lost rank.
    import subprocess

    previous = signal.getsignal(signal.SIGTERM)
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    gone, alive, zombie = procs
    table = {r: (p.pid, faults._process_start(p.pid)) for r, p in zip((1, 2, 3), procs)}
    try:
        gone.kill()
        gone.wait()  # reaped by its launcher
        zombie.kill()  # not reaped yet
        deadline = time.monotonic() + 10
        while faults._process_start(zombie.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        rc = SimpleNamespace(run=_rc().run, checkpointing=SimpleNamespace(save=None, load=None))

        def stopped(peers, error=None):
            monkeypatch.setattr(faults.Peers, "gather", classmethod(lambda cls: cls(peers)))
            state = SimpleNamespace(iteration=6, saving=None)
            stops = faults.Stops(rc, state, 0.0, lambda line: None)
            try:
                if error is None:
                    with pytest.raises(faults.Terminated) as e:
                        signal.raise_signal(signal.SIGTERM)
                    error = e.value
                return faults.stop_code(error, rc, state, stops), capsys.readouterr().err.strip().splitlines()
            finally:
                stops.release()

        # SIGTERM first: the ranks of this host already gone are the lost ones.
        code, err = stopped(table)
        assert code == faults.EXIT_RANK_LOST == 5 and err == [
            "error: lost ranks 1, 3 (its process ended; the launcher's SIGTERM followed) at iteration 6; no checkpoint "
            "was saved"], err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # the agent's SIGTERM during the teardown
        signal.raise_signal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, previous)
        # The broken connection first: named too.
        code, err = stopped({1: table[1], 2: table[2]}, RuntimeError("[gloo] Read error: Connection reset by peer"))
        assert code == 5 and err == ["error: lost rank 1 (connection reset by peer) at iteration 6; no checkpoint "
                                     "was saved"], err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.signal(signal.SIGTERM, previous)
        # Every rank of this host alive: SIGTERM sent to the job (Slurm, a user), the stop it was.
        code, err = stopped({2: table[2]})
        assert code == faults.EXIT_TERMINATED and err[0].startswith("error: terminated by SIGTERM at iteration 6;"), err
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs:
            p.kill()
            p.wait()
