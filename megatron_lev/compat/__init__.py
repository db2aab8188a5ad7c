"""Compatibility layers. ``compat.apply()`` installs the CPU backend for megatron-core when
CUDA is unavailable (see ``cpu.py``); it is a no-op on GPU machines. Inside the package only
``megatron_lev.distributed.init_distributed`` calls it."""

from .cpu import apply, hit_counts, is_applied

__all__ = ["apply", "hit_counts", "is_applied"]
