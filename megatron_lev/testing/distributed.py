"""Run a test body on N gloo ranks with megatron-core's model-parallel groups set up.

    results = run_distributed(check_fn, world_size=4, tp=2, pp=2, args=(...))

A thin layer over ``megatron_lev.distributed.spawn_ranks`` for tests: megatron's RNG tracker is
seeded (``seed``, default 1234) and a failure on any rank raises ``DistributedFailure`` (an
``AssertionError``, so pytest reports it as a test failure) with every failed rank's traceback.
Start-up of a rank costs several seconds of imports, so group several checks in one call.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from megatron_lev.distributed import RankFailure, spawn_ranks


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
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results."""
    return spawn_ranks(fn, world_size, tp=tp, pp=pp, vpp=vpp, seed=seed, args=args, kwargs=kwargs,
                       timeout=timeout, collective_timeout=collective_timeout, failure_cls=DistributedFailure)
