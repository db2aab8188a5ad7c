"""Helpers for child processes (kept free of heavy imports: spawned children import this module)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def ignore_stop_signals(*_) -> None:
    """Leave SIGTERM/SIGINT to the rank. Slurm (--signal, preemption) and a terminal signal every process
    of the job: a rank's helper (the checkpoint writer's queue, a data-loader worker) killed by it would
    break the checkpoint that the rank saves in answer. The helpers still end with their rank."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def rank_helper_init() -> None:
    """Initializer of a rank's long-lived helper process: ignores stop signals, dies with the rank."""
    ignore_stop_signals()
    die_with_parent()
