"""Helpers for child processes (kept free of heavy imports: spawned children import this module)."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass
