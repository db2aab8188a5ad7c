"""A run with data-loader worker processes exits when it is done.

The workers ignore SIGTERM (a job-wide signal must not kill them under a save); a loader iterator kept
alive by a reference cycle until interpreter exit left them to multiprocessing's exit hook, which sends
SIGTERM and then waits without a limit: the rank never exited. ``--manual-gc`` (no automatic collection)
made it certain; the loop now stops its loaders' workers itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_run_with_loader_workers_and_manual_gc_exits(tmp_path):
    argv = [sys.executable, str(REPO / "pretrain_lev.py"), "--num-layers", "1", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64", "--eval-iters", "1", "--eval-interval", "1", "--num-workers", "1",
            "--manual-gc", "--quiet-config"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the run did not exit within 300 s after training (output: {e.stdout!r:.2000})")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "validation loss at iteration 2" in r.stdout
