"""Process start-up and launch: the parallel layout and its rules, the one distributed bootstrap (process
group, megatron's parallel state, the CPU backend without CUDA) and the launcher that runs a function on
local CPU ranks."""

from .bootstrap import BACKENDS, DistributedSetup, destroy_distributed, init_distributed, report_error, \
    reset_after_job, set_seed
from .layout import DistributedConfigError, ParallelLayout, check_layout
from .spawn import RankFailure, spawn_ranks

__all__ = [
    "BACKENDS",
    "DistributedConfigError",
    "DistributedSetup",
    "ParallelLayout",
    "RankFailure",
    "check_layout",
    "destroy_distributed",
    "init_distributed",
    "report_error",
    "reset_after_job",
    "set_seed",
    "spawn_ranks",
]
