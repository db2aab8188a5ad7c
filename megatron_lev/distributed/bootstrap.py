"""The one distributed start-up of megatron-lev: CPU backend, process group, megatron's parallel state.

Every entry point (pretraining, evaluation, the local-rank launcher of the tests and the converter,
the benchmarks) starts and stops distributed work here and nowhere else:

    setup = init_distributed(tp=2, pp=1, timeout_minutes=10)
    try:
        ...
    finally:
        destroy_distributed(setup)

Design:

- Without CUDA, ``init_distributed`` installs the CPU backend (``megatron_lev.compat``) before it
  creates anything. This is the only place in the package that does; ``compat.apply`` is idempotent,
  so the backend is installed once per process however often start-up runs.
- The default process group comes from torchrun's environment (``env://``), from an explicit
  ``init_method`` (the local-rank launcher's file store), or, for a single process started without a
  launcher (no ``MASTER_PORT``), from an in-memory ``HashStore``: no rendezvous, no port to race for.
  Backend: NCCL with CUDA, gloo without, unless one is asked for. With CUDA each process selects the
  GPU of its ``LOCAL_RANK``.
- megatron's groups are set up from a :class:`~megatron_lev.distributed.layout.ParallelLayout`, given or
  made from the sizes on the process group's world size; its rules refuse a layout in one line before
  megatron-core sees it.
- What exists is reused: a default process group (several runs in one job) and megatron's parallel
  state when it has the requested layout (another layout is an error).
- ``destroy_distributed`` tears down only what its own ``init_distributed`` created: megatron's groups
  (megatron-core 0.16.1's ``destroy_model_parallel`` forgets them without destroying them, so they are
  destroyed here) and the default group if it was created here. A call that reused everything leaves
  everything in place. If start-up fails half-way, what it had created is torn down before the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import FrozenSet, Optional, Tuple

import torch
import torch.distributed as dist

from .layout import DistributedConfigError, ParallelLayout

__all__ = ["BACKENDS", "DistributedSetup", "destroy_distributed", "init_distributed", "report_error",
           "reset_after_job", "set_seed"]

BACKENDS = ("nccl", "gloo")


@dataclass
class DistributedSetup:
    """What one :func:`init_distributed` call found and created (what :func:`destroy_distributed` undoes)."""

    rank: int
    world_size: int
    created_process_group: bool
    """The default process group was created by this call (destroying it also destroys every subgroup)."""
    created_parallel_state: bool
    """megatron's model-parallel state was initialised by this call."""
    groups_before: FrozenSet = field(default_factory=frozenset, repr=False)
    """The process groups that existed before this call; they are never destroyed here."""
    layout: Optional[ParallelLayout] = None
    """The parallel layout megatron's groups are set up with (None with ``model_parallel=False``)."""
    env_set: Tuple[str, ...] = ()
    """The launcher variables (RANK, WORLD_SIZE, ...) this call set because they were absent; removed at
    teardown, so a later library in the same process (accelerate, transformers) does not take the process
    for one rank of a distributed job."""
    destroyed: bool = False

    def __enter__(self) -> "DistributedSetup":
        return self

    def __exit__(self, *exc) -> None:
        destroy_distributed(self)


