"""Helpers for testing megatron-lev on CPU ranks (gloo)."""

from .distributed import DistributedFailure, run_distributed

__all__ = ["DistributedFailure", "run_distributed"]
