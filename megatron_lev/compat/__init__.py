"""Compatibility layers. ``compat.apply()`` installs the CPU backend for megatron-core when
CUDA is unavailable (see ``cpu.py``); it is a no-op on GPU machines. Inside the package only
``megatron_lev.distributed.init_distributed`` calls it. ``versions.py`` holds what differs between
the supported megatron-core releases (0.16.1 and 0.19.x).

``cpu.py`` (which imports torch) is loaded on first use, so that importing the package stays light:
``megatron_lev/__init__.py`` installs a logging filter from ``versions.py`` before anything imports torch."""

from .versions import checkpoint_refusal, megatron_core_version, quiet_repeated_warnings, unreadable_checkpoint

_CPU_NAMES = ("apply", "hit_counts", "is_applied", "remove", "reset_hit_counts")

__all__ = ["apply", "checkpoint_refusal", "hit_counts", "is_applied", "megatron_core_version",
           "quiet_repeated_warnings", "remove", "reset_hit_counts", "unreadable_checkpoint"]


def __getattr__(name: str):
    if name in _CPU_NAMES:
        from . import cpu

        return getattr(cpu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
