"""``--log-progress``: Megatron-LM's ``progress.txt`` in the ``--save`` directory.

One tab-separated line per event, as Megatron-LM writes them (its tools read them): the time, the Slurm job
id, the number of ranks, then "Starting job" when a job starts and, after each checkpoint, "Saved checkpoint"
with the iteration, the job's throughput (its floating-point operations over its time since start), the
throughput since the first job of this world size in the file (Megatron-LM's "cumulative throughput"), the
floating-point operations and tokens trained so far (kept in the checkpoint's counters across resumes).
Written by rank 0 only; an unwritable file is one warning line, never a stopped run.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from typing import Callable, List, Optional, Tuple

PROGRESS_NAME = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def progress_line(event: str, world_size: int, now: Optional[datetime] = None) -> str:
    """One line of the file: time, job id, ranks, then ``event`` (its own tab-separated fields)."""
    stamp = (now or datetime.now()).strftime(_TIME_FORMAT)
    return f"{stamp}\tJob ID: {os.environ.get('SLURM_JOB_ID', '')}\t# GPUs: {world_size}\t{event}\n"


def saved_event(iteration: int, job_flops: float, job_seconds: float, cumulative: Tuple[float, float],
                total_flops: float, tokens: int, world_size: int) -> str:
    """The "Saved checkpoint" event; ``cumulative``: (floating-point operations, seconds) since the first
    job of this world size."""
    def tflops(flops: float, seconds: float) -> float:
        return flops / max(seconds, 1e-9) / world_size / 1e12

    return (f"Saved checkpoint\tIteration: {iteration}\tJob throughput: {tflops(job_flops, job_seconds):.1f} "
            f"TFLOP/s/GPU\tCumulative throughput: {tflops(*cumulative):.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {total_flops:.2e}\tTokens (in billions): {tokens / 1e9:.2f}")


def first_start(lines: List[str], world_size: int) -> Optional[Tuple[datetime, float]]:
    """(start time, floating-point operations saved by then) of the first job of ``world_size`` ranks in the
    file's ``lines`` (Megatron-LM's get_start_time_from_progress_log); None where there is none."""
    flops_so_far = 0.0
    for line in lines:
        fields = line.rstrip("\n").split("\t")
        if len(fields) < 4:
            continue
        if fields[3] == "Saved checkpoint":
            for f in fields[4:]:
                if f.startswith("Floating-point operations: "):
                    flops_so_far = float(f.split(": ", 1)[1])
        elif fields[3] == "Starting job" and fields[2] == f"# GPUs: {world_size}":
            return datetime.strptime(fields[0], _TIME_FORMAT), flops_so_far
    return None


class ProgressLog:
    """The run's ``progress.txt`` (rank 0 writes; other ranks hold a disabled log)."""

    def __init__(self, save_dir: Optional[str], world_size: int, enabled: bool, log: Callable[[str], None]):
        self.path = os.path.join(save_dir, PROGRESS_NAME) if (enabled and save_dir) else None
        self.world_size, self.log = world_size, log
        self.job_start, self.job_start_flops = time.time(), 0.0

    def _append(self, event: str) -> None:
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)  # before the first save makes it
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(progress_line(event, self.world_size))
        except OSError as e:
            self.log(f"WARNING: --log-progress: cannot write {self.path} ({e.strerror or e}); training goes on")
            self.path = None

    def start(self, flops_so_far: float) -> None:
        self.job_start, self.job_start_flops = time.time(), flops_so_far
        self._append("Starting job")

    def saved(self, iteration: int, flops_so_far: float, tokens: int) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                first = first_start(f.readlines(), self.world_size)
        except OSError:
            first = None
        since, base = first if first else (datetime.fromtimestamp(self.job_start), self.job_start_flops)
        self._append(saved_event(iteration, flops_so_far - self.job_start_flops, time.time() - self.job_start,
                                 (flops_so_far - base, (datetime.now() - since).total_seconds()), flops_so_far,
                                 tokens, self.world_size))
