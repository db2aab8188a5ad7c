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
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Mapping, Optional, Sequence

__all__ = ["run_cli"]


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
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
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
