"""Run a test body on N gloo ranks with megatron-core's model-parallel groups set up.

    results = run_distributed(check_fn, world_size=4, tp=2, pp=2, args=(...))

Each job runs on ranks started for it (``megatron_lev.distributed.spawn_ranks``), megatron's RNG tracker
seeded (``seed``, default 1234). With ``MEGATRON_LEV_RANK_POOL=1`` (or ``pooled=True``) the ranks come
from this process's rank pool instead (``megatron_lev.testing.pool``): a world of each size started once
and reused, megatron's parallel state set up for the job's layout and torn down after it. ``fresh=True``
always starts new ranks: for a body that needs a new process (launcher variables, exit codes, process-wide
state such as the kernel registry). A failure on any rank raises
``DistributedFailure`` (an ``AssertionError``, so pytest reports it as a test failure) with every failed
rank's traceback; ``fn`` must be a module-level function.
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence

from megatron_lev.distributed import RankFailure, spawn_ranks

from .pool import get_pool


class DistributedFailure(RankFailure, AssertionError):
    """One or more ranks failed; the message holds each failed rank's traceback."""


def run_distributed(
    fn: Callable,
    world_size: int,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    args: Sequence = (),
    kwargs: Optional[dict] = None,
    timeout: float = 600.0,
    collective_timeout: float = 120.0,
    fresh: bool = False,
    pooled: Optional[bool] = None,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    if pooled is None:
        pooled = os.environ.get("MEGATRON_LEV_RANK_POOL") == "1"
    if fresh or not pooled:
        return spawn_ranks(fn, world_size, tp=tp, pp=pp, vpp=vpp, seed=seed, args=args, kwargs=kwargs,
                           timeout=timeout, collective_timeout=collective_timeout, failure_cls=DistributedFailure)
    return get_pool(world_size).run(fn, tp=tp, pp=pp, vpp=vpp, seed=seed, args=args, kwargs=kwargs,
                                    timeout=timeout, collective_timeout=collective_timeout,
                                    failure_cls=DistributedFailure)