def report_error(line: str, *, show: bool = True) -> None:
    """Print ``error: line`` on stderr (where ``show``: usually rank 0 only) and, under torchrun, record
    it as this worker's failure.

    torchrun's agent reads a failed worker's ``TORCHELASTIC_ERROR_FILE`` (the JSON that
    ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler`` writes) and shows its message as
    that worker's "traceback" in the ``ChildFailedError`` summary it prints last; without the file the
    field says "To enable traceback see ...". Every failing rank records its line, since the summary's
    root cause is the earliest failure, on whichever rank. No ``py_callstack`` is recorded: the summary
    then shows the message itself.
    """
    text = f"error: {line}"
    if show:
        print(text, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": text, "extraInfo": {"timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError:  # the summary then falls back to its generic text; the line itself is out
        pass


def _resolve_backend(backend: Optional[str], cuda: bool) -> str:
    if backend is None:
        return "nccl" if cuda else "gloo"
    if backend not in BACKENDS:
        raise DistributedConfigError(
            f"distributed backend {backend!r} is not supported; use one of {', '.join(BACKENDS)}")
    if backend == "nccl" and not cuda:
        raise DistributedConfigError(
            "distributed backend 'nccl' needs CUDA, which this process does not have; use gloo")
    return backend


def _apply_cpu_backend() -> None:
    from megatron_lev import compat
    from megatron_lev.compat.without_te import define_missing_te_names

    compat.quiet_repeated_warnings()
    define_missing_te_names()  # megatron's MoE router without Transformer Engine
    if not torch.cuda.is_available():
        compat.apply()


def _live_groups() -> FrozenSet:
    """The process groups that exist now (none before the default group is initialised)."""
    if not dist.is_initialized():
        return frozenset()
    from torch.distributed import distributed_c10d

    return frozenset(distributed_c10d._world.pg_map)  # torch 2.x has no public listing of live groups


_LAUNCHER_DEFAULTS = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"))


def _init_process_group(backend: Optional[str], timeout: timedelta, init_method: Optional[str]) -> Tuple[str, ...]:
    """Create the default group; returns the launcher variables it set (see ``DistributedSetup.env_set``)."""
    cuda = torch.cuda.is_available()
    backend = _resolve_backend(backend, cuda)  # checked before anything is created
    env_set = tuple(name for name, _ in _LAUNCHER_DEFAULTS if name not in os.environ)
    for name, default in _LAUNCHER_DEFAULTS:
        os.environ.setdefault(name, default)
    try:
        rank, world, local_rank = (int(os.environ[n]) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        kw = dict(rank=rank, world_size=world, timeout=timeout)
        if init_method is not None:
            kw["init_method"] = init_method
        elif "MASTER_PORT" not in os.environ:
            if world != 1:
                raise DistributedConfigError(
                    f"WORLD_SIZE={world} but MASTER_PORT is not set; start the processes with torchrun")
            # A single process started without a launcher needs no rendezvous (and no free port to race for).
            kw["store"] = dist.HashStore()
        elif "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            env_set += ("MASTER_ADDR",)
        if cuda:
            n_gpus = torch.cuda.device_count()
            if local_rank < n_gpus:
                torch.cuda.set_device(local_rank)
            elif backend == "nccl":
                raise DistributedConfigError(
                    f"LOCAL_RANK {local_rank} has no GPU (this node has {n_gpus}); start at most {n_gpus} "
                    "processes per node")
        dist.init_process_group(backend, **kw)
    except BaseException:
        _unset(env_set)
        raise
    return env_set


def _unset(names) -> None:
    for name in names:
        os.environ.pop(name, None)


def _init_parallel_state(layout: ParallelLayout, timeout_minutes: float) -> bool:
    """megatron's model-parallel groups (expert groups included) of ``layout``, unless they exist with this
    layout; True if created here."""
    from megatron.core import parallel_state as ps

    want = (layout.tp, layout.pp, layout.vpp, layout.cp, layout.ep, layout.expert_tp)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
        if have != want:
            names = ("TP", "PP", "VPP", "CP", "EP", "ETP")
            raise DistributedConfigError(
                f"model parallelism is already initialised with {' '.join(f'{n}={v}' for n, v in zip(names, have))}, "
                f"not {' '.join(f'{n}={v}' for n, v in zip(names, want))}")
        return False
    ps.initialize_model_parallel(**layout.megatron_sizes(), distributed_timeout_minutes=timeout_minutes)
    return True


def init_distributed(
    *,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    vpp: Optional[int] = None,
    backend: Optional[str] = None,
    timeout_minutes: float = 30.0,
    init_method: Optional[str] = None,
    seed: Optional[int] = None,
    ep: Optional[int] = None,
    etp: Optional[int] = None,
    layout: Optional[ParallelLayout] = None,
    model_parallel: bool = True,
) -> DistributedSetup:
    """Start distributed work in this process (see the module docstring); pass the result to
    :func:`destroy_distributed`.

    ``layout``: the :class:`ParallelLayout` to set megatron's groups up with (its world size must be this
    job's); or its sizes: ``tp``/``pp``/``vpp``, megatron's tensor, pipeline and virtual-pipeline sizes,
    ``ep``/``etp``, its expert-parallel and expert-tensor-parallel sizes (unset: 1, and ``etp`` = ``tp``,
    megatron's default), made into a layout on the process group's world size. ``backend``: nccl or
    gloo (default: nccl with CUDA, else gloo). ``timeout_minutes``: collective timeout of every group
    created here. ``init_method``: rendezvous URL instead of the environment (rank and world size still
    come from ``RANK``/``WORLD_SIZE``). ``seed``: also seed torch and megatron's model-parallel RNG
    tracker (every tensor-parallel rank its own stream). ``model_parallel=False``: the default group only
    (a long-lived rank that sets megatron's groups up per job, as the test harness's rank pool does).
    Bad input raises :class:`DistributedConfigError`.
    """
    sizes = dict(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp)
    if layout is not None and any(v is not None for v in sizes.values()):
        given = ", ".join(k for k, v in sizes.items() if v is not None)
        raise DistributedConfigError(
            f"init_distributed takes a layout or its sizes, not both (got a layout and {given})")
    _apply_cpu_backend()
    timeout = timedelta(minutes=timeout_minutes)
    groups_before = _live_groups()
    created_pg = not dist.is_initialized()
    env_set = _init_process_group(backend, timeout, init_method) if created_pg else ()
    setup = DistributedSetup(rank=dist.get_rank(), world_size=dist.get_world_size(),
                             created_process_group=created_pg, created_parallel_state=False,
                             groups_before=groups_before, env_set=env_set)
    try:
        if not model_parallel:
            return setup
        if layout is None:
            layout = ParallelLayout(world_size=setup.world_size, **{k: v for k, v in sizes.items() if v is not None})
        elif layout.world_size != setup.world_size:
            raise DistributedConfigError(
                f"the parallel layout is for {layout.world_size} processes but this job has {setup.world_size} "
                f"(WORLD_SIZE); start {layout.world_size} processes or make the layout for {setup.world_size}")
        setup.layout = layout
        setup.created_parallel_state = _init_parallel_state(layout, timeout_minutes)
        if seed is not None:
            set_seed(seed, per_pipeline_stage=False)
    except BaseException:
        destroy_distributed(setup)  # leave nothing half-built behind
        raise
    return setup


def set_seed(seed: int, *, per_pipeline_stage: bool = True) -> None:
    """Megatron-LM's seeding: python, numpy, torch and megatron's model-parallel RNG tracker (which gives
    every tensor-parallel rank its own stream). With ``per_pipeline_stage`` each pipeline stage uses
    ``seed + 100 * stage``, as a training run does. Needs megatron's parallel state."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = int(seed) + (100 * ps.get_pipeline_model_parallel_rank() if per_pipeline_stage else 0)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def reset_after_job(env: dict, cwd: str, threads: int) -> None:
    """What a job may leave in a process that runs another one after it (a reused test rank), undone:
    megatron's micro-batch calculator and MoE loss tracker, the default dtype, grad mode, thread count,
    the environment (back to ``env``), the working directory (``cwd``) and the CPU backend's hit counts
    (reported per job). Its process groups are torn down by its own ``destroy_distributed``."""
    import gc

    from megatron.core import num_microbatches_calculator as nmc

    from megatron_lev import compat
    from megatron_lev.compat import versions

    nmc.unset_num_microbatches_calculator()
    versions.reset_moe_metrics()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)
    # numba's pool is fixed for the process once imported, and numba re-reads its size from the environment
    # when it compiles: a later job's first compile would otherwise fail ("Cannot set NUMBA_NUM_THREADS").
    numba_sized = ({k: v for k, v in os.environ.items() if k in ("NUMBA_NUM_THREADS", "MEGATRON_LEV_NUMBA_NUM_THREADS")}
                   if "numba" in sys.modules else {})
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(numba_sized)
    os.chdir(cwd)
    if compat.is_applied():
        compat.reset_hit_counts()
    gc.collect()


def destroy_distributed(setup: DistributedSetup) -> None:
    """Tear down what ``setup``'s :func:`init_distributed` created, and nothing else; a second call does
    nothing. A failure here is reported as a warning (it must not hide the run's own outcome)."""
    if setup.destroyed:
        return
    setup.destroyed = True
    _unset(setup.env_set)
    try:
        if setup.created_parallel_state:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        if not dist.is_initialized():
            return
        if setup.created_process_group:
            dist.destroy_process_group()  # the default group, and every subgroup with it
        elif setup.created_parallel_state:
            # In a process that outlives this run each forgotten group would keep its communication threads.
            for group in _live_groups() - setup.groups_before:
                dist.destroy_process_group(group)
            # The run's model, optimizer and DDP buffers hold its groups in reference cycles: until a
            # collection frees them each group keeps its communication threads (gloo polls its sockets,
            # measured at 40% of the CPU of a job of 13 runs) and, with NCCL, its communicators.
            import gc

            gc.collect()
    except Exception as e:  # pragma: no cover - depends on the backend's state at exit
        warnings.warn(f"distributed teardown failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
