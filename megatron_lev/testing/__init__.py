"""Helpers for testing megatron-lev on CPU ranks (gloo): ``run_distributed`` and its rank pool, and
``run_cli`` and ``run_torchrun`` (a script's command-line run, on one rank or on several, without the
start-up imports); ``train_records``, a run's ``--metrics-file`` by iteration."""

from .cli import free_port, run_cli, run_torchrun
from .distributed import DistributedFailure, run_distributed
from .metrics import train_records
from .pool import RankPool, close_pools, get_pool

__all__ = ["DistributedFailure", "RankPool", "close_pools", "free_port", "get_pool", "run_cli", "run_distributed",
           "run_torchrun", "train_records"]
