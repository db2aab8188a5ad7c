"""Helpers for child processes, for stopping a command and for checking where it writes (kept free of heavy
imports: spawned children import this module)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import tempfile
from typing import Iterator, Optional

_PRCTL = None
PR_SET_PDEATHSIG = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _prctl():
    """libc's prctl, loaded once (a forked child must not dlopen: another thread may hold the loader lock)."""
    global _PRCTL
    if _PRCTL is None:
        try:
            import ctypes

            _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
        except (OSError, AttributeError):
            _PRCTL = False
    return _PRCTL


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies (no-op elsewhere)."""
    prctl = _prctl()
    if prctl:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def guard_process_tree() -> None:
    """Tie a training rank and everything it forks to the launcher's lifetime.

    Every process this one forks from now on (dist_checkpointing's writer processes, data-loader
    workers) gets the parent-death signal, so none outlives the rank. Under torchrun (which starts
    each worker in its own session, out of reach of a signal to the launcher's process group) the
    rank itself dies with the launcher; a rank whose launcher is already gone exits at once.
    """
    if not _prctl():
        return
    os.register_at_fork(after_in_child=die_with_parent)
    if os.environ.get("TORCHELASTIC_RUN_ID") is None:
        return  # started from a shell: may legitimately outlive it (nohup)
    die_with_parent()
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def ignore_stop_signals(*_) -> None:
    """Leave SIGTERM/SIGINT to the rank. Slurm (--signal, preemption) and a terminal signal every process
    of the job: a rank's helper (a data-loader worker) killed by it would
    break the checkpoint that the rank saves in answer. The helpers still end with their rank."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ignore_interrupt() -> None:
    """Initializer of a command's worker processes: Ctrl-C (SIGINT to the whole foreground process group)
    is left to the parent, which stops the workers; SIGTERM still ends them (``Pool.terminate``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def interrupted(line: str, *, show: bool = True) -> int:
    """Report a Ctrl-C in one line (``error: line`` on stderr, where ``show``) and return the exit code 130."""
    import sys

    if show:
        print(f"error: {line}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def unwritable(path: str, reserve: int = 0) -> Optional[str]:
    """Why directory ``path`` cannot be written ("cannot write in DIR (reason)"), or None: a probe file is
    written and removed in it or, when it does not exist yet, in the nearest folder above it. With ``reserve``
    the probe takes that many bytes of the disk first (a full disk takes an empty file, and fails only
    once the work is done and its results are written)."""
    where = os.path.abspath(path)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    try:
        if not os.path.isdir(where):
            raise NotADirectoryError(20, f"{where} is a file")
        fd, probe = tempfile.mkstemp(dir=where, prefix=".write-test-")
        try:
            if reserve:
                _reserve(fd, reserve)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            import shutil

            return (f"no space left in {where} for the {reserve / 2**20:.0f} MiB its results need "
                    f"({shutil.disk_usage(where).free / 2**20:.1f} MiB free)")
        return f"cannot write in {where} ({e.strerror or e})"
    return None


def _reserve(fd: int, size: int) -> None:
    """Take ``size`` bytes of the disk for file ``fd``: allocated where the file system can (no data
    written), else written as zeros and synced (a quota or a full disk fails the write or the sync)."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    block = bytes(min(size, 1 << 20))
    left = size
    while left > 0:
        left -= os.write(fd, block[:left])
    os.fsync(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` (same extension) to write to: renamed to ``path`` when the block
    ends, removed when it fails or is interrupted (a full disk, Ctrl-C), so that a result file is whole or
    absent, never truncated."""
    head, base = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(base)
    tmp = os.path.join(head, f".{stem}.partial{ext}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
