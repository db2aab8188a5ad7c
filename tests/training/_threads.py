"""Rank-0 steps of a multi-run job that record the process's threads (tests/training/_multi_run.py)."""

from __future__ import annotations

import json
import os


def record_gloo_threads(path: str) -> None:
    """Write how many of this process's threads are gloo's socket loops (one per live gloo group's device)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    with open(path, "w") as f:
        json.dump(names.count("gloo_tcp_loop"), f)
