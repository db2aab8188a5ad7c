"""Long-lived gloo worlds for the tests: ranks started once per world size and reused.

Starting a rank costs several seconds (torch and megatron-core imports, the gloo rendezvous); a suite
of multi-rank checks that starts fresh ranks for each pays that again and again. A :class:`RankPool`
starts ``world_size`` ranks once, joined in one default process group, and then runs job after job on
them: each job gets megatron's parallel state for its own layout (TP, PP, VPP), set up before and torn
down after it (megatron-core's own unit tests re-initialise the model-parallel state per test the same
way), and the per-job state a job may leave behind is reset: the micro-batch calculator, the default
dtype, grad mode, the environment, the working directory, the CPU backend's hit counts, the MoE loss
tracker.

A job that fails, times out or kills a rank retires the pool: the other ranks may be stuck in a
collective with the failed one, so all of them are stopped and the next job starts a fresh world.
Jobs that need a fresh process (launcher variables, signals, process-wide patches they do not undo)
are run with :func:`megatron_lev.distributed.spawn_ranks` instead (``run_distributed(fresh=True)``).

``get_pool(world_size)`` gives the pool of this process for a world size (started on first use);
``close_pools()`` stops them (at interpreter exit too).
"""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import os
import queue as queue_mod
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

from megatron_lev.distributed import RankFailure, check_layout
from megatron_lev.distributed import spawn as spawn_mod

__all__ = ["RankPool", "close_pools", "get_pool"]

_STOP = None


def _pool_rank(_state, rank: int, world: int, store_file: str, tasks, out_q, collective_timeout: float, quiet: bool,
               hide_cuda: bool) -> None:
    spawn_mod.start_rank(rank, world, quiet, hide_cuda)
    import torch
    import torch.distributed as dist

    from megatron_lev.distributed import destroy_distributed, init_distributed, reset_after_job

    try:
        base = init_distributed(backend="gloo", timeout_minutes=collective_timeout / 60,
                                init_method=f"file://{store_file}", model_parallel=False)
    except BaseException:
        out_q.put((None, rank, None, traceback.format_exc(), False))
        return
    env, cwd, threads = dict(os.environ), os.getcwd(), torch.get_num_threads()
    launcher = multiprocessing.parent_process()  # the test process (a forked rank's parent is the server)
    try:
        while True:
            try:
                task = tasks.get(timeout=5.0)
            except queue_mod.Empty:
                if not launcher.is_alive():  # the test process is gone: no one will send a job or a stop
                    break
                continue
            if task is _STOP:
                break
            job, fn, args, kwargs, layout, seed, passthrough, job_timeout = task
            payload, error, one_line = spawn_mod.run_task(fn, args, kwargs, layout, seed, job_timeout, passthrough)
            try:
                reset_after_job(env, cwd, threads)
                if not dist.is_initialized() or dist.get_world_size() != world:
                    raise RuntimeError("the job destroyed the rank's default process group")
            except BaseException:
                error = (error or "") + "\nthe rank could not be reset after the job:\n" + traceback.format_exc()
            out_q.put((job, rank, payload, error, one_line))
    finally:
        destroy_distributed(base)


class RankPool:
    """``world_size`` gloo ranks that run one job after another (see the module docstring)."""

    def __init__(self, world_size: int, *, collective_timeout: float = 120.0, quiet: bool = False,
                 hide_cuda: bool = False):
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.quiet, self.hide_cuda = quiet, hide_cuda
        self.jobs_run = 0
        self._job_ids = itertools.count()
        self._procs: List[Any] = []

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self) -> None:
        ctx = spawn_mod.rank_context(self.hide_cuda)
        fd, self._store_file = tempfile.mkstemp(prefix="megatron_lev_pool_", suffix=".store")
        os.close(fd)
        os.remove(self._store_file)  # the file store creates it
        self._out_q = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            # Not daemonic: a job may start processes of its own (dist_checkpointing's writers).
            ctx.Process(target=_pool_rank,
                        args=(spawn_mod.LaunchState(ctx, hide_cuda=self.hide_cuda), r, self.world_size, self._store_file, self._tasks[r],
                              self._out_q, self.collective_timeout, self.quiet, self.hide_cuda))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
            seed: Optional[int] = None, args: Sequence = (), kwargs: Optional[dict] = None,
            timeout: float = 600.0, collective_timeout: Optional[float] = None,
            passthrough: Tuple[Type[BaseException], ...] = (),
            failure_cls: Type[Exception] = RankFailure) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank inside megatron's groups of this layout; the
        per-rank results, or ``failure_cls`` with every failed rank's traceback (as ``spawn_ranks``).
        ``collective_timeout``: of the job's model-parallel groups (default: the pool's)."""
        check_layout(self.world_size, tp, pp)
        if not self.alive:
            self.close()
            self._start()
        job = next(self._job_ids)
        task = (job, fn, tuple(args), kwargs or {}, (tp, pp, vpp), seed, tuple(passthrough),
                collective_timeout or self.collective_timeout)
        for q in self._tasks:
            q.put(task)

        def unpack(report):
            got, rank, payload, error, one_line = report
            if got is None:  # the rank could not join the world
                raise failure_cls(f"rank {rank} of the pool could not start:\n{error}")
            if got != job:
                raise failure_cls(f"rank {rank} reported job {got} while job {job} ran")
            return rank, payload, error, one_line

        ok = False
        try:
            results = spawn_mod.collect_reports(self._procs, self._out_q, self.world_size, timeout, failure_cls,
                                                passthrough, f"tp={tp}, pp={pp}, pooled ranks", unpack)
            ok = True
            return results
        finally:
            self.jobs_run += 1
            if not ok:  # ranks may be stuck in a collective with the failed one: start afresh next time
                self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, else after they finish their teardown)."""
        procs, self._procs = self._procs, []
        if not procs:
            return
        if not kill:
            for q in self._tasks:
                try:
                    q.put(_STOP)
                except (OSError, ValueError):
                    pass
        for p in procs:
            p.join(timeout=0 if kill else 20)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [self._out_q, *self._tasks]:
            q.close()
            q.cancel_join_thread()
        if os.path.exists(self._store_file):
            os.remove(self._store_file)


_POOLS: Dict[Tuple[int, bool, bool], RankPool] = {}


def get_pool(world_size: int, *, quiet: bool = False, hide_cuda: bool = False) -> RankPool:
    """This process's pool of ``world_size`` ranks (one per world size and rank options)."""
    key = (world_size, quiet, hide_cuda)
    if key not in _POOLS:
        _POOLS[key] = RankPool(world_size, quiet=quiet, hide_cuda=hide_cuda)
    return _POOLS[key]


def close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(close_pools)
