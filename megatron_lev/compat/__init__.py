"""Compatibility layers. ``compat.apply()`` installs the CPU backend for megatron-core when
CUDA is unavailable (see ``cpu.py``); it is a no-op on GPU machines. Inside the package only
``megatron_lev.distributed.init_distributed`` calls it. ``versions.py`` holds what differs between
the supported megatron-core releases (0.16.1 and 0.19.x)."""

from .cpu import apply, hit_counts, is_applied
from .versions import checkpoint_refusal, megatron_core_version, quiet_repeated_warnings, unreadable_checkpoint

__all__ = ["apply", "checkpoint_refusal", "hit_counts", "is_applied", "megatron_core_version",
           "quiet_repeated_warnings", "unreadable_checkpoint"]
