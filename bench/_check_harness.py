"""What the GPU check's stages and the science run share: their exceptions, the logged subprocess
with a time limit, several of them at once under one deadline, and atomic report writes.

``bench/gpu_check.py``, ``bench/gpu_science.py`` and ``bench/reproduce.py`` import this module (bench/
is on their import path); none of them imports another for these.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_RC = 124  # what a command killed at its time limit returns, as timeout(1)


class Skip(Exception):
    """A stage that cannot run here; the message says why. ``figures``: what it did run or would run
    (the command lines of the runs it left out), kept in the report."""

    def __init__(self, message: str, figures: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.figures = figures or {}


class CheckFailed(Exception):
    """A stage that ran and found a fault; ``figures`` are kept in the report."""

    def __init__(self, message: str, figures: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.figures = figures or {}


class CheckTimeout(Exception):
    """A stage killed at its time limit; what it measured until then is kept."""

    def __init__(self, seconds: float, figures: Optional[Dict[str, Any]] = None, log_tail: str = ""):
        super().__init__(f"timeout: killed after {seconds:.0f} s")
        self.figures, self.log_tail = figures or {}, log_tail


def tail(text: str, n: int = 2000) -> str:
    return text[-n:] if text else ""


def run_logged(cmd: Sequence[Any], timeout: Optional[float], log: Path, env: Optional[Dict[str, str]] = None,
               append: bool = False) -> Tuple[int, str]:
    """Run ``cmd`` (from the repository root) with stdout+stderr to ``log``; (exit status, output).

    At ``timeout`` seconds (None: no limit) the whole process group is killed (a launcher's workers
    too) and ``TIMEOUT_RC`` is returned: the output written until then stays in the log. The group
    stays in this session, so whatever ends this run's session (a device's command limit) ends the
    group too. ``append`` adds to ``log`` (a resumed run's earlier attempts stay); the output
    returned is this command's only."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a" if append else "w", encoding="utf-8") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        start = f.tell()
        p = subprocess.Popen(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO),
                             env=env, process_group=0)
        try:
            rc = p.wait(timeout=None if timeout is None else max(1.0, timeout))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = TIMEOUT_RC
    with open(log, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        return rc, f.read()


def run_parallel(jobs: Sequence[Tuple[Sequence[Any], Path]], deadline: Optional[float],
                 env: Optional[Dict[str, str]] = None, clock=time.monotonic) -> List[Tuple[int, str]]:
    """Run every (command, log) of ``jobs`` at once, each killed at ``deadline`` (``clock`` time; None:
    no limit); their (exit status, output) in the order given."""
    results: List[Optional[Tuple[int, str]]] = [None] * len(jobs)

    def one(i: int, cmd, log) -> None:
        left = None if deadline is None else deadline - clock()
        results[i] = run_logged(cmd, left, log, env)

    threads = [threading.Thread(target=one, args=(i, cmd, log)) for i, (cmd, log) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r if r is not None else (1, "not started") for r in results]


def write_json(path: Path, obj: Any) -> None:
    """Atomic: a reader (or a killed run) sees the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
