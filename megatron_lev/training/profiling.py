"""What the run does around its steps to measure them and keep their times steady: the profiler
(``--profile``), the CUDA memory history (``--record-memory-history``) and manual garbage collection
(``--manual-gc``).

Each is a context manager entered once around what it covers, which stops it however that ends (a
return, an error, Ctrl-C), and yields what the loop calls per step:

- :func:`memory_history` around the whole run (the model's build included), with
  :func:`snapshot_memory` on the log lines;
- :func:`manual_gc` around the training loop (Python's collector off, collections at the same iterations
  on every rank), yielding a :class:`ManualGC` whose ``after_step`` collects every --manual-gc-interval
  iterations; :func:`gc_around_evaluation` around each evaluation;
- :class:`Profiler` around the training loop: ``before_step`` / ``after_step`` open and close the
  --profile-step-start .. --profile-step-end window.

All of them act on the --profile-ranks only (manual GC on every rank) and never on a tensor: no device
work and no host sync is added to a step outside the profile window (opening and closing it, the profiler
flushes and writes its trace on the profiled ranks, which the others then wait for at their next collective).
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import TYPE_CHECKING, Iterator

import torch

from megatron_lev._procutil import atomic_path

if TYPE_CHECKING:
    from megatron_lev.config import RunConfig


def _profiled_rank(rc: "RunConfig") -> bool:
    return torch.distributed.get_rank() in rc.run.profile_ranks


# ------------------------------------------------------------------------------------------------
# --record-memory-history


def dump_memory_snapshot(path: str) -> None:
    """--record-memory-history's snapshot, written beside ``path`` and renamed: a reader (or a stop
    mid-write) never sees a truncated pickle, and a failed write keeps the previous snapshot."""
    with atomic_path(path) as tmp:
        torch.cuda.memory._dump_snapshot(tmp)


@contextlib.contextmanager
def memory_history(rc: "RunConfig"):
    """--record-memory-history on the --profile-ranks for the whole run: started before the model is built
    (so that the snapshots hold every allocation, as Megatron-LM), stopped however the run ends."""
    on = rc.run.record_memory_history and _profiled_rank(rc)
    if on:
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100_000, trace_alloc_record_context=True)
    try:
        yield
    finally:
        if on:
            torch.cuda.memory._record_memory_history(enabled=None)


def snapshot_memory(rc: "RunConfig") -> None:
    """On a log line: the memory history so far to --memory-snapshot-path (one file per profiled rank,
    replaced at each line)."""
    if rc.run.record_memory_history and _profiled_rank(rc):
        base, ext = os.path.splitext(rc.run.memory_snapshot_path)
        dump_memory_snapshot(f"{base}_{torch.distributed.get_rank()}{ext}")


# ------------------------------------------------------------------------------------------------
# --manual-gc


class ManualGC:
    """--manual-gc-interval: a full collection every that many iterations (0: only at the start)."""

    def __init__(self, rc: "RunConfig") -> None:
        self.interval = rc.run.manual_gc_interval if rc.run.manual_gc else 0

    def after_step(self, iteration: int) -> None:
        if self.interval and iteration % self.interval == 0:
            gc.collect()


@contextlib.contextmanager
def manual_gc(rc: "RunConfig") -> Iterator[ManualGC]:
    """--manual-gc around the training loop: Python's collector off and one full collection first, so that
    collections happen at the same points on every rank instead of at allocation thresholds (a rank paused
    in a collection holds up the others at the next collective; Megatron-LM). At the end the collector is
    as it was before, however the loop ended (Ctrl-C in that first collection included): a process may run
    several trainings."""
    on, was_enabled = rc.run.manual_gc, gc.isenabled()
    try:
        if on:
            gc.disable()
            gc.collect()
        yield ManualGC(rc)
    finally:
        if on and was_enabled:
            gc.enable()


@contextlib.contextmanager
def gc_around_evaluation(rc: "RunConfig"):
    """--manual-gc with --manual-gc-eval: a full collection before an evaluation and a young-generation
    one after it (what the evaluation created and dropped; Megatron-LM)."""
    on = rc.run.manual_gc and rc.run.manual_gc_eval
    if on:
        gc.collect()
    yield
    if on:
        gc.collect(generation=0)


SPAN_PREFIX = "megatron_lev."


def span(name: str):
    """A named range of the training step in a --profile trace (``megatron_lev.<name>``: batch, step,
    forward_backward, loss, optimizer, log), so a trace's host syncs can be told apart by the part of the step
    that issued them. Outside a profile it costs a dispatcher call and records nothing."""
    return torch.profiler.record_function(SPAN_PREFIX + name)


# ------------------------------------------------------------------------------------------------
# --profile


class Profiler:
    """Megatron-LM's --profile on the --profile-ranks: torch.profiler (--use-pytorch-profiler; its
    schedule waits until --profile-step-start, records to --profile-step-end, and writes a trace
    under --tensorboard-dir), else nsys ranges (cudaProfilerStart/Stop around NVTX ranges).

    A context manager: entered around the training loop, it ends the profile on the way out (a run that
    stops before --profile-step-end writes what it recorded)."""

    def __init__(self, rc: "RunConfig") -> None:
        self.rc = rc
        self.prof = None
        self.nvtx = None
        self.on = rc.run.profile and _profiled_rank(rc)
        if self.on and rc.run.use_pytorch_profiler:
            start, end = rc.run.profile_step_start, rc.run.profile_step_end
            self.prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(rc.logging.tensorboard_dir),
                # No Python stacks: on the CPU path they make a two-step trace a gigabyte. Shapes only when
                # asked (Megatron-LM's --pytorch-profiler-collect-shapes): they add host work to every operator.
                record_shapes=rc.run.pytorch_profiler_collect_shapes, with_stack=False)
            self.prof.start()

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def before_step(self, iteration: int) -> None:
        if not self.on:
            return
        if self.prof is not None:
            self.prof.step()
        elif iteration == self.rc.run.profile_step_start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self.rc.run.pytorch_profiler_collect_shapes)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        if self.on and iteration == self.rc.run.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Ends the profile."""
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        elif self.nvtx is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
        self.on = False
