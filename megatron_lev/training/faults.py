"""What stops a training run, and the one line each stop prints.

The loop (``loop._train_loop``) holds the happy path; everything that ends a run early lives here, in
three pieces the loop calls in a few lines:

- the **NaN/Inf check** (``--check-for-nan-in-loss-and-grad``, ``--nan-action``,
  ``--inject-nan-at-iteration``): :func:`nonfinite_before_step` is asked once per step between the
  backward and the optimizer step, :func:`nan_step` turns its answer into a skipped step or
  :class:`NanDetected`, which the loop's caller turns into one line and exit code :data:`EXIT_NAN`;
- :class:`Stops`, built once at start-up and released at the end: the SIGTERM handlers
  (``--exit-signal-handler``: stop after saving, at the end of an iteration; without it:
  :class:`StopOnSigterm`) and the exit conditions (``--exit-duration-in-mins``, ``--exit-interval``),
  asked once per iteration (:meth:`Stops.due`, :meth:`Stops.raise_held`);
- :func:`stop_code`: the exit code and one-line report of a run that Ctrl-C, SIGTERM or a lost rank
  stopped mid-training (:func:`ctrl_c_held` keeps Ctrl-C out of a checkpoint being written); a lost
  rank of this host is named (:class:`Peers`), also when the launcher's SIGTERM to the survivors comes
  before the broken connection.

Skipping a step and stopping at the end of an iteration are decided alike on every rank: the loss is
checked after its reduction over the ranks, the gradient flag, the --exit-signal-handler flag and the
elapsed time are reduced over the world group (:func:`any_rank`, a host sync only on the steps where
they are asked). Only SIGTERM without --exit-signal-handler stops each rank where it stands (the
launchers signal every rank).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

from megatron_lev import checkpoint
from megatron_lev._procutil import EXIT_INTERRUPTED
from megatron_lev.compat.optimizer import grads_checked_in_step
from megatron_lev.distributed import report_error
from megatron_lev.parallel.collectives import all_reduce_

if TYPE_CHECKING:
    from megatron_lev.config import RunConfig

EXIT_CONFIG_ERROR = 2
EXIT_NAN = 3
EXIT_SAVE_FAILED = 4
EXIT_RANK_LOST = 5
EXIT_TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a process that SIGTERM ended


def rank_is0() -> bool:
    return torch.distributed.get_rank() == 0


def any_rank(flag: bool) -> bool:
    """True if ``flag`` is set on any rank (the collective runs on the world group's device)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return bool(all_reduce_(t, op=torch.distributed.ReduceOp.MAX).item())


# ------------------------------------------------------------------------------------------------
# NaN/Inf


class NanDetected(RuntimeError):
    """A NaN/Inf loss or gradient under --nan-action stop or save-and-stop (the message names the iteration)."""


def inject_nan(rc: "RunConfig", iteration: int) -> bool:
    """Whether step ``iteration``'s loss is made NaN (the test hook --inject-nan-at-iteration)."""
    return rc.run.inject_nan_at_iteration is not None and iteration == rc.run.inject_nan_at_iteration


def grads_finite(model) -> bool:
    """True when this rank's gradients are all finite (for an optimizer whose step computes no grad norm
    to check, ``compat.optimizer.check_grads_in_step``).

    As megatron DDP's own NaN check: the norm of each gradient buffer (NaN/Inf anywhere makes it
    non-finite), so no buffer-sized boolean tensor is allocated; the norms are summed on the device and
    read once (one host sync per step: the skip-or-stop decision needs the answer on the host)."""
    norms = []
    for chunk in model:
        # megatron DDP's grad buffers (a plain module's ``buffers`` is its method, not a list)
        buffers = [b for name in ("buffers", "expert_parallel_buffers")
                   if isinstance(getattr(chunk, name, None), list) for b in getattr(chunk, name)]
        if buffers:
            norms += [b.grad_data.norm(p=2) for b in buffers]
        else:
            for p in chunk.parameters():
                g = getattr(p, "main_grad", None)
                g = p.grad if g is None else g
                if g is not None:
                    norms.append(g.norm(p=2))
    if not norms:
        return True
    return bool(torch.isfinite(torch.stack([n.float() for n in norms]).sum()))


def params_finite(model) -> bool:
    """True when every rank's parameters are finite (checked before a checkpoint is written)."""
    bad = any(not bool(torch.isfinite(p).all()) for chunk in model for p in chunk.parameters())
    return not any_rank(bad)


def nonfinite_before_step(rc: "RunConfig", loss: Optional[float], model, optimizer) -> Optional[str]:
    """--check-for-nan-in-loss-and-grad between the backward and the optimizer step: "loss" or "gradients"
    when that holds NaN/Inf (None: go on with the step).

    The gradients are checked here only where the step itself does not (an optimizer step that computes
    the grad norm raises ``NonFiniteGrads`` before its update, ``compat.optimizer.check_grads_in_step``),
    and not in fp16, whose loss scaler skips such steps itself. A collective on every rank alike."""
    if not rc.distributed.check_for_nan_in_loss_and_grad:
        return None
    if loss is None or not math.isfinite(loss):
        return "loss"
    if not rc.model.fp16 and not grads_checked_in_step(optimizer) and any_rank(not grads_finite(model)):
        return "gradients"
    return None


def nan_step(rc: "RunConfig", iteration: int, what: str, loss):
    """Step ``iteration + 1``, whose loss or gradients hold NaN/Inf, not applied: NanDetected, or with
    --nan-action skip the step's (loss, grad norm, applied, NaN) as the loop's step returns them."""
    if rc.run.nan_action != "skip":
        raise NanDetected(f"NaN/Inf in the {what} at iteration {iteration + 1} "
                          "(--check-for-nan-in-loss-and-grad)")
    return loss, None, False, True


def stop_on_nan(rc: "RunConfig", state, error: NanDetected, log: Callable[[str], None],
                save: Callable[[int], object]) -> int:
    """A run that :class:`NanDetected` stopped: its line (log and stderr), with --nan-action save-and-stop
    ``save(iteration)`` of the state after the last good iteration (the failed step was not applied) unless
    that is saved already; EXIT_NAN."""
    log(f"ERROR: {error}; stopping")
    report_error(str(error), show=rank_is0())
    if rc.run.nan_action == "save-and-stop" and rc.checkpointing.save and state.last_saved != state.iteration:
        save(state.iteration)
    return EXIT_NAN


# ------------------------------------------------------------------------------------------------
# signals and exit conditions


class SignalHandler:
    """Remembers a SIGTERM; the loop checks it (across ranks) at the end of each iteration."""

    def __init__(self, sig=signal.SIGTERM) -> None:
        self.sig = sig
        self.received = False
        self._prev = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def any_rank_received(self) -> bool:
        return any_rank(self.received)  # on the world group's device (NCCL reduces no CPU tensor)

    def release(self) -> None:
        signal.signal(self.sig, self._prev)


class Terminated(SystemExit):
    """SIGTERM arrived without --exit-signal-handler (a SystemExit: code 143 should it ever go uncaught)."""


class StopOnSigterm:
    """SIGTERM without --exit-signal-handler stops the run where it stands, in one line.

    Megatron-LM dies silently there; torchrun sends SIGTERM to the surviving ranks when one dies, Slurm to
    all at the end of a job. Between saves the handler raises :class:`Terminated` in the main thread. During
    a save it is held: a save that completes is kept and the run stops right after it; a save that is
    still running ``grace_s`` later is cut short (both launchers kill 30 s after their SIGTERM), leaving
    that checkpoint incomplete while the tracker, written last, still names the previous one. Holding also
    keeps the raise out of the fork hooks of dist_checkpointing's writers, which would drop it.

    ``state`` is the loop's state: its ``saving`` names the iteration being saved (None between saves).
    ``peers``: the other ranks' processes on this host; the ranks among them already gone when SIGTERM
    arrives are kept in :attr:`lost` (the launcher's SIGTERM after a rank died is a lost rank, not a stop)."""

    def __init__(self, state, grace_s: float = 15.0, peers: Optional["Peers"] = None) -> None:
        self.state = state
        self.grace_s = grace_s
        self.peers = peers
        self.lost: List[int] = []
        """Ranks of this host whose process had ended when the first SIGTERM arrived."""
        self.received = False
        self.deadline: Optional[float] = None
        self._timer: Optional[threading.Timer] = None
        self.stopping = False
        """The run is already stopping on another failure, whose line a SIGTERM must not cut off."""
        self._prev = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.received and self.peers is not None:
            self.lost = self.peers.ended()  # now: the launcher signals the other survivors too, which then end
        self.received = True
        if self.stopping:
            return
        if self.state.saving is None or (self.deadline is not None and time.monotonic() >= self.deadline):
            self._stop()
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_s
            # Sent again at the deadline, to the main thread: a real signal interrupts a blocking wait there.
            self._timer = threading.Timer(self.grace_s, signal.pthread_kill,
                                          args=(threading.main_thread().ident, signal.SIGTERM))
            self._timer.daemon = True
            self._timer.start()

    def _stop(self) -> None:
        self.stopping = True  # later signals (the deadline's, a second SIGTERM) leave the stop alone
        if self._timer is not None:
            self._timer.cancel()
        raise Terminated(EXIT_TERMINATED)

    def check(self) -> None:
        """Raise a SIGTERM that was held, or raised and dropped by a library, once the save is over."""
        if self.received:
            self._stop()

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        signal.signal(signal.SIGTERM, self._prev)


class SigtermRaises:
    """SIGTERM raises :class:`Terminated` in the main thread until :meth:`release`, where it would otherwise
    end the process at once (its default action): installed by the rank that holds ``--save``'s lock, so
    that a SIGTERM outside the training loop (start-up, model building, the load) still releases it. In the
    loop :class:`Stops` takes SIGTERM over and gives it back."""

    def __init__(self) -> None:
        self._prev = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._prev = signal.signal(signal.SIGTERM, self._handle)

    @staticmethod
    def _handle(signum, frame) -> None:
        raise Terminated(EXIT_TERMINATED)

    def release(self) -> None:
        if self._prev is not None:
            # Only our own handler is undone: one put in since (a lost rank's SIG_IGN, Stops.release) stays, or
            # torchrun's SIGTERM during the teardown would turn that rank's exit code 5 into a death by SIGTERM.
            if signal.getsignal(signal.SIGTERM) is self._handle:
                signal.signal(signal.SIGTERM, self._prev)
            self._prev = None


class Stops:
    """The run's stop conditions between iterations, installed at start-up until :meth:`release`.

    SIGTERM: with --exit-signal-handler a :class:`SignalHandler` (the loop saves and stops at the end of
    the iteration that sees it on any rank), else a :class:`StopOnSigterm` (main thread only: Python
    installs signal handlers there alone). --exit-duration-in-mins and --exit-interval are asked with the
    SIGTERM flag in :meth:`due`, which every rank calls at the same point of each iteration."""

    def __init__(self, rc: "RunConfig", state, t_start: float, log: Callable[[str], None]) -> None:
        self.rc, self.t_start, self.log = rc, t_start, log
        self.peers = Peers.gather()
        self.lost = False
        """The run stopped on a lost rank: SIGTERM stays ignored after :meth:`release`."""
        self.handler = SignalHandler() if rc.run.exit_signal_handler else None
        self.sigterm: Optional[StopOnSigterm] = None
        if not rc.run.exit_signal_handler and threading.current_thread() is threading.main_thread():
            self.sigterm = StopOnSigterm(state, peers=self.peers)

    def due(self, iteration: int) -> bool:
        """Collective. SIGTERM on any rank, --exit-duration-in-mins passed on any rank, or an --exit-interval
        iteration (each logged)."""
        rc, log = self.rc, self.log
        stop = False
        if self.handler is not None and self.handler.any_rank_received():
            log(f"exiting on SIGTERM at iteration {iteration}")
            stop = True
        if rc.run.exit_duration_in_mins is not None:
            if any_rank((time.time() - self.t_start) / 60.0 > rc.run.exit_duration_in_mins):
                log(f"exiting after {rc.run.exit_duration_in_mins} minutes (--exit-duration-in-mins)")
                stop = True
        if rc.run.exit_interval and iteration % rc.run.exit_interval == 0:
            log(f"exiting at iteration {iteration} (--exit-interval)")
            stop = True
        return stop

    def raise_held(self) -> None:
        """Without --exit-signal-handler: stop on a SIGTERM that a save held (:meth:`StopOnSigterm.check`)."""
        if self.sigterm is not None:
            self.sigterm.check()

    def release(self) -> None:
        for handler in (self.handler, self.sigterm):
            if handler is not None:
                handler.release()
        if self.lost and threading.current_thread() is threading.main_thread():
            # torchrun's agent sends SIGTERM to the survivors of a dead rank; arriving during the teardown that
            # follows, it would turn this rank's exit code 5 into a death by SIGTERM (the agent kills a rank
            # that does not end within 30 s).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of /proc/PID/stat, which tells a reused pid apart); None
    when it has ended (a zombie too: killed, not yet reaped by its launcher) or /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else fields[19].decode()


class Peers:
    """The other ranks' processes on this host (``{rank: (pid, start time)}``), to name a rank that died.

    A rank killed with SIGKILL reports nothing; its peers see it as a broken connection in their next
    collective or, first, as torchrun's SIGTERM to the survivors. Ranks on other hosts cannot be checked."""

    def __init__(self, table: Dict[int, Tuple[int, str]]) -> None:
        self.table = table

    @classmethod
    def gather(cls) -> "Peers":
        """Collective (one all_gather_object at start-up) over the world group; empty for one rank."""
        dist = torch.distributed
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return cls({})
        me = (socket.gethostname(), os.getpid(), _process_start(os.getpid()))
        everyone: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
        rank = dist.get_rank()
        return cls({r: (pid, start) for r, (host, pid, start) in enumerate(everyone)
                    if r != rank and host == me[0] and start is not None})

    def ended(self) -> List[int]:
        """The ranks of this host whose process has ended."""
        return sorted(r for r, (pid, start) in self.table.items() if _process_start(pid) != start)


class _CtrlCWatch:
    """Counts Ctrl-Cs from the interpreter's wakeup file descriptor, in a thread of its own.

    A signal may be delivered to any thread of the process (gloo's, OpenMP's, ...); Python runs its handler
    in the main thread only, once that thread is back in the interpreter, which a save blocked in a wait
    (a hung writer, a hung filesystem) never is. The interpreter writes every signal's number to the wakeup
    descriptor whichever thread took it: here the first Ctrl-C prints ``notice``, and each later one is sent
    on to the main thread (``pthread_kill``: a real signal interrupts its wait), whose handler raises."""

    def __init__(self, notice: str) -> None:
        self.notice = notice
        self.count = 0
        self.abort = False
        self._echoes = 0  # the signals sent on to the main thread: their own bytes are not Ctrl-Cs
        self._main = threading.main_thread().ident
        self._r, self.fd = os.pipe()
        os.set_blocking(self.fd, False)
        self._thread = threading.Thread(target=self._watch, name="ctrl-c-watch", daemon=True)
        self._thread.start()

    def handler(self, signum, frame) -> None:
        if self.abort:
            raise KeyboardInterrupt

    def _watch(self) -> None:
        while True:
            for number in os.read(self._r, 64):
                if number == 0:  # close()'s end mark
                    return
                if number != signal.SIGINT:
                    continue
                if self._echoes:
                    self._echoes -= 1
                    continue
                self.count += 1
                if self.count == 1:
                    if self.notice:
                        os.write(2, f"{self.notice}\n".encode("utf-8", "backslashreplace"))
                    continue
                self.abort = True
                self._echoes += 1
                signal.pthread_kill(self._main, signal.SIGINT)

    def close(self) -> int:
        """Stop the thread (every Ctrl-C written before this call counted); the number of Ctrl-Cs."""
        os.write(self.fd, b"\0")
        self._thread.join()
        os.close(self._r)
        os.close(self.fd)
        return self.count


@contextlib.contextmanager
def ctrl_c_held(notice: str = ""):
    """Hold a Ctrl-C (SIGINT) that arrives during the block and raise it at its end; a second one raises
    at once.

    dist_checkpointing forks its writer processes during a save: an interrupt delivered while Python runs
    the fork hooks is printed and dropped there (training would go on), and one delivered mid-write would
    leave a partial checkpoint. Held, it stops the run right after the save completes. The first one prints
    ``notice`` (a save that hangs kept the terminal silent); a second one is the way out of a save that does
    not end: it raises KeyboardInterrupt in the block, which leaves that save incomplete (the tracker,
    written last, never names it). Where Ctrl-C is not this process's to handle (a rank that leaves it to
    its parent), it is only kept out of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        return
    watch = _CtrlCWatch(notice)
    signal.signal(signal.SIGINT, watch.handler)
    wakeup = signal.set_wakeup_fd(watch.fd, warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGINT, previous)
        held = watch.close()
    if held:
        raise KeyboardInterrupt


# ------------------------------------------------------------------------------------------------
# the one-line reports


def last_checkpoint(rc: "RunConfig") -> Tuple[Optional[int], str]:
    """(iteration, words) of the checkpoint a rerun resumes from, read from the tracker now."""
    root = rc.checkpointing.save or rc.checkpointing.load
    try:
        last = checkpoint.read_tracker(root) if root and os.path.isdir(root) else None
    except checkpoint.CheckpointError:
        last = None
    if last is None:
        return None, "no checkpoint was saved"
    return last, (f"the last checkpoint is iteration {last} ({checkpoint.checkpoint_dir(root, last)}; resume with "
                  f"--load {root})")


def interrupted(rc: "RunConfig", state) -> str:
    """The line for Ctrl-C: where training stood and the checkpoint a rerun resumes from."""
    return f"interrupted at iteration {state.iteration}{cut_save(rc, state)}; {last_checkpoint(rc)[1]}"


def cut_save(rc: "RunConfig", state) -> str:
    """Words for the save a stop cut short (never loaded: the tracker, written last, does not name it)."""
    if state.saving is None or state.saving == last_checkpoint(rc)[0]:
        return ""
    return (f", during the save of iteration {state.saving} (incomplete, not loaded: "
            f"{checkpoint.checkpoint_dir(rc.checkpointing.save, state.saving)})")


def terminated(rc: "RunConfig", state) -> str:
    """The line for SIGTERM without --exit-signal-handler: where training stood, the save it cut short
    and the checkpoint a rerun resumes from."""
    return (f"terminated by SIGTERM at iteration {state.iteration}{cut_save(rc, state)}; "
            f"{last_checkpoint(rc)[1]}; pass --exit-signal-handler to save a checkpoint before stopping")


# How gloo and NCCL report a peer process that went away (killed, crashed) in a collective.
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe",
              "remote process exited", "socket closed")


def lost_rank(error: BaseException) -> Optional[str]:
    """The words of a collective's error that say another rank went away, else None."""
    text = str(error).lower()
    return next((w for w in _LOST_PEER if w in text), None)


def stop_code(error: BaseException, rc: "RunConfig", state, stops: Optional[Stops]) -> Optional[int]:
    """The exit code of a run that ``error`` stopped during training, after its one line on rank 0: Ctrl-C
    (EXIT_INTERRUPTED), SIGTERM without --exit-signal-handler (EXIT_TERMINATED), another rank lost in a
    collective (EXIT_RANK_LOST). None: ``error`` is no such stop (the caller re-raises it)."""
    if isinstance(error, KeyboardInterrupt):
        report_error(interrupted(rc, state), show=rank_is0())
        return EXIT_INTERRUPTED
    sigterm = stops.sigterm if stops is not None else None
    if isinstance(error, Terminated):
        if sigterm is not None and sigterm.lost:  # the launcher's SIGTERM after a rank died
            return _rank_lost(rc, state, stops, sigterm.lost, "its process ended; the launcher's SIGTERM followed")
        report_error(terminated(rc, state), show=rank_is0())
        return EXIT_TERMINATED
    lost = lost_rank(error) if isinstance(error, Exception) else None
    if lost is None:
        return None
    if sigterm is not None:
        sigterm.stopping = True  # torchrun's SIGTERM to the survivors follows
        if sigterm.received and not sigterm.lost:  # held during a save that the other ranks, stopping too, left
            report_error(terminated(rc, state), show=rank_is0())
            return EXIT_TERMINATED
    ranks = (sigterm.lost if sigterm is not None and sigterm.lost else None) or \
        (stops.peers.ended() if stops is not None else [])
    return _rank_lost(rc, state, stops, ranks, lost)


def _rank_lost(rc: "RunConfig", state, stops: Optional[Stops], ranks: List[int], why: str) -> int:
    """The line of a run that lost ``ranks`` (of this host; [] when the lost one is not known) and EXIT_RANK_LOST;
    SIGTERM is ignored from here on (:meth:`Stops.release`)."""
    if stops is not None:
        stops.lost = True
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "another rank"
    report_error(f"lost {who} ({why}) at iteration {state.iteration}{cut_save(rc, state)}; {last_checkpoint(rc)[1]}",
                 show=rank_is0())
    return EXIT_RANK_LOST
