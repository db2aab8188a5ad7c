"""Command-line runs for the tests, without paying the interpreter's imports each time.

    r = run_cli("pretrain_lev.py", ["--train-iters", "2", ...], env=env, cwd=repo, timeout=300)
    r.returncode, r.stdout, r.stderr  # as subprocess.run(..., capture_output=True, text=True) gives them

A test that runs a script as a user does (``python pretrain_lev.py ...``) paid about 3 s of CPU for the
imports of torch and megatron-core before the script did anything, and some tests run a script a dozen
times. ``run_cli`` runs it in a fresh process forked from the rank server (``megatron_lev.distributed.
spawn.rank_context``), which imported those once: the script runs as ``__main__`` with its arguments in
``sys.argv``, its folder first on ``sys.path``, the run's environment (warnings filters and the thread
count it sets included), working directory and exit code, its stdout and stderr captured from the file
descriptors (what C code and child processes print too), and its exit as an interpreter's (non-daemon
threads waited for, then the exit handlers). What a fork cannot
give is a fresh interpreter's start-up (what is imported then, a sitecustomize or PYTHONHASHSEED of the
run's environment): a test of start-up itself, of signals sent to a process group or of a launcher
(torchrun) starts a real process. Where CUDA is available the run is a real process too.

``run_torchrun(script, args, nproc=N)`` is ``torchrun --nproc-per-node N script *args`` for a test whose
subject is the script, not the launcher: its N ranks are forked the same way (a launch paid the launcher's
imports and every rank's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

__all__ = ["free_port", "run_cli", "run_torchrun"]


def _apply_interpreter_env(env: Mapping[str, str]) -> None:
    """What a new interpreter takes from its environment at start (the server took it from its own): the
    run's PYTHONWARNINGS options go in front of the filters, as they do at start-up, and the thread count."""
    import warnings

    for option in filter(None, env.get("PYTHONWARNINGS", "").split(",")):
        warnings._setoption(option.strip())
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))  # libgomp read it once, in the server


def _cli_main(_state, script: str, argv: Sequence[str], env: Mapping[str, str], out: str, err: str) -> None:
    import atexit
    import io
    import runpy
    import traceback

    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)  # the ranks of a run_torchrun share them
        os.dup2(f, fd)
        os.close(f)
    # Block-buffered text streams over the descriptors, as a new interpreter writing to pipes has.
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(open(2, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    _apply_interpreter_env(env)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        import threading

        threading._shutdown()  # as at an interpreter's exit: its non-daemon threads are waited for,
        atexit._run_exitfuncs()  # then its exit handlers run
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def run_cli(script: str, args: Sequence[object] = (), *, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``python script *args`` with its output captured (see the module docstring)."""
    import torch

    from megatron_lev.distributed.spawn import LaunchState, rank_context

    script, argv = str(script), [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else str(cwd)
    if torch.cuda.device_count() > 0:  # NVML: no CUDA context in this process
        return subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                              timeout=timeout)
    ctx = rank_context(hide_cuda=True)
    with tempfile.TemporaryDirectory(prefix="megatron_lev_cli_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        proc = ctx.Process(target=_cli_main, args=(LaunchState(ctx, env, cwd), script, argv, env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, script, *argv], timeout,
                                            output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess([sys.executable, script, *argv], proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the moment of the call (for MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str, args: Sequence[object] = (), *, nproc: int, env: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script *args`` on this machine, its ranks forked as :func:`run_cli`
    forks its one process. Each rank has the variables torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless
    set), and all of them write to one stdout and one stderr, as torchrun's workers do by default. When a
    rank fails, the others are killed, as torchrun's agent does, and the exit code is 1. What it is not:
    torchrun's agent (no TORCHELASTIC_* variables, restarts, error files or signal forwarding); a test of
    those starts torchrun. Where CUDA is available, torchrun itself runs."""
    import torch

    from megatron_lev.distributed.spawn import LaunchState, rank_context

    script, argv = str(script), [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    cwd = os.getcwd() if cwd is None else str(cwd)
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                str(port), script, *argv]
    if torch.cuda.device_count() > 0:  # NVML: no CUDA context in this process
        return subprocess.run(launcher, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    from multiprocessing.connection import wait

    ctx = rank_context(hide_cuda=True)
    with tempfile.TemporaryDirectory(prefix="megatron_lev_torchrun_") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        procs = []
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                            WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            rank_env.setdefault("OMP_NUM_THREADS", "1")
            procs.append(ctx.Process(target=_cli_main, args=(LaunchState(ctx, rank_env, cwd), script, argv, rank_env,
                                                             out, err)))
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        running = list(procs)
        try:
            while running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(launcher, timeout, output=_read(out), stderr=_read(err))
                ready = wait([p.sentinel for p in running], timeout=left)
                ended = [p for p in running if p.sentinel in ready]
                running = [p for p in running if p not in ended]
                for p in ended:
                    p.join()
                if any(p.exitcode for p in ended):
                    break  # one failed: the others are stopped below
        finally:
            for p in running:
                p.kill()
                p.join()
        code = 1 if any(p.exitcode for p in procs) else 0
        return subprocess.CompletedProcess(launcher, code, _read(out), _read(err))
