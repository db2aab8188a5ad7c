"""Run a conversion step on ``tp x pp`` CPU processes (gloo) with megatron-core's parallel groups.

Conversions run on CPU whatever the machine: each rank holds only its shard of the model, and
dist_checkpointing reads and writes the shards. CUDA is hidden from the ranks (gloo carries CPU
tensors; the CPU backend of ``megatron_lev.compat`` is installed). A ``ConversionError`` raised on a
rank comes back as one line; any other failure carries the rank's traceback. The process handling is
``megatron_lev.distributed``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from megatron_lev.distributed import RankFailure, spawn_ranks

from .source import ConversionError


class ConversionRankFailure(RankFailure):
    """A conversion rank failed unexpectedly (the message holds its traceback)."""


def run_ranks(fn: Callable, *, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, args: Sequence = (),
              timeout: float = 24 * 3600.0, collective_timeout: float = 3600.0) -> List[Any]:
    """``fn(*args)`` on ``tp*pp`` ranks (data-parallel size 1); the per-rank results (picklable)."""
    return spawn_ranks(fn, tp * pp, tp=tp, pp=pp, vpp=vpp, args=args, timeout=timeout,
                       collective_timeout=collective_timeout, passthrough=(ConversionError,),
                       failure_cls=ConversionRankFailure, hide_cuda=True, quiet=True)
